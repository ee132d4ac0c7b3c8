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
backward pass, gradients in flight, workspace). Checkpoints (``sp_jax.checkpoint``, orbax)
hold the parameters, the optimizer state, the step (which is also the data position) and
the model/data settings; ``--resume`` restores the latest into the current mesh's
shardings, which may differ from the mesh it was saved from. A non-finite loss stops the
run (exit status 1) naming the step; ``--debug-nans`` turns on JAX's NaN checks.

Multi-process (one process per host or per GPU; CPU processes simulate devices):

    python examples/train_gpt.py --coordinator HOST:PORT --num-processes N --process-id I

or, under SLURM (``srun``) / Open MPI (``mpirun``), no flags at all: with more than one
task JAX's cluster auto-detection (``jax.distributed.initialize()`` without arguments)
supplies all three (``--distributed on`` forces it, ``off`` disables it; there JAX gives
each process the one GPU of its local rank, ``--local-device-ids`` overrides). The mesh spans
``jax.devices()`` of all processes (processes' devices in order, so the tensor axis stays
within a process when TENSOR divides its device count); each process builds only the
batch rows its devices hold (``jax.make_array_from_callback``); process 0 alone prints,
writes ``--log-json`` and ``--plot``; every process takes part in checkpoint saves and
restores (``--ckpt-dir`` must be shared by all).
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
    g.add_argument("--local-devices", "--cpu-devices", dest="local_devices", type=int,
                   default=None,
                   help="simulated CPU devices per process (default: DATA*TENSOR divided by "
                        "the number of processes); no effect on GPUs")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the initialisation, the dropout keys and the data order")
    g.add_argument("--debug-nans", action="store_true",
                   help="jax_debug_nans: JAX checks the outputs of jitted computations for "
                        "NaN and re-runs a failing one de-optimized to name the operation "
                        "(best effort: calls through JAX's compiled fast path go unchecked; "
                        "the stop on a non-finite loss applies either way)")
    g = p.add_argument_group("multi-process (jax.distributed)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordinator service")
    g.add_argument("--num-processes", type=int, default=None, help="number of processes")
    g.add_argument("--process-id", type=int, default=None,
                   help="this process's index, 0 .. N-1")
    g.add_argument("--local-device-ids", default=None, metavar="IDS",
                   help="comma-separated GPU ids this process uses (jax.distributed's "
                        "local_device_ids). Under SLURM / Open MPI JAX's default is one GPU "
                        "per process, the one of its local rank; with one process per node "
                        "pass all of them, e.g. 0,1,2,3,4,5,6,7")
    g.add_argument("--distributed", choices=("auto", "on", "off"), default="auto",
                   help="auto: initialise jax.distributed when the three flags above are "
                        "given or a SLURM/Open MPI launcher started several tasks; on: "
                        "always (JAX's cluster auto-detection fills in what the flags do not "
                        "give); off: single process")
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
    g.add_argument("--ckpt-dir", default=None,
                   help="orbax checkpoint directory (sp_jax.checkpoint; in multi-process "
                        "runs on a file system all processes share)")
    g.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every K steps (and after the last); 0: never")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --ckpt-dir (parameters, "
                        "optimizer state, step and data position), resharded onto the "
                        "current --mesh")
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
    _parse_distributed(p, args)
    if args.warmup_steps < 0 or args.save_every < 0 or args.eval_every < 0:
        p.error("--warmup-steps, --save-every and --eval-every must be >= 0")
    return args


def _cluster_tasks() -> int | None:
    """How many tasks a SLURM (``srun``) or Open MPI (``mpirun``) launcher started, from
    the variables JAX's own cluster detection reads; None outside such a launch."""
    env = os.environ
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                              "SLURM_PROCID", "SLURM_LOCALID")):
        return int(env["SLURM_NTASKS"])
    if "OMPI_MCA_orte_hnp_uri" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return int(env["OMPI_COMM_WORLD_SIZE"])
    return None


