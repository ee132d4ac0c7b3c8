"""Packed documents: the input pipeline's rate against the training step, packing
efficiency, and document-masked attention.

Run ``JAX_PLATFORMS=cpu python -m benchmarks.text`` (about a minute on 2 CPU cores;
``--quick``: tiny shapes, 15 seconds; ``--json PATH`` writes the results, ``--markdown PATH``
the ``## Packed documents`` section of ``BENCHMARKS.md``). It simulates 8 CPU devices.
In one run (:class:`TextBench`) it measures:

- :func:`pipeline_vs_step`: :class:`sp_jax.data.PackedText` batches per second (Python
  standard library sources, one document per file, a byte-level BPE tokenizer trained on
  them by :func:`sp_jax.data.train_tokenizer`) for each packing and number of read
  workers, and the CPU training step of the demo model (``examples/train_gpt.py``'s
  defaults, from :mod:`sp_jax.training.cli`) on those batches, in interleaved rounds;
- :func:`packing_efficiency`: :func:`sp_jax.data.packing_efficiency` of first-fit and
  concatenate-then-split packing on the standard library corpus and on a synthetic corpus
  of log-normal document lengths;
- :func:`attention_block_products`, :func:`attention_times` and :func:`attention_memory`:
  :func:`sp_jax.attention.blockwise_attention` with ``segment_ids`` (documents of equal
  length) against plain causal attention: block products computed, CPU time of the
  forward and backward pass, and the temp memory of a deviceless H100 compile (needs the
  CUDA PJRT plugin; reported as not measured without it);

and :func:`evaluate_targets` checks the targets. :mod:`benchmarks.render.text` writes the
section. Public ``sp_jax`` names and :mod:`sp_jax.analysis` only (and the kernels' block
counter, ``sp_jax.attention.kernels.forward_blocks``).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX starts: 8 simulated CPU devices, the CUDA plugin
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # registered for deviceless compiles
    from sp_jax.xla_flags import apply_xla_flags, cpu_simulation_flags

    apply_xla_flags(cpu_simulation_flags(8))

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import sp_jax.training as training  # noqa: E402
from benchmarks.records import TextBench, copies, fmt_signed  # noqa: E402
from benchmarks.section import write_outputs  # noqa: E402
from sp_jax import Layout  # noqa: E402
from sp_jax.analysis import compile_for_gpu, cuda_plugin_available  # noqa: E402
from sp_jax.attention import blockwise_attention  # noqa: E402
from sp_jax.attention.kernels import forward_blocks, kernel_segments  # noqa: E402
from sp_jax.data import (  # noqa: E402
    ByteTokenizer,
    PackedText,
    Tokenizer,
    train_tokenizer,
)
from sp_jax.data import packing_efficiency as efficiency_of  # noqa: E402
from sp_jax.models import GPT  # noqa: E402
from sp_jax.training import cli  # noqa: E402

__all__ = ["FULL", "QUICK", "TextBench", "attention_block_products", "attention_memory",
           "attention_times", "evaluate_targets", "main", "packing_efficiency",
           "copy_sites", "pipeline_vs_step", "run_text", "stdlib_corpus",
           "temp_masks"]

MiB = 2**20
TARGETS = {"pipeline_over_step": 10.0, "first_fit_efficiency": 0.95,
           "masked_time_ratio": 0.5, "masked_temp_ratio": 1.0}  # from the issue


FULL = TextBench()
QUICK = TextBench(corpus_bytes=500_000, rounds=2, steps_per_round=10, warmup_steps=2,
                  step_repeats=1, layers=1, hidden=32, heads=4, efficiency_steps=20,
                  lognormal_docs=800, attention_s=1024, attention_block=128, cpu_heads=2,
                  cpu_head_dim=32, attention_rounds=2, gpu_heads=4, gpu_head_dim=64)


def _log(msg: str) -> None:
    print(f"[text {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _quartiles(xs: list[float]) -> list[float]:
    return [float(x) for x in np.percentile(xs, [25, 75])]


# -- corpora ----------------------------------------------------------------------------


def stdlib_corpus(path: Path, max_bytes: int) -> dict[str, Any]:
    """Writes the Python standard library's ``.py`` files (``sysconfig``'s stdlib,
    without ``site-packages``; a shuffle by seed 0 of the sorted paths), one JSON line
    ``{"text": ...}`` per file, to ``path``, skipping a file whose line would take the
    total past ``max_bytes``.
    Returns the file count, documents written and bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    random.Random(0).shuffle(files)
    written = docs = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in files:
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            line = json.dumps({"text": text}) + "\n"
            size = len(line.encode("utf-8"))
            if written + size > max_bytes:
                continue  # a smaller file may still fit
            f.write(line)
            written, docs = written + size, docs + 1
    return {"root": str(root), "files": len(files), "documents": docs, "bytes": written}


