"""Generate text from a Hugging Face checkpoint (GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3 text, and the mixtures of experts Mixtral and Qwen3-MoE), e.g. one written by
examples/finetune_hf.py --out, with tensor parallelism and a KV cache.

    python examples/generate.py --hf-dir DIR --prompt "Once upon a time" [--prompt "..."]
        [--tokenizer tokenizer.json|bytes] [--max-new-tokens 32]
        [--temperature 0.8 --top-k 50 --top-p 0.95 --seed 0] [--mesh 1,4]
    python examples/generate.py --hf-dir DIR --prompt-ids 1,2,3 --mesh 1,2,4
        [--context-parallel ring|ulysses]
    python examples/generate.py --hf-dir DIR --prompt-ids 1,2,3 [--prompt-ids 4,5]

Each ``--prompt`` (or ``--prompt-ids``, token ids) is one row of the batch, any lengths.
Text prompts are encoded and decoded with the ``tokenizer.json`` in ``DIR`` (as
examples/finetune_hf.py --out writes it; Hugging Face ``tokenizers``, no transformers
needed), or ``--tokenizer``: another ``tokenizer.json``, or ``bytes`` (UTF-8 bytes, the
byte-level models of examples/train_gpt.py). ``--temperature 0`` (the default) is greedy
decoding. Rows end at the checkpoint's ``eos_token_id`` (config.json) unless
``--ignore-eos``. The mesh is DATA,TENSOR or DATA,CONTEXT,TENSOR
(``sp_jax.models.generate``: with a context axis the prompts are prefilled with
``--context-parallel`` attention, ring by default, and the KV cache is split over the
context axis), or ``data=D,expert=E,tensor=T`` (also ``context=C``) for a mixture of
experts (its experts over the expert axis); CPU-only machines simulate its devices.
"""

from __future__ import annotations

import sp_jax  # first: on a machine without a GPU, JAX then starts quietly

# isort: split
import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

import sp_jax.training as training
from sp_jax.models import generate, hf
from sp_jax.training import cli
from sp_jax.xla_flags import simulate_cpu_devices


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated token ids") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more ids >= 0")
    return ids


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (a usage error, exit 2, names the bad one) before JAX starts."""
    p = argparse.ArgumentParser(description=cli.description(__doc__),
                                formatter_class=cli.HelpFormatter)
    add = p.add_argument
    add("--hf-dir", required=True, help="Hugging Face checkpoint directory")
    add("--tokenizer", default=None,
        help="tokenizer.json, or 'bytes' (default: the tokenizer.json in --hf-dir)")
    add("--prompt", action="append", default=[], help="a prompt (text; repeat for a batch)")
    add("--prompt-ids", action="append", default=[], type=_ids,
        help="a prompt as comma-separated token ids (repeatable)")
    add("--max-new-tokens", type=int, default=32, help="new tokens per prompt (at most)")
    add("--temperature", type=float, default=0.0, help="0: greedy; else sampling")
    add("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    add("--top-p", type=float, default=None, help="sample within this probability mass")
    add("--seed", type=int, default=0, help="the sampling key")
    add("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    add("--mesh", default="1,4", help="DATA,TENSOR or DATA,CONTEXT,TENSOR mesh shape, or "
        "data=D,expert=E,tensor=T (a mixture of experts' experts over the expert axis)")
    add("--context-parallel", choices=("ring", "ulysses"), default="ring",
        help="the prefill's attention across a context axis (the KV cache split over it)")
    add("--precision", choices=("fp32", "bf16"), default="fp32", help="compute dtype")
    a = p.parse_args(argv)
    if bool(a.prompt) == bool(a.prompt_ids):
        p.error("give --prompt (text) or --prompt-ids (token ids), not both nor neither")
    if a.max_new_tokens < 1 or a.temperature < 0 or (a.top_k is not None and a.top_k < 1) \
            or (a.top_p is not None and not 0 < a.top_p <= 1):
        p.error("--max-new-tokens >= 1, --temperature >= 0, --top-k >= 1, 0 < --top-p <= 1")
    try:
        a.mesh_shape = training.parse_mesh(a.mesh)
    except ValueError as e:
        p.error(str(e))
    if a.mesh_shape[0] != 1:
        p.error(f"--mesh {a.mesh}: generation runs on a DATA,TENSOR or DATA,CONTEXT,TENSOR "
                "mesh, or data=D,expert=E,context=C,tensor=T (no stage axis)")
    if not pathlib.Path(a.hf_dir, "config.json").is_file():
        p.error(f"--hf-dir {a.hf_dir}: no config.json there")
    if a.prompt and a.tokenizer is None:  # the checkpoint's own, as finetune_hf.py --out writes
        found = pathlib.Path(a.hf_dir, "tokenizer.json")
        if not found.is_file():
            p.error(f"--prompt: --hf-dir {a.hf_dir} has no tokenizer.json; pass --tokenizer "
                    "(a tokenizer.json, or bytes) or --prompt-ids")
        a.tokenizer = str(found)
    return a


def main(args: argparse.Namespace) -> int:
    from sp_jax.data.tokenizer import ByteTokenizer, check_vocab, load_tokenizer

    mesh = training.build_mesh(args.mesh_shape, training.MESH_AXES)
    overrides = {"dtype": jnp.bfloat16} if args.precision == "bf16" else {}
    with jax.set_mesh(mesh):
        try:
            parallel = sp_jax.ParallelConfig(
                expert_axis="expert" if args.mesh_shape[2] > 1 else None,
                context_parallel=args.context_parallel if args.mesh_shape[3] > 1 else None)
            model = hf.from_hf(args.hf_dir, parallel=parallel, rngs=nnx.Rngs(0), **overrides)
            tok = None
            if args.tokenizer is not None:
                tok = ByteTokenizer() if args.tokenizer == "bytes" else \
                    load_tokenizer(args.tokenizer)
                check_vocab(tok, model.config.vocab_size)
            prompts = args.prompt_ids or [tok.encode(text) for text in args.prompt]
            eos = None if args.ignore_eos else model.config.eos_token_id
            t0 = time.perf_counter()
            out = generate(model, prompts, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           eos_token_id=eos, pad_token_id=model.config.pad_token_id,
                           rngs=jax.random.key(args.seed))
            seconds = time.perf_counter() - t0
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    for prompt, tokens, n in zip(prompts, out.tokens, out.lengths, strict=True):
        new = tokens[:n].tolist()
        if tok is None:
            print(f"{','.join(map(str, prompt))} -> {','.join(map(str, new))}")
        else:
            print(tok.decode([*prompt, *new]))
    print(f"{int(out.lengths.sum())} tokens in {seconds:.1f} s (compiling included) on mesh "
          f"{training.mesh_description(mesh)}")
    return 0


if __name__ == "__main__":
    args = parse()
    _, d, e, c, t = args.mesh_shape
    simulate_cpu_devices(d * e * c * t)  # no GPU here: before JAX starts its backend
    sys.exit(main(args))
