"""Train a byte-level, sequence-parallel GPT with a jitted training loop.

On a CPU-only machine it simulates 8 devices (mesh data=2 x tensor=4); on GPUs it uses the
real ones. The text is, by default, the Python standard library's own source (no download):
every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, sorted, up to
``--max-data-bytes``; the last 5% of the byte stream is held out for evaluation. Each
step draws random windows of ``seq_len + 1`` bytes from a generator seeded by
``(--seed, step)``, so the data a step sees is a pure function of its number and a resumed
run continues exactly where the interrupted one left off.

    python examples/train_gpt.py [--steps 600] [--mesh 2,4] [--precision bf16]
        [--plot docs/loss.png] [--log-json runs/gpt.jsonl] [--ckpt-dir runs/ckpt --save-every 50]

Learning rate: linear warmup over ``--warmup-steps`` (steps up to the warmup do not depend
on ``--steps``), then cosine decay to ``lr / 10`` at ``--steps``. The progress bar shows
the loss, tokens/s and per-device memory: parameters and optimizer state (one device's
shards) and ``act(temp)``, the compiled step's XLA temp buffers (activations kept for the
backward pass, gradients in flight, workspace). Checkpoints (orbax) hold the parameters,
the optimizer state and the step; ``--resume`` restores the latest into the same shardings.
A non-finite loss stops the run (exit status 1) naming the step.
"""

from __future__ import annotations