def lognormal_corpus(path: Path, bench: TextBench) -> dict[str, Any]:
    """``bench.lognormal_docs`` documents of random lowercase words, byte lengths
    log-normal (median ``lognormal_median``, sigma ``lognormal_sigma``, at least 1), as JSON
    lines: with :class:`~sp_jax.data.ByteTokenizer` a document of n bytes is n tokens."""
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, np.round(rng.lognormal(np.log(bench.lognormal_median),
                                                   bench.lognormal_sigma,
                                                   bench.lognormal_docs))).astype(int)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)
    with open(path, "w", encoding="utf-8") as f:
        for n in lengths:
            text = alphabet[rng.integers(0, len(alphabet), n)].tobytes().decode()
            f.write(json.dumps({"text": text}) + "\n")
    return {"documents": int(len(lengths))}


def _length_stats(tokens: list[int], seq_len: int) -> dict[str, Any]:
    """Token counts per document (with the end-of-document id) as the table shows them."""
    x = np.asarray(tokens)
    return {"documents": int(len(x)), "tokens": int(x.sum()),
            "percentiles": {str(p): float(np.percentile(x, p)) for p in (10, 50, 90)},
            "longer_than_row": float(np.mean(x > seq_len))}


# -- the pipeline against the training step ---------------------------------------------


def _demo_args(bench: TextBench) -> argparse.Namespace:
    """``examples/train_gpt.py``'s flags with ``bench``'s batch, mesh and model overrides,
    parsed and checked by :mod:`sp_jax.training.cli` as the example does."""
    parser = argparse.ArgumentParser()
    cli.add_trainer_arguments(parser)
    cli.add_parallel_arguments(parser)
    cli.add_model_arguments(parser)
    argv = ["--mesh", bench.mesh, "--batch-size", str(bench.batch_size), "--micro-batches",
            str(bench.micro_batches), "--seq-len", str(bench.seq_len), "--precision", "fp32"]
    for flag in ("layers", "hidden", "heads"):
        if getattr(bench, flag) is not None:
            argv += [f"--{flag}", str(getattr(bench, flag))]
    args = parser.parse_args(argv)
    args.mesh_shape = training.parse_mesh(args.mesh)
    cli.check_pipeline_args(args)
    cli.check_model_args(args)
    cli.check_run_args(args)
    return args


