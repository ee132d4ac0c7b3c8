"""Train a byte-level, sequence-parallel GPT with a jitted training loop.

    python examples/train_gpt.py [--steps 600] [--mesh 2,4] [--precision bf16]
        [--plot docs/loss.png] [--log-json runs/gpt.jsonl] [--ckpt-dir runs/ckpt --save-every 50]

CPU-only machines simulate the mesh's devices. The text is by default the Python standard
library's source (``sp_jax.data.ByteCorpus``); a step's data depends only on ``(--seed,
step)``, so ``--resume`` (from ``--ckpt-dir``, onto any mesh) continues exactly as the
interrupted run would have. Multi-process: ``--coordinator HOST:PORT --num-processes N
--process-id I``, or no flags under SLURM / Open MPI (``sp_jax.training.launch``); process 0
alone prints and writes the log and plot.

Faults (``sp_jax.training.faults``; docs/errors.md): a diverging loss stops the run before
anything diverged is saved (exit 3); SIGTERM / SIGINT to any process stops all after the
same step with a checkpoint (exit 75); processes started with different flags, or a peer
that is missing, dies or stalls, end every process within --peer-timeout (exit 4); a
damaged checkpoint is skipped, named and moved aside on --resume; one trainer per
--ckpt-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from tqdm import tqdm

import sp_jax
from sp_jax.checkpoint import (
    CheckpointLockedError,
    CheckpointManager,
    CheckpointSaveError,
    NonFiniteError,
    abstract_like,
)
from sp_jax.data import ByteCorpus
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import Launch, MetricsLog, TrainStep, build_mesh, device_bytes, faults
from sp_jax.xla_flags import apply_xla_flags, cpu_simulation_flags

# A first step / evaluation / save compiles: its watchdog limit is longer by this much.
COMPILE_ALLOWANCE_S = 600.0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:  # no "(default: None)"
        absent = action.default is None or action.default is False
        return (action.help or "") if absent else super()._get_help_string(action)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=_Help)
    add = p.add_argument_group("run").add_argument
    add("--steps", type=int, default=600, help="total optimizer steps")
    add("--mesh", default="2,4", help="DATA,TENSOR or DATA,CONTEXT,TENSOR mesh shape")
    add("--context-parallel", choices=("ring", "ulysses"), default="ring",
        help="attention across the CONTEXT axis of a 3-axis --mesh")
    add("--seed", type=int, default=0, help="seeds the initialisation, dropout and data order")
    add("--debug-nans", action="store_true", help="jax_debug_nans: name the op making a NaN")
    add("--loss-spike", type=float, default=3.0, metavar="FACTOR",
        help="stop as diverged when a loss exceeds FACTOR x the median of the last 20 "
             "(a checkpoint is written only after its parameters gave a good held-out "
             "loss); 0: stop on non-finite losses only")
    add("--max-update-ratio", type=float, default=1.0, metavar="R",
        help="stop as diverged when a step's update norm exceeds R x the parameters' norm "
             "(healthy: ~1e-3); 0: no limit")
    sp_jax.training.add_launch_arguments(p)
    add = p.add_argument_group("model").add_argument
    add("--preset", choices=("gpt", "llama-tiny"), default="gpt",
        help="gpt: learned positions, LayerNorm, GELU, tied head; llama-tiny: Llama-shaped "
             "(rotary, RMSNorm, SwiGLU, grouped-query attention, untied head, no biases)")
    add("--layers", type=int, default=2, help="transformer blocks")
    add("--hidden", type=int, default=128, help="model width")
    add("--heads", type=int, default=4, help="attention heads (a multiple of TENSOR)")
    add("--kv-heads", type=int, default=None,
        help="key/value heads of llama-tiny (default HEADS / 2): a divisor of HEADS, and a "
             "divisor or a multiple of TENSOR")
    add("--seq-len", type=int, default=128, help="bytes per sequence (a multiple of TENSOR)")
    add("--precision", choices=("fp32", "bf16"), default="fp32", help="compute dtype")
    add("--recompute-allgather", action="store_true", help="re-gather SP inputs in backward")
    add("--fsdp", action="store_true",
        help="shard parameters, gradients and optimizer state over DATA too (ZeRO-3)")
    add = p.add_argument_group("optimization").add_argument
    add("--batch-size", type=int, default=16, help="global batch (sequences) per step")
    add("--micro-batches", type=int, default=2, help="gradient-accumulation micro-batches")
    add("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    add("--warmup-steps", type=int, default=20, help="linear warmup, then cosine to lr/10")
    add("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    add = p.add_argument_group("data and evaluation").add_argument
    add("--data", nargs="+", default=None, metavar="GLOB",
        help="text files: paths or quoted globs (recursive **); default: the stdlib's *.py")
    add("--max-data-bytes", type=int, default=8 << 20, help="read up to this many bytes")
    add("--eval-every", type=int, default=100, help="evaluate at 0, every K steps and the end")
    add("--eval-batches", type=int, default=4, help="held-out micro-batches per eval")
    add = p.add_argument_group("output").add_argument
    add("--ckpt-dir", default=None, help="checkpoint directory (shared by all processes)")
    add("--save-every", type=int, default=0, help="checkpoint every K steps and at the end")
    add("--resume", action="store_true", help="continue from the latest in --ckpt-dir")
    add("--log-json", default=None, help="JSON lines: one record per step, plus evals")
    add("--plot", default=None, help="write the loss curve to this PNG")
    add("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    try:
        a.mesh_shape = sp_jax.training.parse_mesh(a.mesh)
        a.launch = Launch.from_args(a)
        a.local_devices = a.launch.local_device_count(a.mesh_shape, a.local_devices)
    except ValueError as e:
        p.error(str(e))
    (a.data_size, c, a.tensor_size), ring = a.mesh_shape, a.context_parallel == "ring"
    a.context_size, a.mesh_name = c, sp_jax.training.mesh_description(a.mesh_shape)
    sp, heads = a.tensor_size * c, a.tensor_size * (1 if ring else c)
    a.kv_heads = (a.kv_heads or max(1, a.heads // 2)) if a.preset == "llama-tiny" else a.heads
    for name in ("steps", "layers", "hidden", "heads", "kv_heads", "seq_len", "batch_size",
                 "micro_batches", "eval_batches"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    micro = a.batch_size // a.micro_batches
    for bad, message in [
        (a.batch_size % a.micro_batches, f"--batch-size {a.batch_size} is not divisible by "
                                         f"--micro-batches {a.micro_batches}"),
        (micro % a.data_size, f"the micro-batch ({micro} sequences) is not divisible by the "
                              f"data size {a.data_size}"),
        (a.seq_len % sp or ring and c > 1 and a.seq_len % (2 * c), f"--seq-len {a.seq_len} "
         f"must divide by {sp} (context x tensor) and, for ring attention, by {2 * c}"),
        (a.heads % heads or a.hidden % a.heads, f"--heads {a.heads} must be a multiple of "
         f"{heads} (tensor size{', x context' if heads > a.tensor_size else ''}) and divide "
         f"--hidden {a.hidden}"),
        (a.heads % a.kv_heads or a.kv_heads % a.tensor_size and a.tensor_size % a.kv_heads,
         f"--kv-heads {a.kv_heads} must divide --heads {a.heads} and divide or be a multiple "
         f"of the tensor size {a.tensor_size}"),
        (not ring and c > 1 and max(1, a.kv_heads // a.tensor_size) % c, f"ulysses needs "
         f"the key/value heads per tensor shard divisible by the context size {c}: use more "
         "--kv-heads or --context-parallel ring"),
        (not a.lr > 0 or a.weight_decay < 0, f"--lr {a.lr} must be positive and "
                                              f"--weight-decay {a.weight_decay} >= 0"),
        (a.loss_spike and not a.loss_spike > 1, f"--loss-spike {a.loss_spike} must be > 1 "
                                                 "(or 0 to stop on non-finite losses only)"),
        (not a.max_update_ratio >= 0, f"--max-update-ratio {a.max_update_ratio} must be "
                                      ">= 0"),
        (a.max_data_bytes <= 0, f"--max-data-bytes {a.max_data_bytes} must be positive"),
        (a.ckpt_dir and os.path.exists(a.ckpt_dir) and not os.path.isdir(a.ckpt_dir),
         f"--ckpt-dir {a.ckpt_dir} is a file, not a directory"),
        (a.log_json and os.path.isdir(a.log_json), f"--log-json {a.log_json} is a directory; "
                                                   "name a file"),
        (a.fsdp and a.hidden % a.data_size, f"--fsdp shards the hidden dimension over the "
         f"data size {a.data_size}: --hidden {a.hidden} must be a multiple of it"),
        ((a.save_every or a.resume) and not a.ckpt_dir, "--save-every / --resume need --ckpt-dir"),
        (min(a.warmup_steps, a.save_every, a.eval_every) < 0,
         "--warmup-steps, --save-every and --eval-every must be >= 0")]:
        if bad:
            p.error(message)
    return a


class Stop(Exception):
    """Ends the run with ``status``; process 0 prints ``error: <message>``."""

    def __init__(self, message: str, status: int = faults.EXIT_ERROR):
        super().__init__(message)
        self.status = status


def say(message: str, bar=None) -> None:
    """Prints on process 0 only (every process runs the same loop), above ``bar``."""
    if jax.process_index() == 0:
        (bar.write if bar is not None else print)(message, file=sys.stdout)
        sys.stdout.flush()


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f}MiB"


# Flags that may differ between the processes of one run; all others must be identical.
PER_PROCESS = ("process_id", "log_json", "plot", "no_progress", "local_device_ids",
               "local_devices", "launch")


def shared_settings(args: argparse.Namespace) -> dict:
    """The settings every process must agree on (checked before the first step)."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in PER_PROCESS}