import argparse
import os
import sys


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the absent ones (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=_HelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=600, help="total optimizer steps")
    g.add_argument("--mesh", default="2,4", help="DATA,TENSOR mesh shape")
    g.add_argument("--cpu-devices", type=int, default=None,
                   help="simulated devices on the CPU platform (default: DATA*TENSOR)")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the initialisation, the dropout keys and the data order")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=2, help="transformer blocks")
    g.add_argument("--hidden", type=int, default=128, help="model width")
    g.add_argument("--heads", type=int, default=4,
                   help="attention heads (a multiple of TENSOR)")
    g.add_argument("--seq-len", type=int, default=128,
                   help="tokens (bytes) per sequence (a multiple of TENSOR)")
    g.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="compute dtype (parameters and optimizer state stay fp32)")
    g.add_argument("--recompute-allgather", action="store_true",
                   help="SP column layers re-gather their input in backward")
    g = p.add_argument_group("optimization")
    g.add_argument("--batch-size", type=int, default=16,
                   help="global batch (sequences) per optimizer step")
    g.add_argument("--micro-batches", type=int, default=2,
                   help="gradient-accumulation micro-batches per step")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-steps", type=int, default=20,
                   help="linear warmup steps, then cosine decay to lr/10 at --steps")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g = p.add_argument_group("data and evaluation")
    g.add_argument("--data", nargs="+", default=None, metavar="GLOB",
                   help="text files: glob(s) (recursive **, quote them) or paths; "
                        "default: the stdlib's **/*.py")
    g.add_argument("--max-data-bytes", type=int, default=8 << 20,
                   help="read files in sorted order up to this many bytes")
    g.add_argument("--eval-every", type=int, default=100,
                   help="evaluate before training, every K steps and after the last; "
                   "0: only after the last")
    g.add_argument("--eval-batches", type=int, default=4,
                   help="held-out batches (of batch-size/micro-batches sequences) per eval")
    g = p.add_argument_group("output")
    g.add_argument("--ckpt-dir", default=None, help="orbax checkpoint directory")
    g.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every K steps (and after the last); 0: never")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --ckpt-dir")
    g.add_argument("--log-json", default=None,
                   help="JSON lines: one record per step, plus eval records")
    g.add_argument("--plot", default=None, help="write the loss curve to this PNG")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    try:
        args.data_size, args.tensor_size = (int(v) for v in args.mesh.split(","))
    except ValueError:
        p.error(f"--mesh {args.mesh!r}: expected DATA,TENSOR, e.g. 2,4")
    for name in ("steps", "layers", "hidden", "heads", "seq_len", "batch_size",
                 "micro_batches", "data_size", "tensor_size", "eval_batches"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.batch_size % args.micro_batches:
        p.error(f"--batch-size {args.batch_size} is not divisible by "
                f"--micro-batches {args.micro_batches}")
    if (args.batch_size // args.micro_batches) % args.data_size:
        p.error(f"the micro-batch ({args.batch_size // args.micro_batches} sequences) is not "
                f"divisible by the data size {args.data_size}")
    if args.seq_len % args.tensor_size:
        p.error(f"--seq-len {args.seq_len} is not divisible by the tensor size "
                f"{args.tensor_size} (sequence parallelism splits it)")
    if args.heads % args.tensor_size or args.hidden % args.heads:
        p.error(f"--heads {args.heads} must be a multiple of the tensor size "
                f"{args.tensor_size} and divide --hidden {args.hidden}")
    if (args.save_every or args.resume) and not args.ckpt_dir:
        p.error("--save-every / --resume need --ckpt-dir")
    if args.warmup_steps < 0 or args.save_every < 0 or args.eval_every < 0:
        p.error("--warmup-steps, --save-every and --eval-every must be >= 0")
    return args


def _configure_devices(args: argparse.Namespace) -> None:
    """Simulated CPU devices must be configured before JAX initialises its backend.

    The device-count flag only affects the host platform, so the same run uses the real
    devices on GPUs. ``cse_barrier_expander`` off keeps recompute's backward re-all-gather
    on XLA:CPU (XLA:GPU keeps it by itself). Flags already in XLA_FLAGS win.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    count = args.cpu_devices or args.data_size * args.tensor_size
    for flag in (f"--xla_force_host_platform_device_count={count}",
                 "--xla_disable_hlo_passes=cse_barrier_expander"):
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


if __name__ == "__main__":
    args = _parse()
    _configure_devices(args)

import glob  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import sp_jax  # noqa: E402
from sp_jax.models import GPT, GPTConfig  # noqa: E402
from sp_jax.training import TrainStep  # noqa: E402

VAL_FRACTION = 0.05

# -- data ---------------------------------------------------------------------------------


def load_bytes(patterns: list[str] | None, max_bytes: int) -> tuple[np.ndarray, int, str]:
    """The files matching ``patterns`` (default: the stdlib's ``**/*.py`` outside
    site-packages), sorted and concatenated into one uint8 stream of at most
    ``max_bytes``. Returns the stream, the number of files read and a description."""
    if patterns is None:
        pattern = os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")
        files = [f for f in glob.glob(pattern, recursive=True)
                 if "site-packages" not in f and "dist-packages" not in f]
        patterns = [pattern]
    else:
        files = [f for p in patterns for f in glob.glob(p, recursive=True)]
    files = sorted({f for f in files if os.path.isfile(f)})
    chunks, total = [], 0
    for path in files:
        if total >= max_bytes:
            break
        with open(path, "rb") as fh:
            data = fh.read(max_bytes - total)
        chunks.append(data)
        total += len(data)
    if not chunks:
        sys.exit(f"error: no files match --data {' '.join(patterns)}")
    where = " ".join(patterns) if len(patterns) <= 2 else f"{patterns[0]} ... ({len(patterns)})"
    return np.frombuffer(b"".join(chunks), dtype=np.uint8), len(chunks), where


def split(stream: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic split: the last ``VAL_FRACTION`` of the stream is held out."""
    cut = int(len(stream) * (1 - VAL_FRACTION))
    train, val = stream[:cut], stream[cut:]
    if min(len(train), len(val)) <= seq_len + 1:
        sys.exit(f"error: {len(stream)} bytes of text are too few for --seq-len {seq_len} "
                 f"(train {len(train)}, held-out {len(val)}); use more --data")
    return train, val


def windows(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    return stream[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def train_batch(train: np.ndarray, step: int, args) -> dict[str, np.ndarray]:
    """Random windows for optimizer step ``step``: a pure function of (seed, step)."""
    rng = np.random.default_rng([args.seed, step])
    starts = rng.integers(0, len(train) - args.seq_len - 1, size=args.batch_size)
    w = windows(train, starts, args.seq_len).reshape(
        args.micro_batches, args.batch_size // args.micro_batches, args.seq_len + 1)
    return {"tokens": w[..., :-1], "labels": w[..., 1:]}


def eval_batches(val: np.ndarray, args) -> list[dict[str, np.ndarray]]:
    """A fixed held-out set: evenly spaced windows over the validation bytes."""
    size = args.batch_size // args.micro_batches
    starts = np.linspace(0, len(val) - args.seq_len - 1, size * args.eval_batches).astype(int)
    w = windows(val, starts, args.seq_len).reshape(args.eval_batches, size, args.seq_len + 1)
    return [{"tokens": b[:, :-1], "labels": b[:, 1:]} for b in w]


# -- model, optimizer, measurement --------------------------------------------------------


def lr_schedule(lr: float, warmup: int, total: int, final_fraction: float = 0.1):
    """Linear warmup to ``lr`` over ``warmup`` steps (the first step uses ``lr / warmup``),
    then cosine decay to ``final_fraction * lr`` at step ``total``."""

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = lr * (count + 1) / max(warmup, 1)
        progress = jnp.clip((count + 1 - warmup) / max(total - warmup, 1), 0.0, 1.0)
        decay = lr * (final_fraction
                      + (1 - final_fraction) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
        return jnp.where(count + 1 < warmup, warm, decay)

    return schedule


def device_bytes(tree) -> int:
    """Bytes one device holds of the arrays in ``tree`` (replicated arrays count fully)."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
               if hasattr(x, "addressable_shards"))


def compiled_temp_bytes(step: TrainStep, batch, key) -> int | None:
    """XLA's temp buffer size (activations, gradients in flight, workspace) of the compiled
    step on one device, from its ``memory_analysis()``; None where the backend does not
    report it."""
    try:
        return int(step.compile(batch, key).memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - memory analysis is best effort
        return None


def size(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f}MiB"


def abstract(tree):
    """Shape/dtype/sharding targets for restoring ``tree`` in place."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


def run_meta(args: argparse.Namespace, cfg: GPTConfig) -> dict:
    """What a checkpoint records besides the arrays: the model and the data stream."""
    model = {k: v if isinstance(v, int | float | str | bool | None) else str(v)
             for k, v in vars(cfg).items()}
    run = {k: getattr(args, k) for k in ("seed", "data", "max_data_bytes", "batch_size",
                                         "micro_batches", "lr", "warmup_steps")}
    return {"model": model, "run": run}


def check_resume(saved: dict, current: dict, step: int, ckpt_dir: str) -> None:
    """Refuses another model; warns when the data or optimizer settings changed (the run
    then continues, but no longer as the interrupted one would have)."""
    if saved.get("model") != current["model"]:
        diff = {k: (saved.get("model", {}).get(k), v) for k, v in current["model"].items()
                if saved.get("model", {}).get(k) != v}
        sys.exit(f"error: checkpoint step {step} in {ckpt_dir} holds another model "
                 f"(saved, requested): {diff}; use the same model flags or another --ckpt-dir")
    diff = {k: (saved.get("run", {}).get(k), v) for k, v in current["run"].items()
            if saved.get("run", {}).get(k) != v}
    if diff:
        print(f"warning: resuming with changed settings (saved, now): {diff}")


# -- logging and plotting -----------------------------------------------------------------


def open_log(path: str | None, start: int):
    """The JSON-lines log; when resuming from ``start``, earlier records up to it are kept
    (later ones belonged to the interrupted run) and new records are appended."""
    if path is None:
        return None, []
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    kept = []
    if start > 0 and os.path.exists(path):
        with open(path) as fh:
            records = [json.loads(line) for line in fh if line.strip()]
        kept = [r for r in records if r.get("step", 0) <= start]
    fh = open(path, "w")  # noqa: SIM115 - closed at the end of main
    for r in kept:
        fh.write(json.dumps(r) + "\n")
    fh.flush()
    return fh, kept


def plot(path: str, records: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    if train:
        steps, losses = (np.asarray(v) for v in zip(*train, strict=True))
        ax.plot(steps, losses, lw=0.8, alpha=0.35, color="C0")
        k = min(20, len(losses))
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, lw=1.5, color="C0",
                label=f"train loss ({k}-step mean)" if k > 1 else "train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", ms=4, color="C1", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    t_start = time.perf_counter()
    n_dev = args.data_size * args.tensor_size
    if len(jax.devices()) < n_dev:
        sys.exit(f"error: --mesh {args.mesh} needs {n_dev} devices, found "
                 f"{len(jax.devices())} ({jax.devices()[0].platform})")
    mesh = jax.make_mesh((args.data_size, args.tensor_size), ("data", "tensor"),
                         devices=jax.devices()[:n_dev])
    bf16 = args.precision == "bf16"
    parallel = sp_jax.ParallelConfig(recompute_allgather=args.recompute_allgather,
                                     wgrad_dtype=jnp.float32 if bf16 else None)
    cfg = GPTConfig(vocab_size=256, max_seq_len=args.seq_len, num_layers=args.layers,
                    num_heads=args.heads, hidden=args.hidden, dropout=0.0,
                    tie_embeddings=True, dtype=jnp.bfloat16 if bf16 else jnp.float32,
                    param_dtype=jnp.float32)

    stream, n_files, pattern = load_bytes(args.data, args.max_data_bytes)
    train, val = split(stream, args.seq_len)
    held_out = eval_batches(val, args)

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(lr_schedule(args.lr, args.warmup_steps, args.steps),
                    weight_decay=args.weight_decay))
    batch_sharding = NamedSharding(mesh, P(None, "data", None))
    eval_sharding = NamedSharding(mesh, P("data", None))
    base_key = jax.random.key(args.seed)

    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(args.seed))
        step = TrainStep(model, tx)
        n_params = sum(x.size for x in jax.tree.leaves(step.params))

        @jax.jit
        def eval_loss(params, rest, tokens, labels):
            m = nnx.merge(step.graphdef, params, rest)
            m.eval()
            return m.loss(tokens, labels)

        def evaluate() -> float:
            losses = [eval_loss(step.params, step.rest,
                                jax.device_put(b["tokens"], eval_sharding),
                                jax.device_put(b["labels"], eval_sharding))
                      for b in held_out]
            return float(np.mean([float(x) for x in losses]))

        tokens_per_step = args.batch_size * args.seq_len
        print(f"model: GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
              f"seq {args.seq_len}, vocab 256 (bytes): {n_params / 1e6:.2f}M parameters, "
              f"{args.precision} compute")
        print(f"mesh: data={args.data_size} x tensor={args.tensor_size} on {n_dev} of "
              f"{jax.device_count()} {jax.devices()[0].platform} devices; "
              f"recompute_allgather={args.recompute_allgather}")
        print(f"data: {size(len(stream))} from {n_files} files ({pattern}); "
              f"train {size(len(train))}, held-out {size(len(val))}")
        print(f"batch: {args.batch_size} x {args.seq_len} = {tokens_per_step} tokens/step in "
              f"{args.micro_batches} micro-batch(es); {args.steps} steps, AdamW lr "
              f"{args.lr:g}, warmup {args.warmup_steps}")

        # Checkpoints: params, optimizer state (its step count included) and the step
        # number; the data position is a function of the step.
        manager, start = None, 0
        if args.ckpt_dir:
            manager = ocp.CheckpointManager(
                os.path.abspath(args.ckpt_dir),
                options=ocp.CheckpointManagerOptions(
                    save_interval_steps=max(args.save_every, 1), max_to_keep=3,
                    create=True))
            latest = manager.latest_step() if args.resume else None
            if args.resume and latest is None:
                print(f"resume: no checkpoint in {args.ckpt_dir}, starting from step 0")
            elif latest is not None:
                meta = manager.restore(latest, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore()))["meta"]
                check_resume(meta, run_meta(args, cfg), latest, args.ckpt_dir)
                restored = manager.restore(latest, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(
                        {"params": abstract(step.params),
                         "opt_state": abstract(step.opt_state)})))["state"]
                step.params, step.opt_state = restored["params"], restored["opt_state"]
                start = int(meta["step"])
                print(f"resume: restored step {start} from {args.ckpt_dir}")

        def save(step_idx: int, force: bool) -> None:
            if manager is None or not args.save_every:
                return
            meta = {"step": step_idx, **run_meta(args, cfg)}
            manager.save(step_idx, force=force, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": step.params,
                                             "opt_state": step.opt_state}),
                meta=ocp.args.JsonSave(meta)))

        log, records = open_log(args.log_json, start)

        def emit(record: dict) -> None:
            records.append(record)
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()

        if start >= args.steps:
            print(f"nothing to do: checkpoint step {start} >= --steps {args.steps}")

        def put(b):
            return {k: jax.device_put(v, batch_sharding) for k, v in b.items()}

        first_loss = last_loss = final_eval = None
        if start == 0 and args.eval_every and args.steps > 0:
            emit({"step": 0, "eval_loss": evaluate()})
            print(f"step 0: held-out loss {records[-1]['eval_loss']:.4f}")
        temp = None
        param_b, opt_b = device_bytes(step.params), device_bytes(step.opt_state)
        bar = tqdm(range(start + 1, args.steps + 1), initial=start, total=args.steps,
                   desc="train", unit="step", disable=args.no_progress, mininterval=0.5,
                   dynamic_ncols=True, file=sys.stderr)
        for i in bar:
            batch = put(train_batch(train, i, args))
            key = jax.random.fold_in(base_key, i)
            t0 = time.perf_counter()
            metrics = step(batch, key)
            loss = float(metrics["loss"])
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                bar.close()
                print(f"error: loss is {loss} at step {i} (grad norm "
                      f"{float(metrics['grad_norm']):.3g}); stopping. Try a lower --lr or "
                      "more --warmup-steps.", file=sys.stderr)
                if log is not None:
                    log.close()
                if manager is not None:
                    manager.wait_until_finished()
                    manager.close()
                return 1
            if i == start + 1:
                # First call compiled the step: time it as such, and measure its memory.
                compile_s = dt
                temp = compiled_temp_bytes(step, batch, key)
                tqdm.write(f"compiled the step in {compile_s:.1f} s; per device: params "
                           f"{mib(param_b)}, optimizer state {mib(opt_b)}, activations and "
                           f"temporaries (XLA temp of the compiled step) {mib(temp)}",
                           file=sys.stdout)
                sys.stdout.flush()
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss
            tps = tokens_per_step / dt
            emit({"step": i, "loss": loss, "tokens_per_s": tps,
                  "grad_norm": float(metrics["grad_norm"]), "time_s": dt})
            bar.set_postfix_str(
                f"loss={loss:.3f} tok/s={tps:,.0f} mem/dev: params={mib(param_b)} "
                f"opt={mib(opt_b)} act(temp)={mib(temp)}", refresh=False)
            if (args.eval_every and i % args.eval_every == 0) or i == args.steps:
                final_eval = evaluate()
                emit({"step": i, "eval_loss": final_eval})
                tqdm.write(f"step {i}: train loss {loss:.4f}, held-out loss {final_eval:.4f}",
                           file=sys.stdout)
            if args.save_every and (i % args.save_every == 0 or i == args.steps):
                save(i, force=i == args.steps)
        bar.close()

        if manager is not None:
            manager.wait_until_finished()
            manager.close()
        if log is not None:
            log.close()
        if args.plot:
            plot(args.plot, records,
                 f"byte-level GPT, {n_params / 1e6:.2f}M params, mesh data={args.data_size} "
                 f"x tensor={args.tensor_size}, {args.precision}")
        total_s = time.perf_counter() - t_start
        if first_loss is not None:
            print(f"done: steps {start + 1}-{args.steps}, loss {first_loss:.3f} -> "
                  f"{last_loss:.3f}, held-out loss {final_eval:.3f}, "
                  f"{total_s:.0f} s total" + (f"; plot: {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(args))
