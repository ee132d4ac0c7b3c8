"""Train a byte-level, sequence-parallel GPT (or a Llama-shaped model) on text files with
sp_jax's training loop, on a simulated or real device mesh.

    python examples/train_gpt.py [--steps 600] [--mesh 2,4] [--precision bf16]
        [--plot docs/loss.png] [--log-json runs/gpt.jsonl] [--ckpt-dir runs/ckpt --save-every 50]
        [--data 'corpus/*.jsonl' --tokenizer tokenizer.json [--text-field text]]
        [--held-out-fraction 0.05]
        [--tensorboard runs/tb]

CPU-only machines simulate the mesh's devices. The text is by default the Python standard
library's source read as bytes (``sp_jax.data.ByteCorpus``: a step's data depends only on
``(--seed, step)``). With ``--tokenizer`` (a Hugging Face tokenizer.json, or ``bytes``) the
``--data`` files (text, JSON lines, parquet) are tokenized documents packed into rows with
segment ids (``sp_jax.data.PackedText``: attention stays inside each document), and the
input pipeline's position is saved with every checkpoint. Either way ``--resume`` (from
``--ckpt-dir``, onto any mesh or process count) continues exactly as the interrupted run
would have. Multi-process: ``--coordinator HOST:PORT --num-processes N
--process-id I``, or no flags under SLURM / Open MPI (``sp_jax.training.launch``); process 0
alone prints and writes the log and plot.

The loop is ``sp_jax.training.Trainer`` (faults: docs/errors.md): a diverging loss stops
the run before anything diverged is saved (exit 3); SIGTERM / SIGINT to any process stops
all after the same step with a checkpoint (exit 75); processes started with different
flags, or a peer that is missing, dies or stalls, end every process within --peer-timeout
(exit 4); a damaged checkpoint is skipped, named and moved aside on --resume; one trainer
per --ckpt-dir.
"""

from __future__ import annotations

import sp_jax  # noqa: F401 - first: on a machine without a GPU, JAX then starts quietly

# isort: split
import argparse
import contextlib
import functools
import importlib.util
import sys
import time
import traceback
import warnings
from collections.abc import Callable

import jax
from flax import nnx

