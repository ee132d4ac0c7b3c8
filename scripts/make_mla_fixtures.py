"""Regenerates the golden fixtures of multi-head latent attention (tests/test_mla.py) from
transformers' ``DeepseekV3`` modules (run by hand, in an environment of its own):

    pip install torch transformers numpy
    python scripts/make_mla_fixtures.py [--out tests/fixtures/mla]

Writes, fp32, with random weights (Hugging Face's names, ``[out, in]`` as torch holds
them) and nothing of sp_jax imported:

- ``attention_<name>.npz`` for two tiny configs (``qlora``: ``q_lora_rank=12`` with
  ``rope_interleave=True``; ``direct``: ``q_lora_rank=None``, ``rope_interleave=False``;
  hidden 32, 4 heads, ``kv_lora_rank`` 16, ``qk_nope_head_dim`` 8, ``qk_rope_head_dim`` 4,
  ``v_head_dim`` 6): the weights ``w/<name>`` of an RMSNorm ``input_layernorm`` and a
  ``DeepseekV3Attention``, ``x [2, 16, 32]``, ``y = x + attention(norm(x))`` (causal,
  rotary positions ``0..15``), the gradients ``grad/x`` and ``grad/<name>`` of
  ``sum(y * cotangent)`` for a random ``cotangent``;
- ``model.npz``: a 2-layer ``DeepseekV3ForCausalLM`` (the ``qlora`` attention, dense
  SwiGLU MLPs in every layer: ``first_k_dense_replace=2``, untied, vocab 64): its
  weights, ``input_ids [2, 16]``, ``logits``, and greedy generation of 3 prompts
  (``gen_prompt_<i>``, ``gen_tokens_<i>``: 12 new tokens, no end-of-sequence token);
- ``mscale.json``: ``yarn_apply_mscale``'s softmax scales for a few YaRN settings.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.modeling_rope_utils import yarn_apply_mscale
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

SHAPE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rms_norm_eps=1e-6,
             attention_bias=False, max_position_embeddings=64)


def _config(**kw):
    cfg = DeepseekV3Config(**SHAPE, **kw)
    cfg._attn_implementation = "eager"
    return cfg


def _randomize(module, gen):
    with torch.no_grad():
        for _, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.ndim > 1 else 0.2)
                    + (1.0 if p.ndim == 1 else 0.0))


def attention(name, q_lora_rank, interleave, out):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1 if q_lora_rank else 2)
    cfg = _config(q_lora_rank=q_lora_rank, rope_interleave=interleave)
    attn, norm = DeepseekV3Attention(cfg, 0), DeepseekV3RMSNorm(32, eps=cfg.rms_norm_eps)
    _randomize(attn, gen)
    _randomize(norm, gen)
    rope = DeepseekV3RotaryEmbedding(cfg)
    x = torch.randn(2, 16, 32, generator=gen, requires_grad=True)
    cot = torch.randn(2, 16, 32, generator=gen)
    pos = torch.arange(16)[None].expand(2, -1)
    mask = torch.full((16, 16), float("-inf")).triu(1)[None, None].expand(2, 1, 16, 16)
    y = x + attn(norm(x), rope(x, pos), mask)[0]
    (y * cot).sum().backward()
    arrays = {"x": x.detach(), "y": y.detach(), "grad/x": x.grad}
    for prefix, mod in (("attn.", attn), ("norm.", norm)):
        for pname, p in mod.named_parameters():
            arrays["w/" + prefix + pname] = p.detach()
            arrays["grad/" + prefix + pname] = p.grad
    np.savez(os.path.join(out, f"attention_{name}.npz"), cotangent=cot.numpy(),
             **{k: v.numpy() for k, v in arrays.items()})


def model(out):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    cfg = _config(q_lora_rank=12, rope_interleave=True, vocab_size=64, num_hidden_layers=2,
                  intermediate_size=48, first_k_dense_replace=2, tie_word_embeddings=False,
                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                  moe_intermediate_size=16, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    m = DeepseekV3ForCausalLM(cfg).eval()
    _randomize(m, gen)
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    arrays = {"w/" + k: v.detach().numpy() for k, v in m.state_dict().items()}
    with torch.no_grad():
        arrays["logits"] = m(ids).logits.numpy()
        for i, n in enumerate((5, 9, 3)):
            prompt = torch.randint(0, 64, (1, n), generator=gen)
            gen_ids = m.generate(prompt, do_sample=False, max_new_tokens=12, min_new_tokens=12)
            arrays[f"gen_prompt_{i}"] = prompt[0].numpy().astype(np.int32)
            arrays[f"gen_tokens_{i}"] = gen_ids[0, n:].numpy().astype(np.int32)
    np.savez(os.path.join(out, "model.npz"), input_ids=ids.numpy().astype(np.int32), **arrays)


def mscale(out):
    settings = [dict(rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0),
                dict(rope_type="yarn", factor=32.0, mscale=0.707, mscale_all_dim=0.707),
                dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0),
                dict(rope_type="default")]
    rows = [dict(rope=s, qk_head_dim=192, scale=yarn_apply_mscale(s, 192 ** -0.5))
            for s in settings]
    with open(os.path.join(out, "mscale.json"), "w") as f:
        json.dump(rows, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/mla")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    attention("qlora", 12, True, args.out)
    attention("direct", None, False, args.out)
    model(args.out)
    mscale(args.out)


if __name__ == "__main__":
    main()