def _parse_distributed(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets ``args.multiprocess`` (call jax.distributed.initialize) and
    ``args.processes`` (the expected number of processes, for the CPU device count)."""
    explicit = [v is not None for v in (args.coordinator, args.num_processes,
                                        args.process_id)]
    tasks = _cluster_tasks()
    if args.distributed == "off" and any(explicit):
        p.error("--distributed off contradicts --coordinator / --num-processes / "
                "--process-id")
    if any(explicit) and not all(explicit) and tasks is None:
        p.error("--coordinator HOST:PORT, --num-processes N and --process-id I go together "
                "(only a SLURM / Open MPI launch can supply the missing ones)")
    if args.local_device_ids is not None:
        try:
            args.local_device_ids = [int(v) for v in args.local_device_ids.split(",")]
        except ValueError:
            p.error(f"--local-device-ids {args.local_device_ids!r}: expected integers "
                    "separated by commas, e.g. 0,1,2,3")
    if args.num_processes is not None and args.num_processes <= 0:
        p.error("--num-processes must be positive")
    if args.process_id is not None and not (
            0 <= args.process_id < (args.num_processes or tasks or args.process_id + 1)):
        p.error(f"--process-id {args.process_id} must be in 0 .. --num-processes - 1")
    args.multiprocess = args.distributed == "on" or (
        args.distributed == "auto" and (any(explicit) or (tasks or 1) > 1))
    args.processes = (args.num_processes or tasks or 1) if args.multiprocess else 1
    n_dev = args.data_size * args.tensor_size
    if args.local_devices is None and n_dev % args.processes:
        p.error(f"--mesh {args.mesh} ({n_dev} devices) does not divide over "
                f"{args.processes} processes; set --local-devices")
    if args.local_devices is not None and args.local_devices <= 0:
        p.error("--local-devices must be positive")


def _configure_devices(args: argparse.Namespace) -> None:
    """Simulated CPU devices must be configured before JAX initialises its backend.

    The device-count flag only affects the host platform, so the same run uses the real
    devices on GPUs. ``cse_barrier_expander`` off keeps recompute's backward re-all-gather
    on XLA:CPU (XLA:GPU keeps it by itself). Flags already in XLA_FLAGS win.
    """
    from sp_jax.xla_flags import apply_xla_flags, cpu_simulation_flags

    count = args.local_devices or args.data_size * args.tensor_size // args.processes
    apply_xla_flags(cpu_simulation_flags(count))


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


def rows_held(sharding: jax.sharding.Sharding, shape: tuple[int, ...], axis: int
              ) -> np.ndarray:
    """Sorted indices along ``axis`` of a global array of ``shape`` that this process's
    devices hold under ``sharding`` (all of them in a single-process run)."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[axis].indices(shape[axis])))
    return np.asarray(sorted(rows), dtype=np.int64)


def assemble(sharding: jax.sharding.Sharding, shape: tuple[int, ...], axis: int,
             local: np.ndarray, rows: np.ndarray) -> jax.Array:
    """The global ``jax.Array`` of ``shape`` from this process's part: ``local`` holds the
    rows ``rows`` along ``axis`` (see :func:`rows_held`); every process calls this with its
    own part, and each device's shard is cut from its own process's rows."""
    position = {int(r): k for k, r in enumerate(rows)}

    def shard(index):
        wanted = [position[r] for r in range(*index[axis].indices(shape[axis]))]
        index = list(index)
        index[axis] = wanted
        return local[tuple(index)]

    return jax.make_array_from_callback(shape, sharding, shard)


def train_batch(train: np.ndarray, step: int, args, sharding) -> dict[str, jax.Array]:
    """Random windows for optimizer step ``step``: a pure function of (seed, step).

    Global shape ``[micro_batches, batch_size / micro_batches, seq_len]`` (tokens and
    labels), sharded by ``sharding`` (``P(None, "data", None)``). Every process draws the
    same ``batch_size`` window offsets, then reads and uploads only the windows of the
    rows its devices hold.
    """
    rng = np.random.default_rng([args.seed, step])
    starts = rng.integers(0, len(train) - args.seq_len - 1, size=args.batch_size)
    micro = args.batch_size // args.micro_batches
    shape = (args.micro_batches, micro, args.seq_len)
    rows = rows_held(sharding, shape, axis=1)
    w = windows(train, starts.reshape(args.micro_batches, micro)[:, rows].reshape(-1),
                args.seq_len).reshape(args.micro_batches, len(rows), args.seq_len + 1)
    return {"tokens": assemble(sharding, shape, 1, w[..., :-1], rows),
            "labels": assemble(sharding, shape, 1, w[..., 1:], rows)}


def eval_batches(val: np.ndarray, args, sharding) -> list[dict[str, jax.Array]]:
    """A fixed held-out set: evenly spaced windows over the validation bytes, as
    ``eval_batches`` global batches ``[batch_size / micro_batches, seq_len]`` sharded by
    ``sharding`` (``P("data", None)``), each process reading only its rows."""
    size = args.batch_size // args.micro_batches
    starts = np.linspace(0, len(val) - args.seq_len - 1, size * args.eval_batches).astype(int)
    shape = (size, args.seq_len)
    rows = rows_held(sharding, shape, axis=0)
    out = []
    for b in starts.reshape(args.eval_batches, size):
        w = windows(val, b[rows], args.seq_len)
        out.append({"tokens": assemble(sharding, shape, 0, w[:, :-1], rows),
                    "labels": assemble(sharding, shape, 0, w[:, 1:], rows)})
    return out


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
        say(f"warning: resuming with changed settings (saved, now): {diff}")


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


def init_distributed(args: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` for multi-process runs, before any JAX computation.

    Cross-process collectives on the CPU platform go through gloo (set first); on GPUs
    NCCL is used and that setting has no effect. Arguments not given on the command line
    are left to JAX's cluster auto-detection (SLURM, Open MPI, Cloud TPU, ...).
    """
    if not args.multiprocess:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id,
                               local_device_ids=args.local_device_ids)


def say(*values, **kwargs) -> None:
    """``print`` on process 0 only (every process runs the same loop)."""
    if jax.process_index() == 0:
        print(*values, **kwargs)


def build_mesh(args: argparse.Namespace) -> jax.sharding.Mesh:
    """The (data, tensor) mesh: the first DATA*TENSOR devices of a single process, or all
    devices of all processes (each process must hold some of the mesh)."""
    n_dev = args.data_size * args.tensor_size
    devices = jax.devices()
    if jax.process_count() > 1 and len(devices) != n_dev:
        sys.exit(f"error: --mesh {args.mesh} needs {n_dev} devices; the "
                 f"{jax.process_count()} processes have {len(devices)} "
                 f"({jax.local_device_count()} each, {devices[0].platform}). Use a mesh of "
                 "all of them (or --local-devices on CPU).")
    if len(devices) < n_dev:
        sys.exit(f"error: --mesh {args.mesh} needs {n_dev} devices, found "
                 f"{len(devices)} ({devices[0].platform})")
    return jax.make_mesh((args.data_size, args.tensor_size), ("data", "tensor"),
                         devices=devices[:n_dev])


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from sp_jax.checkpoint import CheckpointManager, CheckpointSaveError, abstract_like

    t_start = time.perf_counter()
    init_distributed(args)
    if args.debug_nans:
        jax.config.update("jax_debug_nans", True)
    is_main = jax.process_index() == 0
    mesh = build_mesh(args)
    n_dev = mesh.size
    bf16 = args.precision == "bf16"
    parallel = sp_jax.ParallelConfig(recompute_allgather=args.recompute_allgather,
                                     wgrad_dtype=jnp.float32 if bf16 else None)
    cfg = GPTConfig(vocab_size=256, max_seq_len=args.seq_len, num_layers=args.layers,
                    num_heads=args.heads, hidden=args.hidden, dropout=0.0,
                    tie_embeddings=True, dtype=jnp.bfloat16 if bf16 else jnp.float32,
                    param_dtype=jnp.float32)

    stream, n_files, pattern = load_bytes(args.data, args.max_data_bytes)
    train, val = split(stream, args.seq_len)

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(lr_schedule(args.lr, args.warmup_steps, args.steps),
                    weight_decay=args.weight_decay))
    batch_sharding = NamedSharding(mesh, P(None, "data", None))
    eval_sharding = NamedSharding(mesh, P("data", None))
    base_key = jax.random.key(args.seed)

    with jax.set_mesh(mesh):
        held_out = eval_batches(val, args, eval_sharding)
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(args.seed))
        step = TrainStep(model, tx)
        n_params = sum(x.size for x in jax.tree.leaves(step.params))

        @jax.jit
        def eval_loss(params, rest, tokens, labels):
            m = nnx.merge(step.graphdef, params, rest)
            m.eval()
            return m.loss(tokens, labels)

        def evaluate() -> float:
            losses = [eval_loss(step.params, step.rest, b["tokens"], b["labels"])
                      for b in held_out]
            return float(np.mean([float(x) for x in losses]))

        tokens_per_step = args.batch_size * args.seq_len
        platform = jax.devices()[0].platform
        say(f"model: GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
            f"seq {args.seq_len}, vocab 256 (bytes): {n_params / 1e6:.2f}M parameters, "
            f"{args.precision} compute")
        say(f"mesh: data={args.data_size} x tensor={args.tensor_size} on {n_dev} of "
            f"{jax.device_count()} {platform} devices"
            + (f" in {jax.process_count()} processes ({jax.local_device_count()} each)"
               if jax.process_count() > 1 else "")
            + f"; recompute_allgather={args.recompute_allgather}")
        say(f"data: {size(len(stream))} from {n_files} files ({pattern}); "
            f"train {size(len(train))}, held-out {size(len(val))}")
        say(f"batch: {args.batch_size} x {args.seq_len} = {tokens_per_step} tokens/step in "
            f"{args.micro_batches} micro-batch(es); {args.steps} steps, AdamW lr "
            f"{args.lr:g}, warmup {args.warmup_steps}")

        # Checkpoints: parameters, optimizer state (its step count included), the step
        # number (= the data position: step k trains on the batch drawn for (seed, k)).
        manager, start = None, 0
        if args.ckpt_dir:
            manager = CheckpointManager(args.ckpt_dir, max_to_keep=3)
            latest = manager.latest_step()
            if latest is not None and not args.resume:
                steps = manager.all_steps()
                manager.close()
                sys.exit(f"error: --ckpt-dir {args.ckpt_dir} already holds checkpoints "
                         f"(steps {steps}); pass --resume to continue from step {latest}, "
                         "or use another directory")
            if args.resume and latest is None:
                say(f"resume: no checkpoint in {args.ckpt_dir}, starting from step 0")
            elif latest is not None:
                check_resume(manager.metadata(latest), run_meta(args, cfg), latest,
                             args.ckpt_dir)
                try:
                    restored = manager.restore(latest,
                                               params_like=abstract_like(step.params),
                                               opt_state_like=abstract_like(step.opt_state))
                except ValueError as e:
                    sys.exit(f"error: {e}")
                step.params, step.opt_state = restored.params, restored.opt_state
                start = restored.step
                say(f"resume: restored step {start} from {args.ckpt_dir} onto mesh "
                    f"data={args.data_size} x tensor={args.tensor_size}")

        log, records = open_log(args.log_json if is_main else None, start)

        def emit(record: dict) -> None:
            records.append(record)
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()

        def finish() -> None:
            if log is not None:
                log.close()
            if manager is not None:
                manager.close()

        if start >= args.steps:
            say(f"nothing to do: checkpoint step {start} >= --steps {args.steps}")

        first_loss = last_loss = final_eval = None
        if start == 0 and args.eval_every and args.steps > 0:
            emit({"step": 0, "eval_loss": evaluate()})
            say(f"step 0: held-out loss {records[-1]['eval_loss']:.4f}")
        temp = None
        param_b, opt_b = device_bytes(step.params), device_bytes(step.opt_state)
        bar = tqdm(range(start + 1, args.steps + 1), initial=start, total=args.steps,
                   desc="train", unit="step", disable=args.no_progress or not is_main,
                   mininterval=0.5, dynamic_ncols=True, file=sys.stderr)
        for i in bar:
            batch = train_batch(train, i, args, batch_sharding)
            key = jax.random.fold_in(base_key, i)
            t0 = time.perf_counter()
            try:
                metrics = step(batch, key)
                loss = float(metrics["loss"])
            except FloatingPointError as e:  # --debug-nans
                bar.close()
                if is_main:
                    print(f"error: NaN at step {i} (--debug-nans): {e}", file=sys.stderr)
                finish()
                return 1
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                bar.close()
                if is_main:
                    print(f"error: loss is {loss} at step {i} (grad norm "
                          f"{float(metrics['grad_norm']):.3g}); stopping. Try a lower --lr "
                          "or more --warmup-steps.", file=sys.stderr)
                finish()
                return 1
            if i == start + 1:
                # First call compiled the step: time it as such, and measure its memory.
                compile_s = dt
                temp = compiled_temp_bytes(step, batch, key)
                if is_main:
                    tqdm.write(f"compiled the step in {compile_s:.1f} s; per device: params "
                               f"{mib(param_b)}, optimizer state {mib(opt_b)}, activations "
                               f"and temporaries (XLA temp of the compiled step) {mib(temp)}",
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
                if is_main:
                    tqdm.write(f"step {i}: train loss {loss:.4f}, held-out loss "
                               f"{final_eval:.4f}", file=sys.stdout)
            if manager is not None and args.save_every and (
                    i % args.save_every == 0 or i == args.steps):
                try:
                    manager.save(i, step.params, step.opt_state,
                                 metadata={"step": i, "next_batch": i + 1,
                                           **run_meta(args, cfg)})
                except CheckpointSaveError as e:
                    bar.close()
                    if is_main:
                        print(f"error: {e}", file=sys.stderr)
                    finish()
                    return 1
        bar.close()

        finish()
        if args.plot and is_main:
            plot(args.plot, records,
                 f"byte-level GPT, {n_params / 1e6:.2f}M params, mesh data={args.data_size} "
                 f"x tensor={args.tensor_size}, {args.precision}")
        total_s = time.perf_counter() - t_start
        if first_loss is not None:
            say(f"done: steps {start + 1}-{args.steps}, loss {first_loss:.3f} -> "
                f"{last_loss:.3f}, held-out loss {final_eval:.3f}, "
                f"{total_s:.0f} s total" + (f"; plot: {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(args))