def run_meta(args: argparse.Namespace, cfg: GPTConfig) -> dict:
    """What a checkpoint records besides the arrays: the model (must match on resume) and
    the run's data and optimizer settings (may change, with a warning)."""
    model = {k: v if isinstance(v, int | float | str | bool | None) else str(v)
             for k, v in vars(cfg).items()}
    return {"model": model, "run": {k: getattr(args, k) for k in (
        "seed", "data", "max_data_bytes", "batch_size", "micro_batches", "lr", "warmup_steps",
        "weight_decay")}}


def resume(args: argparse.Namespace, manager: CheckpointManager | None, step: TrainStep,
           meta: dict) -> tuple[int, list[float]]:
    """Restores the newest intact checkpoint into ``step`` (resharded onto the current
    mesh); returns its step and the training losses before it ((0, []) when there is
    none). Refuses a fresh run into a used directory, and ``--resume`` without a
    checkpoint."""
    latest = manager.latest_step() if manager is not None else None
    if latest is not None and not args.resume:
        raise Stop(f"--ckpt-dir {args.ckpt_dir} already holds checkpoints (steps "
                   f"{manager.all_steps()}); pass --resume to continue from step {latest}, "
                   "or use another directory")
    if latest is None:
        if args.resume:  # a mistyped --ckpt-dir must not start over (and truncate the log)
            raise Stop(f"--resume: no checkpoint in --ckpt-dir {args.ckpt_dir}; check the "
                       "path, or drop --resume to start a new run")
        return 0, []
    try:  # damaged steps are skipped (named); another model is refused, naming each setting
        restored = manager.restore(params_like=abstract_like(step.params),
                                   opt_state_like=abstract_like(step.opt_state),
                                   fallback=True, expect_metadata=meta, must_match=("model",))
    except ValueError as e:  # CheckpointCorruptError (all damaged), MetadataMismatchError
        raise Stop(str(e)) from e
    for reason in restored.skipped:
        say(f"warning: {reason}; skipped")
    for damaged in [s for s in manager.all_steps() if s > restored.step]:
        say(f"warning: moved damaged checkpoint step {damaged} aside to "
            f"{manager.quarantine(damaged)}")
    if restored.changed:
        say(f"warning: resuming with changed settings (saved, now): {restored.changed['run']}")
    step.params, step.opt_state = restored.params, restored.opt_state
    say(f"resume: restored step {restored.step} from {args.ckpt_dir} onto mesh "
        f"{args.mesh_name}")
    return restored.step, list(restored.metadata.get("recent_losses", []))