def pipeline_vs_step(bench: TextBench, corpus: Path, tokenizer: Tokenizer,
                     log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Tokens per second of :meth:`PackedText.train_batch` (``batch_size x seq_len``
    positions per batch, padding included, each batch on the devices before the next) for
    every packing x read-worker count, and of the demo model's training step
    (:class:`sp_jax.training.TrainStep`, compiled first, timed on one packed batch),
    interleaved: every round reads ``steps_per_round`` batches from each pipeline (in
    an order rotated per round) and runs ``step_repeats`` steps.

    Rates are all timed tokens over all timed seconds (first-fit packs
    ``num_packing_bins`` rows per stream at once, so one batch in 64 carries the packing
    work of the others: a median over batches or short rounds would leave it out);
    ``ratio`` is the pipeline's rate over the step's, ``round_ratios`` the quartiles and
    the minimum of the same ratio per round."""
    args = _demo_args(bench)
    mesh = training.build_mesh(args.mesh_shape, training.MESH_AXES)
    parallel = cli.parallel_config(args)
    sharding = NamedSharding(mesh, Layout.of(parallel).micro_batched_tokens)
    cfg = cli.model_config(args, vocab_size=tokenizer.vocab_size)
    per_batch = bench.batch_size * bench.seq_len
    kw = dict(seed=0, batch_size=bench.batch_size, micro_batches=bench.micro_batches,
              sharding=sharding)
    with jax.set_mesh(mesh):
        step = training.TrainStep(GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)),
                                  cli.optimizer(args))
        batch = PackedText.from_files(str(corpus), tokenizer=tokenizer,
                                      seq_len=bench.seq_len).train_batch(1, **kw)
        key = jax.random.key(0)
        t0 = time.perf_counter()
        first_loss = float(step(batch, key)["loss"])
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(step(batch, key)["loss"])
        n_params = sum(x.size for x in jax.tree.leaves(step.params))
    log(f"  demo step compiled in {compile_s:.1f} s ({n_params / 1e6:.2f}M parameters)")

    pipes, next_step, warm_s = {}, {}, {}
    for packing in bench.packings:
        for workers in bench.read_workers:
            name = f"{packing}/{workers}"
            t0 = time.perf_counter()
            pipes[name] = PackedText.from_files(str(corpus), tokenizer=tokenizer,
                                                seq_len=bench.seq_len, packing=packing,
                                                read_workers=workers)
            for s in range(1, bench.warmup_steps + 1):
                jax.block_until_ready(pipes[name].train_batch(s, **kw))
            next_step[name] = bench.warmup_steps + 1
            warm_s[name] = time.perf_counter() - t0
    batch_s: dict[str, list[float]] = {name: [] for name in pipes}
    round_s: dict[str, list[float]] = {name: [] for name in pipes}
    step_s: list[float] = []
    order = list(pipes)
    for r in range(bench.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            for _ in range(bench.steps_per_round):
                t0 = time.perf_counter()
                jax.block_until_ready(pipes[name].train_batch(next_step[name], **kw))
                batch_s[name].append(time.perf_counter() - t0)
                next_step[name] += 1
            round_s[name].append(sum(batch_s[name][-bench.steps_per_round:]))
        with jax.set_mesh(mesh):
            t0 = time.perf_counter()
            for _ in range(bench.step_repeats):
                metrics = step(batch, key)
            jax.block_until_ready(metrics["loss"])
        step_s.append((time.perf_counter() - t0) / bench.step_repeats)
    step_rate = per_batch * len(step_s) / sum(step_s)
    rows = []
    for name, xs in batch_s.items():
        packing, workers = name.split("/")
        rate = per_batch * len(xs) / sum(xs)
        ratios = [bench.steps_per_round * s / t for s, t in zip(step_s, round_s[name],
                                                                 strict=True)]
        rows.append({"packing": packing, "read_workers": int(workers), "tokens_per_s": rate,
                     "ratio": rate / step_rate, "round_ratios": _quartiles(ratios) + [
                         min(ratios)],
                     "batch_ms": {"median": 1e3 * statistics.median(xs),
                                  "max": 1e3 * max(xs)},
                     "warmup_s": warm_s[name]})
        log(f"  {packing}, {workers} read workers: {rate:,.0f} tokens/s ({rate / step_rate:.1f}x "
            f"the step; batches {rows[-1]['batch_ms']['median']:.1f} ms median, "
            f"{rows[-1]['batch_ms']['max']:.0f} ms max)")
    log(f"  demo step: {step_rate:,.0f} tokens/s ({statistics.median(step_s) * 1e3:.0f} ms)")
    return {"mesh": dict(mesh.shape), "spec": str(sharding.spec), "config": {
                "layers": cfg.num_layers, "hidden": cfg.hidden, "heads": cfg.num_heads,
                "vocab": cfg.vocab_size, "seq_len": bench.seq_len,
                "dtype": jnp.dtype(cfg.dtype).name, "parameters": int(n_params)},
            "tokens_per_batch": per_batch, "rows": rows,
            "step": {"tokens_per_s": step_rate, "median_s": statistics.median(step_s),
                     "quartiles_s": _quartiles(step_s), "compile_s": compile_s,
                     "first_loss": first_loss}}


def packing_efficiency(path: Path, tokenizer: Tokenizer, bench: TextBench
                       ) -> dict[str, Any]:
    """:func:`sp_jax.data.packing_efficiency` (non-padding positions over all) of the
    rows of ``efficiency_steps`` training batches (all ``batch_size`` rows, seed 0) of
    each packing, and the mean number of segments (documents or pieces) per row."""
    out = {}
    for packing in ("first_fit", "concat"):
        data = PackedText.from_files(str(path), tokenizer=tokenizer, seq_len=bench.seq_len,
                                     packing=packing)
        seg = np.concatenate([
            data.rows(s, range(bench.batch_size), seed=0,
                      batch_size=bench.batch_size)["segment_ids"]
            for s in range(1, bench.efficiency_steps + 1)])
        out[packing] = {"efficiency": efficiency_of({"segment_ids": seg}),
                        "rows": int(len(seg)),
                        "segments_per_row": float(seg.max(axis=1).mean())}
    return out


# -- document-masked attention ----------------------------------------------------------


def _segments(bench: TextBench) -> np.ndarray:
    """Document ids 1..docs of ``attention_s`` rows, documents of equal length: ``[1, s]``."""
    return np.repeat(np.arange(1, bench.attention_docs + 1),
                     bench.attention_s // bench.attention_docs)[None].astype(np.int32)


def attention_block_products(bench: TextBench) -> dict[str, Any]:
    """Block products per (batch row, head) of the forward pass, counted by the kernel
    (``forward_blocks``, one head of 8) and as the arithmetic says: causal over ``n``
    blocks ``n (n + 1) / 2``; with documents ``docs x m (m + 1) / 2``, ``m`` the blocks of
    one document (documents aligned with blocks)."""
    s, blk = bench.attention_s, bench.attention_block
    x = jnp.zeros((1, 1, 1, s, 8), jnp.float32)
    kv = x[:, :, 0]
    count = jax.jit(functools.partial(forward_blocks, causal=True, bq=blk, bk=blk))
    seg = kernel_segments(jnp.asarray(_segments(bench)))
    n, m = s // blk, s // bench.attention_docs // blk
    return {"unmasked": int(count(x, kv, kv)[2]),
            "masked": int(count(x, kv, kv, segments=(seg, seg))[2]),
            "unmasked_formula": n * (n + 1) // 2,
            "masked_formula": bench.attention_docs * m * (m + 1) // 2}


def _attention_grad(masked: bool, block: int) -> Callable[..., Any]:
    """``(q, k, v, probe, seg) -> (sum(out * probe), (dq, dk, dv))`` of blockwise
    attention with (``masked``) or without the document ids."""

    def loss(q, k, v, probe, seg):
        out = blockwise_attention(q, k, v, block_q=block, block_k=block,
                                  segment_ids=seg if masked else None)
        return jnp.sum(out.astype(jnp.float32) * probe.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def attention_times(bench: TextBench) -> dict[str, Any]:
    """CPU time of the jitted forward+backward, fp32, batch 1, both kernels compiled and
    run once first, then ``attention_rounds`` interleaved rounds (order alternating)."""
    rng = np.random.default_rng(0)
    shape = (1, bench.attention_s, bench.cpu_heads, bench.cpu_head_dim)
    q, k, v, probe = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(4))
    seg = jnp.asarray(_segments(bench))
    fns = {name: jax.jit(_attention_grad(name == "masked", bench.attention_block))
           for name in ("unmasked", "masked")}
    compile_s = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, k, v, probe, seg))
        compile_s[name] = time.perf_counter() - t0
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(bench.attention_rounds):
        for name in list(fns)[r % 2:] + list(fns)[:r % 2]:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name](q, k, v, probe, seg))
            samples[name].append(time.perf_counter() - t0)
    ratios = [m / u for m, u in zip(samples["masked"], samples["unmasked"], strict=True)]
    return {"heads": bench.cpu_heads, "head_dim": bench.cpu_head_dim,
            "rounds": bench.attention_rounds,
            "median_s": {n: statistics.median(x) for n, x in samples.items()},
            "ratio": statistics.median(ratios), "ratio_quartiles": _quartiles(ratios),
            "first_call_s": compile_s}


_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) ")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%(\S+) = .*? (\S+?)\(")
_PASS_THROUGH = {"parameter", "get-tuple-element", "copy", "tuple", "bitcast"}


def copy_sites(hlo: str, names: list[str]) -> list[dict[str, Any]]:
    """Where the ``copy`` instructions ``names`` of the optimized HLO ``hlo`` are: the
    computation holding each, whether that computation is a branch of a ``conditional``
    (which one, the conditional's JAX ``op_name``) and whether the branch only passes
    its operand through (parameter, tuple elements, copies: a ``lax.cond`` branch
    ``lambda a: a``)."""
    where: dict[str, str] = {}
    opcodes: dict[str, set[str]] = {}
    comp = ""
    for line in hlo.splitlines():
        if m := _COMPUTATION.match(line):
            comp = m.group(1)
            opcodes[comp] = set()
        elif m := _INSTRUCTION.match(line):
            where[m.group(1)] = comp
            opcodes.setdefault(comp, set()).add(m.group(2))
    out = []
    for name in names:
        comp = where.get(name.split("{")[0], "")
        site: dict[str, Any] = {"copy": name, "computation": comp, "branch": None,
                                "conditional": "", "pass_through": False}
        m = re.search(r"conditional\(.*?(true|false)_computation=%" + re.escape(comp)
                      + r"(?=[,\s}]).*?op_name=\"([^\"]*)\"", hlo) if comp else None
        if m:
            site.update(branch=m.group(1), conditional=m.group(2),
                        pass_through=opcodes.get(comp, set()) <= _PASS_THROUGH)
        out.append(site)
    return out


_TEMP_VALUE = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (pred\S*)")


def temp_masks(dump: str, hlo: str, min_bytes: int = 1 << 16) -> list[dict[str, Any]]:
    """The boolean buffers of at least ``min_bytes`` in the preallocated temp of the
    program XLA dumped to ``dump`` (its ``*after_optimizations-buffer-assignment.txt``):
    name, shape, bytes, offset and the last part of the JAX ``op_name`` of the
    instruction (``eq``: a document mask, ``ge``: a causal one), from ``hlo``."""
    files = sorted(Path(dump).glob("*after_optimizations-buffer-assignment.txt"))
    if not files:
        return []
    out, inside = [], False
    for line in files[-1].read_text().splitlines():
        if line.startswith("allocation "):
            inside = "preallocated-temp" in line
        elif inside and (m := _TEMP_VALUE.match(line)) and int(m.group(2)) >= min_bytes:
            name = m.group(1).split("{")[0]
            op = re.search(r"%" + re.escape(name) + r" = .*?op_name=\"([^\"]*)\"", hlo)
            out.append({"name": name, "shape": m.group(4), "bytes": int(m.group(2)),
                        "offset": int(m.group(3)),
                        "op": op.group(1).rsplit("/", 1)[-1] if op else ""})
    return out


def attention_memory(bench: TextBench) -> dict[str, Any]:
    """Deviceless compile for one H100 of the forward+backward (bf16, batch 1,
    ``gpu_heads x gpu_head_dim``; q, k, v, the probe and the document ids as arguments):
    ``memory_analysis()`` per device and XLA's live-range peak, with the buffers of 1 MiB
    or more live at it, where the copies among them are (:func:`copy_sites`), and the
    boolean masks in the temp allocation (:func:`temp_masks`)."""
    shape = (1, bench.attention_s, bench.gpu_heads, bench.gpu_head_dim)
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, bench.attention_s), jnp.int32)
    out: dict[str, Any] = {"heads": bench.gpu_heads, "head_dim": bench.gpu_head_dim}
    for name in ("unmasked", "masked"):
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="sp_jax_text_dump_") as dump:
            report = compile_for_gpu(
                _attention_grad(name == "masked", bench.attention_block), x, x, x, x, seg,
                mesh_shape=(1,), axis_names=("data",), live_buffers=True,
                compiler_options={"xla_dump_to": dump})
            masks = temp_masks(dump, report.hlo)
        peak = report.peak_live
        live = sorted(peak.live_at(peak.peak_position), key=lambda b: -b.bytes)
        out[name] = {
            **{k: getattr(report, k) for k in ("argument_bytes", "output_bytes",
                                                "temp_bytes", "peak_bytes")},
            "live_peak_bytes": peak.peak_bytes, "compile_s": time.perf_counter() - t0,
            "live_at_peak": [{"name": b.name, "shape": b.shape, "bytes": b.bytes,
                              "op_name": b.op_name} for b in live if b.bytes >= MiB]}
        out[name]["temp_masks"] = masks
        out[name]["copy_sites"] = copy_sites(report.hlo, [
            b["name"] for b in out[name]["live_at_peak"] if b["name"].startswith("copy")])
    return out


# -- the run ----------------------------------------------------------------------------


def run_text(bench: TextBench = FULL, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Every measurement of the packed-documents benchmark; returns the results as one
    JSON-serialisable dict (``targets`` included). The H100 compile is ``{"error": ...}``
    without the CUDA plugin or when ``bench.gpu`` is False."""
    start = time.perf_counter()
    res: dict[str, Any] = {"bench": bench.as_dict()}
    with tempfile.TemporaryDirectory(prefix="sp_jax_text_bench_") as tmp:
        corpus, synthetic = Path(tmp) / "stdlib.jsonl", Path(tmp) / "lognormal.jsonl"
        res["corpus"] = stdlib_corpus(corpus, bench.corpus_bytes)
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(str(corpus), vocab_size=bench.vocab_size,
                                    out=Path(tmp) / "tokenizer.json")
        res["corpus"]["tokenizer_s"] = time.perf_counter() - t0
        texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
        res["corpus"]["lengths"] = _length_stats(
            [len(ids) + 1 for ids in tokenizer.encode_batch(texts)], bench.seq_len)
        log(f"corpus: {res['corpus']['documents']} files, {res['corpus']['bytes'] / 1e6:.1f} "
            f"MB, {res['corpus']['lengths']['tokens']:,} tokens; tokenizer trained in "
            f"{res['corpus']['tokenizer_s']:.1f} s")
        res["pipeline"] = pipeline_vs_step(bench, corpus, tokenizer, log)
        res["synthetic"] = lognormal_corpus(synthetic, bench)
        res["synthetic"]["lengths"] = _length_stats(
            [len(json.loads(line)["text"]) + 1 for line in synthetic.read_text().splitlines()],
            bench.seq_len)
        res["efficiency"] = {
            "stdlib": packing_efficiency(corpus, tokenizer, bench),
            "lognormal": packing_efficiency(synthetic, ByteTokenizer(), bench)}
        log("  efficiency: " + "; ".join(
            f"{c} first-fit {e['first_fit']['efficiency']:.3f}, concat "
            f"{e['concat']['efficiency']:.3f}" for c, e in res["efficiency"].items()))
    att: dict[str, Any] = {"s": bench.attention_s, "docs": bench.attention_docs,
                           "block": bench.attention_block,
                           "block_products": attention_block_products(bench),
                           "cpu": attention_times(bench)}
    cpu = att["cpu"]
    log(f"  attention CPU: masked {cpu['median_s']['masked'] * 1e3:.0f} ms, unmasked "
        f"{cpu['median_s']['unmasked'] * 1e3:.0f} ms ({cpu['ratio']:.2f}x)")
    if not bench.gpu:
        att["gpu"] = {"error": "skipped in this configuration (TextBench.gpu=False)"}
    elif not cuda_plugin_available():
        att["gpu"] = {"error": "no CUDA PJRT plugin: pip install -e '.[gpu-aot]'"}
    else:
        try:
            att["gpu"] = attention_memory(bench)
            g = att["gpu"]
            log(f"  attention H100 temp: masked {g['masked']['temp_bytes'] / MiB:.1f} MiB, "
                f"unmasked {g['unmasked']['temp_bytes'] / MiB:.1f} MiB")
        except Exception as e:  # noqa: BLE001 - reported as not measured; the rest stands
            att["gpu"] = {"error": f"{type(e).__name__}: {e}"}
            log(f"  attention H100 compile failed: {att['gpu']['error']}")
    res["attention"] = att
    res["targets"] = evaluate_targets(res)
    res["meta"] = {"jax": jax.__version__,
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
                   "cpu_count": os.cpu_count(), "runtime_s": time.perf_counter() - start}
    return res


def evaluate_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets: pipeline >= 10 x the step's tokens/s (every packing and
    worker count), first-fit efficiency >= 0.95 on the standard library corpus, masked
    attention CPU time <= 0.5 x unmasked, masked H100 temp <= unmasked. ``met`` is None
    when a measurement is not in the run."""
    out = []
    pl = res["pipeline"]
    k = TARGETS["pipeline_over_step"]
    step = pl["step"]["tokens_per_s"]
    parts = [f"{r['packing']}, {r['read_workers']} read workers: "
             f"{r['tokens_per_s']:,.0f} tokens/s = {r['ratio']:.1f}x" for r in pl["rows"]]
    out.append({"id": "text_pipeline_rate",
                "target": f"input pipeline (PackedText.train_batch) >= {k:g} x the demo "
                          f"training step's tokens/s (CPU, every packing and worker count)",
                "measured": "; ".join(parts) + f" (step {step:,.0f} tokens/s; totals over "
                            f"{res['bench']['rounds']} interleaved rounds)",
                "met": all(r["ratio"] >= k for r in pl["rows"])})
    eff = res["efficiency"]
    ff = eff["stdlib"]["first_fit"]["efficiency"]
    out.append({"id": "text_first_fit_efficiency",
                "target": f"first-fit packing efficiency >= {TARGETS['first_fit_efficiency']}"
                          f" (non-padding / all positions, standard library corpus)",
                "measured": f"{ff:.4f} over {eff['stdlib']['first_fit']['rows']} rows (log-"
                            f"normal corpus {eff['lognormal']['first_fit']['efficiency']:.4f}; "
                            f"concat {eff['stdlib']['concat']['efficiency']:.4f})",
                "met": ff >= TARGETS["first_fit_efficiency"]})
    att = res["attention"]
    cpu, n = att["cpu"], att["block_products"]
    med = cpu["median_s"]
    out.append({"id": "text_masked_attention_time",
                "target": f"document-masked blockwise attention forward+backward <= "
                          f"{TARGETS['masked_time_ratio']} x plain causal (CPU, s="
                          f"{att['s']}, {att['docs']} documents)",
                "measured": f"{cpu['ratio']:.3f}x ({med['masked'] * 1e3:.0f} vs "
                            f"{med['unmasked'] * 1e3:.0f} ms, median of {cpu['rounds']} "
                            f"interleaved rounds; block products {n['masked']} vs "
                            f"{n['unmasked']})",
                "met": cpu["ratio"] <= TARGETS["masked_time_ratio"]})
    gpu = att["gpu"]
    target = (f"document-masked attention forward+backward temp <= plain causal's (H100 "
              f"deviceless compile, bf16, s={att['s']})")
    if "error" in gpu:
        out.append({"id": "text_masked_attention_temp", "target": target,
                    "measured": f"not measured: {gpu['error']}", "met": None})
    else:
        m, u = gpu["masked"]["temp_bytes"], gpu["unmasked"]["temp_bytes"]
        extra = copies(gpu["masked"]["live_at_peak"]) - copies(gpu["unmasked"]["live_at_peak"])
        masks = len(gpu["masked"].get("temp_masks", [])) - len(
            gpu["unmasked"].get("temp_masks", []))
        why = (f"; {extra / MiB:.0f} MiB more of XLA copies live at the masked peak"
               if m > u and extra > 0 else
               "; no block-sized buffer more: the document bookkeeping (per-block id "
               "ranges, the loops' bounds: arrays of one entry per block, each "
               "allocation aligned)" if 0 < m - u < 64 * 1024 else
               f"; {masks} more boolean block masks in the masked temp (document ids)"
               if m > u and masks > 0 else "")
        out.append({"id": "text_masked_attention_temp", "target": target,
                    "measured": f"{m / MiB:.1f} vs {u / MiB:.1f} MiB ({m / u:.3f}x, "
                                f"{fmt_signed(m - u)}) at "
                                f"{gpu['heads']} heads of {gpu['head_dim']}{why}",
                    "met": m <= TARGETS["masked_temp_ratio"] * u})
    return out


# -- the report -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m benchmarks.text [--quick] [--json PATH] [--markdown PATH]``: runs
    :func:`run_text`, prints the targets, writes the outputs asked for."""
    from benchmarks.render.text import render_markdown

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.text",
        description="Packed documents: PackedText tokens/s against the demo training step, "
                    "packing efficiency, document-masked attention (CPU time, H100 temp).")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (seconds)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write the BENCHMARKS.md section here")
    args = parser.parse_args(argv)
    if jax.device_count() < 8:
        raise SystemExit(f"benchmarks.text needs 8 devices, found {jax.device_count()}: run "
                         "it as `python -m benchmarks.text` (which simulates 8 CPU devices).")
    res = run_text(QUICK if args.quick else FULL)
    write_outputs(res, json_path=args.json, markdown_path=args.markdown,
                  render=render_markdown, log=_log)
    return res


if __name__ == "__main__":
    main()