import sp_jax.training as training
from sp_jax.data import TrainData
from sp_jax.models import GPT
from sp_jax.training import cli, faults, mesh_description
from sp_jax.xla_flags import simulate_cpu_devices


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (a usage error, exit 2, names the bad one) before JAX starts."""
    p = argparse.ArgumentParser(description=cli.description(__doc__),
                                formatter_class=cli.HelpFormatter)
    cli.add_trainer_arguments(p)
    cli.add_parallel_arguments(p)
    training.add_launch_arguments(p)
    cli.add_model_arguments(p)
    add = p.add_argument_group("data and plot").add_argument
    add("--data", nargs="+", default=None, metavar="GLOB",
        help="text files: paths or quoted globs (recursive **); default: the stdlib's *.py")
    add("--max-data-bytes", type=int, default=8 << 20,
        help="read up to this many bytes (without --tokenizer)")
    add("--tokenizer", default=None, metavar="JSON",
        help="a tokenizer.json (or 'bytes'): pack tokenized --data documents")
    add("--text-field", default=None,
        help="JSON lines field / parquet column of the text (default: text); with or "
             "without --tokenizer such files are read as their documents' text")
    add("--packing", default="first_fit", choices=("first_fit", "concat"),
        help="first-fit (pads, documents whole) or concatenate-then-split")
    cli.add_held_out_argument(add)
    add("--plot", default=None, help="write the loss curve to this PNG")
    a = p.parse_args(argv)
    try:
        a.mesh_shape = training.parse_mesh(a.mesh, fill=True)  # one size may be -1
        a.launch = training.Launch.from_args(a)
        a.mesh_shape = a.launch.resolve_mesh(a.mesh_shape, a.local_devices)  # the -1's size
        a.local_devices = a.launch.local_device_count(a.mesh_shape, a.local_devices)
        cli.check_pipeline_args(a)
        a.trainer = cli.check_run_args(a)
        cli.check_model_args(a)
        if a.max_data_bytes <= 0:
            raise ValueError(f"--max-data-bytes {a.max_data_bytes} must be positive")
        if a.tokenizer and not a.data:
            raise ValueError("--tokenizer needs --data: the files whose documents to pack")
        cli.check_text_args(a)
        if a.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install matplotlib (the examples "
                             "extra, pip install '.[examples]' in a clone of sp_jax)")
    except ValueError as e:
        p.error(str(e))
    return a


def describe(args: argparse.Namespace, mesh: jax.sharding.Mesh, corpus: TrainData,
             n_params: int, say: Callable[[str], None]) -> None:
    """The model, mesh, data and batch lines (process 0)."""
    kind = {"llama-tiny": "Llama-shaped GPT", "mixtral-tiny": "Mixtral-shaped GPT (8 experts, "
            "2 per token)"}.get(args.preset, "GPT")
    kv = f" ({args.kv_heads} key/value)" if args.kv_heads != args.heads else ""
    vocab = f"{corpus.vocab_size} ({args.tokenizer or 'bytes'})"
    say(f"model: {kind} {args.layers} layers, hidden {args.hidden}, {args.heads} heads{kv}, seq "
        f"{args.seq_len}, vocab {vocab}: {n_params / 1e6:.2f}M parameters, "
        f"{args.precision} compute")
    procs = (f" in {jax.process_count()} processes ({jax.local_device_count()} each)"
             if jax.process_count() > 1 else "")
    cp = f"; {args.context_parallel} attention" if args.mesh_shape[3] > 1 else ""
    if args.mesh_shape[0] > 1:
        chunks = args.pipeline_repeats
        cp += (f"; {args.pipeline_schedule} pipeline, {args.microbatches} micro-batches"
               f"{f', {chunks} chunks per stage' if chunks > 1 else ''}")
    say(f"mesh: {mesh_description(mesh)} on {mesh.size} of {jax.device_count()} "
        f"{jax.devices()[0].platform} devices{procs}; recompute_allgather="
        f"{args.recompute_allgather}{cp}{f'; fsdp={args.fsdp}' if args.fsdp else ''}")
    say(f"data: {corpus.summary()}")
    say(f"batch: {args.batch_size} x {args.seq_len} = {args.batch_size * args.seq_len} "
        f"tokens/step in {args.micro_batches} micro-batch(es); {args.steps} steps, AdamW lr "
        f"{args.lr:g}, warmup {args.warmup_steps}"
        f"{'' if args.moments_dtype == 'fp32' else f', {args.moments_dtype} moments'}")


def main(args: argparse.Namespace) -> int:
    args.launch.initialize()
    try:
        status = run(args)
    except Exception:  # noqa: BLE001 - a bug: its traceback, then no barrier to hang in
        traceback.print_exc()
        status = faults.EXIT_ERROR
    return args.launch.end(status)  # the final barrier, or at once where peers may be gone


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    is_main = jax.process_index() == 0
    say = functools.partial(print, flush=True) if is_main else (lambda _: None)
    try:  # before anything that waits on the other processes
        faults.check_same_settings(cli.shared_settings(args), timeout_s=args.peer_timeout)
    except (faults.SettingsMismatchError, faults.PeerTimeoutError) as e:
        print(f"error: process {jax.process_index()}: {e}", file=sys.stderr)
        return faults.EXIT_PEER_FAILED
    config = args.trainer
    try:
        with contextlib.ExitStack() as stack:
            signals = stack.enter_context(faults.StopSignals())  # before the model is built
            manager = stack.enter_context(training.open_checkpoints(config))  # one writer
            try:
                mesh = training.build_mesh(args.mesh_shape, training.MESH_AXES)
                corpus = cli.text_data(args)
            except (ValueError, OSError) as e:
                raise training.TrainingStopped(str(e)) from e
            cfg = cli.model_config(args, vocab_size=corpus.vocab_size)
            stack.enter_context(jax.set_mesh(mesh))
            step = training.TrainStep(GPT(cfg, parallel=cli.parallel_config(args),
                                          rngs=nnx.Rngs(args.seed)), cli.optimizer(args),
                                      **cli.offload_options(args))
            n_params = sum(x.size for x in jax.tree.leaves(step.params))
            describe(args, mesh, corpus, n_params, say)
            result = training.Trainer(
                step, corpus, config, metadata=cli.run_metadata(args, cfg),
                checkpoints=manager, signals=signals, say=say, lr_schedule=cli.lr_schedule,
                flops_per_token=cfg.flops_per_token(args.seq_len)).run()
    except training.TrainingStopped as e:  # an error of this process: said by it too
        if is_main or e.status == faults.EXIT_ERROR:
            who = "" if is_main else f"process {jax.process_index()}: "
            print(f"error: {who}{e}", file=sys.stderr)
        if e.status == faults.EXIT_ERROR:  # the others end at once, naming it
            faults.announce_failure(str(e))
        return e.status
    if args.plot and is_main:
        training.plot_losses(
            args.plot, result.records, f"{'packed' if args.tokenizer else 'byte-level'} GPT, "
            f"{n_params / 1e6:.2f}M params, mesh {mesh_description(mesh)}, {args.precision}",
            ylabel="cross-entropy (nats / token)" if args.tokenizer
            else "cross-entropy (nats / byte)")
    if result.first_loss is not None:
        say(f"done: steps {result.start_step + 1}-{args.steps}, loss {result.first_loss:.3f} "
            f"-> {result.last_loss:.3f}, held-out loss {result.eval_loss:.3f}, "
            f"{time.perf_counter() - t_start:.0f} s total"
            + (f"; plot: {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    warnings.formatwarning = cli.format_warning  # "warning: <message>", one line
    args = parse()
    simulate_cpu_devices(args.local_devices)  # no GPU here: before JAX starts its backend
    sys.exit(main(args))