class Trainer:
    """The loop's state: the step function, data, log, checkpoints and fault handling."""

    def __init__(self, args, step: TrainStep, corpus: ByteCorpus, sharding, held_out,
                 log: MetricsLog, bar: tqdm, manager: CheckpointManager | None, meta: dict,
                 signals: faults.StopSignals, watchdog: faults.Watchdog):
        self.args, self.step, self.corpus, self.sharding = args, step, corpus, sharding
        self.held_out, self.log, self.bar, self.manager = held_out, log, bar, manager
        self.meta, self.signals, self.watchdog = meta, signals, watchdog
        self.guard = faults.DivergenceGuard(args.loss_spike or None,
                                            max_update_ratio=args.max_update_ratio or None)
        self.saved: int | None = None
        self.compiled: set[str] = set()

    def watch(self, what: str, kind: str):
        """Watches a blocking call; the first one of each kind compiles (longer limit)."""
        first = kind not in self.compiled
        self.compiled.add(kind)
        return self.watchdog.watch(what, extra_s=COMPILE_ALLOWANCE_S if first else 0.0)

    def diverged(self, i: int, reason: str) -> Stop:
        kept = (f"the last checkpoint, step {self.saved}, holds parameters that gave a good "
                f"held-out loss: resume from it with a lower --lr (or more --warmup-steps)"
                if self.saved is not None else "try a lower --lr or more --warmup-steps")
        return Stop(f"step {i}: training diverged ({reason}); stopped without saving: "
                    f"{kept}", faults.EXIT_DIVERGED)

    def evaluate(self, i: int) -> float:
        """Held-out loss of the current parameters, logged and checked for divergence."""
        with self.watch(f"evaluation at step {i}", "eval"):
            loss = self.step.evaluate(self.held_out)
        self.log.write({"step": i, "eval_loss": loss})
        reason = self.guard.check(loss, "held-out loss")
        if reason:
            raise self.diverged(i, reason)
        return loss

    def save(self, i: int) -> None:
        """Checkpoint ``i``; the caller evaluated its parameters first (known-good rule)."""
        try:
            with self.watch(f"saving step {i}", "save"):
                self.manager.save(i, self.step.params, self.step.opt_state,
                                  metadata={"step": i, "next_batch": i + 1, **self.meta,
                                            "recent_losses": list(self.guard.recent)})
        except (CheckpointSaveError, NonFiniteError) as e:
            raise Stop(str(e)) from e
        self.saved = i

    def run(self, start: int, recent_losses: list[float]) -> tuple:
        """Steps ``start + 1 .. --steps`` after the checkpoint of ``start`` (0: none) and
        the training losses before it; returns (first loss, last loss, last held-out)."""
        args, step, bar = self.args, self.step, self.bar
        key0, tokens = jax.random.key(args.seed), args.batch_size * args.seq_len
        param_b, opt_b, temp = device_bytes(step.params), device_bytes(step.opt_state), None
        first = last = final_eval = None
        self.saved = start or None
        for loss in recent_losses:  # the same on every process: from the checkpoint
            self.guard.record(loss)
        if start == 0 and args.eval_every:
            say(f"step 0: held-out loss {self.evaluate(0):.4f}")
        for i in bar:
            batch = self.corpus.train_batch(i, seed=args.seed, batch_size=args.batch_size,
                                            micro_batches=args.micro_batches,
                                            sharding=self.sharding)
            key, t0 = jax.random.fold_in(key0, i), time.perf_counter()
            try:
                with self.watch(f"step {i}", "step"):  # the step's scalars, in one transfer
                    metrics = {k: float(v) for k, v in jax.device_get(step(batch, key)).items()}
                    loss = metrics["loss"]
            except FloatingPointError as e:  # --debug-nans
                raise Stop(f"NaN at step {i} (--debug-nans): {e}", faults.EXIT_DIVERGED) from e
            dt = time.perf_counter() - t0
            if not math.isfinite(loss) or not metrics["finite"]:
                raise self.diverged(i, f"loss is {loss}, grad norm {metrics['grad_norm']:.3g}; "
                                       "this step's update was not applied")
            reason = self.guard.check(loss) or self.guard.check_update(
                metrics["update_norm"], metrics["param_norm"])
            if reason:
                raise self.diverged(i, reason)
            self.guard.record(loss)
            if i == start + 1:  # the first call compiled the step: time it as such
                temp = step.temp_bytes(batch, key)
                say(f"compiled the step in {dt:.1f} s; per device: params {mib(param_b)}, "
                    f"optimizer state {mib(opt_b)}, activations and temporaries (XLA temp "
                    f"of the compiled step) {mib(temp)}", bar)
            first, last = first if first is not None else loss, loss
            self.log.write({"step": i, "loss": loss, "tokens_per_s": tokens / dt,
                            "grad_norm": metrics["grad_norm"],
                            "update_ratio": metrics["update_norm"] / metrics["param_norm"],
                            "time_s": dt})
            bar.set_postfix_str(f"loss={loss:.3f} tok/s={tokens / dt:,.0f} mem/dev: params="
                                f"{mib(param_b)} opt={mib(opt_b)} act(temp)={mib(temp)}",
                                refresh=False)
            stop = faults.agree_to_stop(i, self.signals.received is not None)
            save = self.manager is not None and (stop or args.save_every and (
                i % args.save_every == 0 or i == args.steps))
            if save or (args.eval_every and i % args.eval_every == 0) or i == args.steps:
                final_eval = self.evaluate(i)  # before a save: only good parameters are kept
                say(f"step {i}: train loss {loss:.4f}, held-out loss {final_eval:.4f}", bar)
            if save:
                self.save(i)
            if stop and i < args.steps:
                where = (f"checkpoint step {i} written to {args.ckpt_dir}; continue with "
                         "--resume" if self.manager is not None else
                         "no --ckpt-dir, nothing saved")
                raise Stop(f"stopped by {self.signals.received or 'another process'} after "
                           f"step {i}: {where}", faults.EXIT_INTERRUPTED)
        return first, last, final_eval


