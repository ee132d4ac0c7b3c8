"""Regenerates tests/fixtures/moe_aux_loss.npz (run by hand): transformers' Mixtral
load-balancing loss on random router logits, the reference of
tests/test_moe.py::test_aux_loss_equals_transformers_mixtral.

    pip install torch transformers numpy   # in an environment of its own
    python scripts/make_moe_aux_fixture.py [--out tests/fixtures/moe_aux_loss.npz]

Writes ``logits`` fp32 ``[3 layers, 40 tokens, 8 experts]``, ``top_k`` (2) and
``aux_loss``: ``transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func``
of the layers' logits (a tuple, one ``[tokens, experts]`` tensor per layer, as the model
passes its ``router_logits``), without an attention mask. Nothing of sp_jax is imported.
"""

import argparse

import numpy as np
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/moe_aux_loss.npz")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(3, 40, 8)) * 2).astype(np.float32)
    top_k = 2
    loss = load_balancing_loss_func(tuple(torch.from_numpy(x) for x in logits), 8, top_k)
    np.savez(args.out, logits=logits, top_k=np.int32(top_k),
             aux_loss=np.float32(loss.item()))
    print(f"wrote {args.out}: aux_loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
