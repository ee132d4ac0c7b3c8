"""Regenerates the golden Hugging Face fixtures of tests/test_hf.py (run by hand).

    pip install torch transformers safetensors   # in an environment of its own
    python scripts/make_hf_fixtures.py [--out tests/fixtures/hf]

For each of a small random-init GPT-2 and a grouped-query Llama (Llama-3.1 rope scaling)
it writes ``<out>/<name>/`` with transformers' own ``save_pretrained`` (``config.json``
and ``model.safetensors``) and ``golden.npz``: input ids, transformers' fp32 logits, its
loss for ``labels=input_ids`` and the gradients of that loss for a few named tensors.
Nothing of sp_jax is imported: the fixtures are an independent reference.

    python scripts/make_hf_fixtures.py --check DIR

loads an ``sp_jax.models.hf.to_hf`` output directory with transformers (strict: every
tensor present, none unexpected) and checks its logits against a ``golden.npz`` in it.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import torch
import transformers

SEQ, BATCH = 16, 2
GRADS = {  # the tensors whose gradients are recorded
    "gpt2": ["transformer.h.0.attn.c_attn.weight", "transformer.wte.weight",
             "transformer.h.1.mlp.c_fc.bias"],
    "llama": ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.gate_proj.weight",
              "model.embed_tokens.weight", "lm_head.weight"],
}


def models() -> dict[str, transformers.PreTrainedModel]:
    gpt2 = transformers.GPT2Config(
        vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=8,
        activation_function="gelu_new", layer_norm_epsilon=1e-5)
    llama = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
                      "rope_theta": 10000.0})
    out = {}
    for name, cfg, cls in (("gpt2", gpt2, transformers.GPT2LMHeadModel),
                           ("llama", llama, transformers.LlamaForCausalLM)):
        torch.manual_seed(0)
        model = cls(cfg).float().eval()
        with torch.no_grad():  # non-trivial norms and biases (the inits are 1 and 0)
            for pname, p in model.named_parameters():
                if pname.endswith("bias") or "norm" in pname or "ln_" in pname:
                    p.add_(0.1 * torch.randn_like(p))
        out[name] = model
    return out


def golden(model, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, vocab, (BATCH, SEQ)).astype(np.int64)
    tokens = torch.from_numpy(ids)
    model.zero_grad()
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    params = dict(model.named_parameters())
    result = {"input_ids": ids.astype(np.int32),
              "logits": out.logits.detach().numpy().astype(np.float32),
              "loss": np.float32(out.loss.item())}
    for name in GRADS[model.config.model_type]:
        result["grad/" + name] = params[name].grad.numpy().astype(np.float32)
    return result


def generate(out: pathlib.Path) -> None:
    for name, model in models().items():
        directory = out / name
        directory.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(directory, safe_serialization=True)
        np.savez(directory / "golden.npz", **golden(model, model.config.vocab_size))
        print(f"wrote {directory}")


def check(directory: pathlib.Path) -> None:
    """Strict load of an sp_jax-written checkpoint; logits against its golden.npz."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True, dtype=torch.float32)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} or info.get(
        "error_msgs")
    if problems:
        raise SystemExit(f"strict loading failed: {problems}")
    model.eval()
    ref = np.load(directory / "golden.npz")
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(ref["input_ids"].astype(np.int64))).logits
    err = float(np.max(np.abs(logits.numpy() - ref["logits"])))
    print(f"{directory}: loaded strictly, max |logits - golden| = {err:.2e}")
    if err > 1e-5:
        raise SystemExit("logits differ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(pathlib.Path(__file__).parents[1] / "tests" /
                                         "fixtures" / "hf"))
    p.add_argument("--check", default=None, help="a to_hf directory to load strictly")
    a = p.parse_args()
    if a.check:
        check(pathlib.Path(a.check))
    else:
        generate(pathlib.Path(a.out))


if __name__ == "__main__":
    main()