def configure(args: argparse.Namespace) -> tuple:
    """The parallel and model configurations and the optimizer the flags ask for."""
    bf16 = args.precision == "bf16"
    parallel = sp_jax.ParallelConfig(
        recompute_allgather=args.recompute_allgather, wgrad_dtype=jnp.float32 if bf16 else None,
        context_parallel=args.context_parallel if args.context_size > 1 else None,
        fsdp=args.fsdp)
    shape = dict(vocab_size=256, max_seq_len=args.seq_len, num_layers=args.layers,
                 num_heads=args.heads, hidden=args.hidden, dropout=0.0,
                 dtype=jnp.bfloat16 if bf16 else jnp.float32, param_dtype=jnp.float32)
    if args.preset == "llama-tiny":  # Llama's MLP width: 8/3 hidden, rounded up to 64
        cfg = GPTConfig.llama("llama-tiny", **shape, num_kv_heads=args.kv_heads,
                              mlp_hidden=64 * math.ceil(8 * args.hidden / 3 / 64))
    else:
        cfg = GPTConfig(**shape, tie_embeddings=True)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        sp_jax.training.warmup_cosine_schedule(args.lr, args.warmup_steps, args.steps),
        weight_decay=args.weight_decay))
    return parallel, cfg, tx


def describe(args: argparse.Namespace, mesh, corpus: ByteCorpus, n_params: int) -> None:
    kind = "Llama-shaped GPT" if args.preset == "llama-tiny" else "GPT"
    kv = f" ({args.kv_heads} key/value)" if args.kv_heads != args.heads else ""
    say(f"model: {kind} {args.layers} layers, hidden {args.hidden}, {args.heads} heads{kv}, seq "
        f"{args.seq_len}, vocab 256 (bytes): {n_params / 1e6:.2f}M parameters, "
        f"{args.precision} compute")
    procs = (f" in {jax.process_count()} processes ({jax.local_device_count()} each)"
             if jax.process_count() > 1 else "")
    cp = f"; {args.context_parallel} attention" if args.context_size > 1 else ""
    say(f"mesh: {args.mesh_name} on {mesh.size} of {jax.device_count()} "
        f"{jax.devices()[0].platform} devices{procs}; recompute_allgather="
        f"{args.recompute_allgather}{cp}{'; fsdp' if args.fsdp else ''}")
    say(f"data: {corpus.summary()}")
    say(f"batch: {args.batch_size} x {args.seq_len} = {args.batch_size * args.seq_len} "
        f"tokens/step in {args.micro_batches} micro-batch(es); {args.steps} steps, AdamW lr "
        f"{args.lr:g}, warmup {args.warmup_steps}")


