"""Continue training a Hugging Face GPT-2 or Llama checkpoint with tensor + sequence
parallelism, and write it back as a Hugging Face checkpoint.

    python examples/finetune_hf.py --hf-dir DIR [--mesh 2,4] [--steps 50] [--data ids.npy]
        [--out DIR_OUT] [--precision bf16] [--fsdp] [--recompute-allgather]

``DIR`` is a local checkpoint directory (``config.json`` + ``*.safetensors``, e.g. from
``huggingface-cli download gpt2 --local-dir DIR`` or ``save_pretrained``); neither torch nor
transformers is needed. The training data are token ids of the checkpoint's tokenizer: a
``.npy`` array or a raw ``.bin`` of uint16 ids (nanoGPT's format); without ``--data`` the
run uses synthetic sequences (arithmetic progressions over the vocabulary) that any model
can learn, to show the loop works. Every step's batch depends only on ``(--seed, step)``.
CPU-only machines simulate the mesh's devices.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

import sp_jax
from sp_jax.models import hf
from sp_jax.training import TrainStep, build_mesh
from sp_jax.xla_flags import apply_xla_flags, cpu_simulation_flags


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--mesh", default="2,4", help="DATA,TENSOR (or DATA,CONTEXT,TENSOR)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (constant "
                   "after a linear warmup of steps / 10)")
    p.add_argument("--data", default=None, help=".npy or uint16 .bin token ids (default: "
                   "synthetic sequences)")
    p.add_argument("--out", default=None, help="write the trained model here (Hugging Face "
                   "format)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="compute dtype (parameters stay in the checkpoint's dtype)")
    p.add_argument("--fsdp", action="store_true", help="shard parameters over DATA too")
    p.add_argument("--recompute-allgather", action="store_true",
                   help="re-gather sequence-parallel inputs in backward")
    p.add_argument("--no-dropout", action="store_true", help="dropout rates of 0")
    p.add_argument("--seed", type=int, default=0, help="data order and dropout")
    a = p.parse_args(argv)
    try:
        a.mesh_shape = sp_jax.training.parse_mesh(a.mesh)
    except ValueError as e:
        p.error(str(e))
    if not pathlib.Path(a.hf_dir, "config.json").is_file():
        p.error(f"--hf-dir {a.hf_dir}: no config.json there (a Hugging Face checkpoint "
                "directory holds config.json and *.safetensors)")
    data, _, tensor = a.mesh_shape
    if a.batch_size % data or a.seq_len % tensor:
        p.error(f"--batch-size {a.batch_size} must divide by DATA={data} and --seq-len "
                f"{a.seq_len} by TENSOR={tensor}")
    return a


class Batches:
    """Windows of ``seq_len + 1`` ids: from ``ids`` at positions drawn from ``(seed,
    step)``, or synthetic progressions ``start + stride * i (mod vocab)``."""

    def __init__(self, ids: np.ndarray | None, vocab: int, seq_len: int, batch: int,
                 seed: int):
        if ids is not None and len(ids) <= seq_len + 1:
            raise SystemExit(f"error: --data holds {len(ids)} ids, fewer than one sequence")
        if ids is not None and (ids.min() < 0 or ids.max() >= vocab):
            raise SystemExit(f"error: --data ids range over [{ids.min()}, {ids.max()}], "
                             f"outside the model's vocabulary of {vocab}")
        self.ids, self.vocab, self.seq_len, self.batch, self.seed = ids, vocab, seq_len, \
            batch, seed

    def __call__(self, step: int, held_out: bool = False) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, int(held_out), step])
        n = self.seq_len + 1
        if self.ids is None:
            start = rng.integers(0, self.vocab, (self.batch, 1))
            stride = rng.integers(1, 8, (self.batch, 1))
            windows = (start + stride * np.arange(n)) % self.vocab
        else:
            offsets = rng.integers(0, len(self.ids) - n, self.batch)
            windows = np.stack([self.ids[o:o + n] for o in offsets])
        windows = windows.astype(np.int32)
        return {"tokens": windows[None, :, :-1], "labels": windows[None, :, 1:]}


def load_ids(path: str | None) -> np.ndarray | None:
    if path is None:
        return None
    if path.endswith(".npy"):
        return np.load(path, mmap_mode="r").reshape(-1)
    return np.memmap(path, dtype=np.uint16, mode="r")


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    data, context, tensor = args.mesh_shape
    names = ("data", "context", "tensor") if context > 1 else ("data", "tensor")
    mesh = build_mesh(args.mesh_shape if context > 1 else (data, tensor), names)
    parallel = sp_jax.ParallelConfig(
        recompute_allgather=args.recompute_allgather, fsdp=args.fsdp,
        context_parallel="ring" if context > 1 else None,
        wgrad_dtype=jnp.float32 if args.precision == "bf16" else None)
    overrides = {"dtype": jnp.bfloat16} if args.precision == "bf16" else {}
    if args.no_dropout:
        overrides.update(dropout=0.0, attention_dropout=0.0)
    with jax.set_mesh(mesh):
        model = hf.from_hf(args.hf_dir, parallel=parallel, rngs=nnx.Rngs(args.seed),
                           **overrides)
        cfg = model.config
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        print(f"loaded {args.hf_dir}: {cfg.num_layers} layers, hidden {cfg.hidden}, "
              f"{cfg.num_heads} heads ({cfg.num_kv_heads} key/value), vocabulary "
              f"{cfg.vocab_size}, {n_params / 1e6:.2f}M parameters; mesh "
              f"{sp_jax.training.mesh_description(args.mesh_shape)}")
        if args.seq_len > cfg.max_seq_len:
            raise SystemExit(f"error: --seq-len {args.seq_len} exceeds the model's "
                             f"{cfg.max_seq_len} positions")
        batches = Batches(load_ids(args.data), cfg.vocab_size, args.seq_len, args.batch_size,
                          args.seed)
        schedule = optax.join_schedules([optax.linear_schedule(0.0, args.lr,
                                                               max(1, args.steps // 10)),
                                         optax.constant_schedule(args.lr)],
                                        [max(1, args.steps // 10)])
        model.train()  # dropout as the checkpoint's config says (off with --no-dropout)
        step = TrainStep(model, optax.chain(optax.clip_by_global_norm(1.0),
                                            optax.adamw(schedule, weight_decay=0.0)))
        place = NamedSharding(mesh, sp_jax.Layout.of(parallel).spec(None, "batch", "length"))
        one = NamedSharding(mesh, sp_jax.Layout.of(parallel).spec("batch", "length"))
        held_out = [{k: jax.device_put(v[0], one) for k, v in batches(i, True).items()}
                    for i in range(2)]
        before = step.evaluate(held_out)
        print(f"held-out loss before: {before:.4f}")
        key = jax.random.key(args.seed)
        for i in range(1, args.steps + 1):
            batch = {k: jax.device_put(v, place) for k, v in batches(i).items()}
            metrics = step(batch, jax.random.fold_in(key, i))
            loss = float(metrics["loss"])
            if not np.isfinite(loss):
                print(f"error: loss is {loss} at step {i}; try a lower --lr", file=sys.stderr)
                return 1
            if i == 1 or i % 10 == 0 or i == args.steps:
                print(f"step {i}: loss {loss:.4f}")
        after = step.evaluate(held_out)
        print(f"held-out loss after {args.steps} steps: {after:.4f} (before {before:.4f})")
        step.sync_model()
        if args.out:
            hf.to_hf(model, args.out)
            print(f"wrote {args.out} (transformers: AutoModelForCausalLM.from_pretrained)")
    print(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    args = parse()
    d, c, t = args.mesh_shape
    apply_xla_flags(cpu_simulation_flags(d * c * t))  # before JAX starts; no effect on GPUs
    sys.exit(main(args))