def main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    args.launch.initialize()
    is_main = jax.process_index() == 0
    try:  # before anything that waits on the other processes
        faults.check_same_settings(shared_settings(args), timeout_s=args.peer_timeout)
    except (faults.SettingsMismatchError, faults.PeerTimeoutError) as e:
        print(f"error: process {jax.process_index()}: {e}", file=sys.stderr)
        return faults.EXIT_PEER_FAILED
    jax.config.update("jax_debug_nans", args.debug_nans)
    parallel, cfg, tx = configure(args)
    layout, meta = sp_jax.Layout.of(parallel), run_meta(args, cfg)
    watchdog = faults.Watchdog(args.peer_timeout if jax.process_count() > 1 else None,
                               name=f"process {jax.process_index()}")
    try:
        with contextlib.ExitStack() as stack:
            signals = stack.enter_context(faults.StopSignals())
            try:
                mesh = build_mesh(args.mesh_shape, sp_jax.training.MESH_AXES)
                corpus = ByteCorpus.from_files(args.data, seq_len=args.seq_len,
                                               max_bytes=args.max_data_bytes)
                manager = (stack.enter_context(CheckpointManager(args.ckpt_dir, max_to_keep=3))
                           if args.ckpt_dir else None)  # one writer: a lock, process 0
            except (ValueError, OSError, CheckpointLockedError) as e:
                raise Stop(str(e)) from e
            stack.enter_context(jax.set_mesh(mesh))
            held_out = corpus.held_out_batches(
                args.eval_batches, batch_size=args.batch_size // args.micro_batches,
                sharding=NamedSharding(mesh, layout.tokens))
            step = TrainStep(GPT(cfg, parallel=parallel, rngs=nnx.Rngs(args.seed)), tx)
            n_params = sum(x.size for x in jax.tree.leaves(step.params))
            describe(args, mesh, corpus, n_params)
            with faults.exit_on_peer_failure(), watchdog.watch(  # a dead peer: one line, exit
                    "restoring the checkpoint", extra_s=COMPILE_ALLOWANCE_S):
                start, recent_losses = resume(args, manager, step, meta)
            if start >= args.steps:
                say(f"nothing to do: checkpoint step {start} >= --steps {args.steps}")
            log = stack.enter_context(MetricsLog(args.log_json if is_main else None,
                                                 resume_from=start))
            bar = stack.enter_context(tqdm(
                range(start + 1, args.steps + 1), initial=start, total=args.steps,
                desc="train", unit="step", disable=args.no_progress or not is_main,
                mininterval=0.5, dynamic_ncols=True, file=sys.stderr))
            trainer = Trainer(args, step, corpus,
                              NamedSharding(mesh, layout.spec(None, "batch", "length")),
                              held_out, log, bar, manager, meta, signals, watchdog)
            with faults.exit_on_peer_failure():
                first, last, final_eval = trainer.run(start, recent_losses)
    except Stop as e:
        if is_main:
            print(f"error: {e}", file=sys.stderr)
        return e.status
    if args.plot and is_main:
        sp_jax.training.plot_losses(
            args.plot, log.records, f"byte-level GPT, {n_params / 1e6:.2f}M params, mesh "
            f"{args.mesh_name}, {args.precision}",
            ylabel="cross-entropy (nats / byte)")
    if first is not None:
        say(f"done: steps {start + 1}-{args.steps}, loss {first:.3f} -> {last:.3f}, held-out "
            f"loss {final_eval:.3f}, {time.perf_counter() - t_start:.0f} s total"
            + (f"; plot: {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    args = parse()
    # Simulated CPU devices must be set before JAX starts (no effect on GPUs).
    apply_xla_flags(cpu_simulation_flags(args.local_devices))
    sys.exit(main(args))
