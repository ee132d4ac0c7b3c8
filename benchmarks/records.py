"""What the benchmarks' measuring modules and their rendering (:mod:`benchmarks.render`)
share: units and formatters, the names of the variants and terms measured, the settings
of the stand-alone sections (:class:`PipelineBench`, ...) and the readings of their
results that the tables show. Measurement imports it, rendering imports it; rendering
imports no measuring module (``tests/test_structure.py`` checks that benchmarks/ has no
import circle). It imports nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

__all__ = [
    "GenerationBench", "LABELS", "MIXTRAL", "MiB", "PipelineBench", "SCHEDULES", "SP_VARIANTS",
    "STACK_LABELS", "STACK_VARIANTS", "TERMS", "TORCH_ENV", "TextBench", "VARIANTS",
    "analytic_bytes", "collectives_per_token", "copies", "expected_ticks", "find_record",
    "fmt_mesh", "fmt_mib", "fmt_signed", "fmt_size", "measured_ticks", "status",
    "RECORDED_FIELDS", "load_recorded",
]


# -- units and formatters ---------------------------------------------------------------

MiB = 2**20


def fmt_mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


def fmt_signed(n: int) -> str:
    """A byte difference: ``+47.66 MiB``, ``+260 KiB``."""
    return f"{n / MiB:+.2f} MiB" if abs(n) >= MiB else f"{n / 1024:+.0f} KiB"


def fmt_size(n: float) -> str:
    """Bytes as MiB, or KiB below one MiB."""
    return f"{n / MiB:,.1f} MiB" if n >= MiB else f"{n / 1024:,.1f} KiB"


def fmt_mesh(mesh: str) -> str:
    return mesh.replace(",", " x ")


def status(met: bool | None) -> str:
    """A target's verdict in a section's table."""
    return {True: "PASS", False: "**MISS**", None: "not measured"}[met]


# -- the variants and the names of what was measured ---------------------------------------

VARIANTS = ("unsharded", "gspmd", "sp_save", "sp_recompute")


SP_VARIANTS = ("sp_save", "sp_recompute")


LABELS = {
    "unsharded": "unsharded (1 device)",
    "gspmd": "GSPMD TP+SP baseline",
    "sp_save": "sp_jax save",
    "sp_recompute": "sp_jax recompute",
}


STACK_VARIANTS = ("gspmd", "sp_save", "sp_recompute", "sp_save_cm", "sp_recompute_cm")


STACK_LABELS = {
    "gspmd": "GSPMD",
    "sp_save": "sp_jax save",
    "sp_recompute": "sp_jax recompute",
    "sp_save_cm": "sp_jax save + collective matmul",
    "sp_recompute_cm": "sp_jax recompute + collective matmul",
}


# Korthikanti et al. 2022 (Sec. 4.1), bytes per layer in units of s*b*h / t (TP+SP);
# the s x s term is 5*a*s/h in these units.
TERMS = (
    ("layernorm", "LayerNorm inputs (2 norms)", 4),
    ("column_inputs", "column-layer inputs (qkv, MLP up)", 4),
    ("qkv_out", "q, k, v and attention output (= out-projection input)", 8),
    ("out_proj_copy", "out-projection input as its own residual (reshape of the above)", 0),
    ("attention_sxs", "s x s attention arrays (scores, softmax, dropout) / ours: log-sum-exp",
     None),
    ("mlp_hidden", "MLP hidden [s, 4h] (GeLU input, down-projection input)", 16),
    ("dropout_masks", "dropout masks (attention and MLP outputs)", 2),
    ("other", "other", 0),
)


MIXTRAL = dict(h=4096, F=14336, E=8, k=2, s=4096, batch=8, heads=32, kv_heads=8, layers=2)
"""The Mixtral-8x7B-shaped stack of the targets."""


SCHEDULES = ("gpipe", "1f1b")


TORCH_ENV = "SP_JAX_TORCH_PYTHON"


# -- the settings of the stand-alone sections (their results hold them as dicts) ----------

@dataclasses.dataclass(frozen=True)
class PipelineBench:
    """Shapes of the pipeline benchmark: ``layers`` blocks of ``h`` / ``a`` on a
    ``stages x 1 x 1 x tensor`` mesh of H100s, ``b`` sequences of ``s`` tokens per
    micro-batch, a ``vocab`` vocabulary (tied embedding), bf16 compute with fp32
    parameters, ``recompute_allgather``, fp32 weight gradients, AdamW."""

    stages: int = 4
    tensor: int = 2
    layers: int = 8
    h: int = 4096
    a: int = 32
    s: int = 2048
    b: int = 1
    vocab: int = 32768  # as the GPT compiles of benchmarks.run (FULL.gpt_vocab)
    microbatches: tuple[int, ...] = (4, 8, 16, 32)  # memory sweep (R = 1)
    tick_microbatches: int = 8  # tick counts and traffic, R = 1 and 2
    repeats: tuple[int, ...] = (1, 2)

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.stages, 1, 1, self.tensor)

    @property
    def devices(self) -> int:
        return self.stages * self.tensor

    @property
    def shard_bytes(self) -> int:
        """Bytes of one activation shard ``[b, s / (c t), h]`` in bf16 (c = 1)."""
        return self.b * self.s // self.tensor * self.h * 2

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GenerationBench:
    """Settings of the generation benchmark.

    CPU: ``GPTConfig.llama(cpu_preset)`` with ``cpu_overrides`` (fp32), random weights of
    seed 0 written by ``to_hf`` and read back by ``from_hf`` on every mesh; for each
    ``(batch, mesh)`` of ``runs`` (mesh ``"data,tensor"``), ``batch`` random prompts of
    ``prompt_len`` tokens (seed 0) continued by ``new_tokens`` greedy tokens, and each
    batch again on every mesh of ``reference_meshes`` (``"1,1"``: one device, no
    collectives: what the simulated devices cost); every program run ``warmup`` times
    first (the compiles), then ``rounds`` interleaved rounds (the order rotated per
    round). H100: ``GPTConfig.llama(
    gpu_preset, dtype=bf16, param_dtype=bf16, scan_layers=True)`` with ``gpu_overrides``
    on ``data 1 x tensor gpu_tensor``, ``gpu_batch`` rows, a ``gpu_cache``-token cache
    (``gpu`` False skips the compile)."""

    cpu_preset: str = "llama-tiny"
    cpu_overrides: tuple[tuple[str, Any], ...] = (
        ("num_layers", 4), ("hidden", 256), ("mlp_hidden", 768), ("vocab_size", 4096))
    runs: tuple[tuple[int, str], ...] = ((1, "1,8"), (8, "2,4"))
    reference_meshes: tuple[str, ...] = ("1,1",)
    prompt_len: int = 16
    new_tokens: int = 64
    warmup: int = 1
    rounds: int = 15
    gpu_preset: str = "llama-3-8b"
    gpu_overrides: tuple[tuple[str, Any], ...] = ()
    gpu_tensor: int = 8
    gpu_batch: int = 8
    gpu_cache: int = 4096
    gpu: bool = True

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationBench:
        def tuples(v: Any) -> Any:
            return tuple(tuples(x) for x in v) if isinstance(v, list | tuple) else v

        return cls(**{k: tuples(v) for k, v in d.items()})


@dataclasses.dataclass(frozen=True)
class TextBench:
    """Settings of the packed-documents benchmark.

    Corpus: up to ``corpus_bytes`` of JSON lines, one standard library ``.py`` file per
    line (files in a shuffle by seed 0), and a ``vocab_size`` BPE tokenizer trained on it.
    Pipeline and step: ``batch_size`` rows of ``seq_len`` in ``micro_batches``, the demo
    model of ``examples/train_gpt.py`` on its ``--mesh 2,4`` (``layers`` / ``hidden`` /
    ``heads`` override the preset's when set), fp32; ``warmup_steps`` batches per
    pipeline first, then ``rounds`` rounds each reading ``steps_per_round`` batches from
    every pipeline and running ``step_repeats`` training steps. Efficiency: the rows of
    ``efficiency_steps`` steps; the synthetic corpus has ``lognormal_docs`` documents of
    byte lengths log-normal around ``lognormal_median`` (``lognormal_sigma``), read by
    :class:`~sp_jax.data.ByteTokenizer`. Attention: ``attention_s`` rows holding
    ``attention_docs`` documents of equal length, blocks of ``attention_block``; CPU
    (fp32, batch 1, ``cpu_heads`` x ``cpu_head_dim``, ``attention_rounds`` interleaved
    rounds) and H100 (bf16, batch 1, ``gpu_heads`` x ``gpu_head_dim``; ``gpu`` False
    skips the compiles)."""

    corpus_bytes: int = 5_000_000
    vocab_size: int = 4096
    seq_len: int = 128
    batch_size: int = 16
    micro_batches: int = 2
    mesh: str = "2,4"
    packings: tuple[str, ...] = ("first_fit", "concat")
    read_workers: tuple[int, ...] = (0, 2)
    warmup_steps: int = 10
    rounds: int = 8
    steps_per_round: int = 25
    step_repeats: int = 2
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    efficiency_steps: int = 100
    lognormal_docs: int = 4000
    lognormal_median: int = 64
    lognormal_sigma: float = 1.0
    attention_s: int = 8192
    attention_docs: int = 8
    attention_block: int = 512
    cpu_heads: int = 8
    cpu_head_dim: int = 64
    attention_rounds: int = 5
    gpu_heads: int = 32
    gpu_head_dim: int = 128
    gpu: bool = True

    @property
    def pipeline_steps(self) -> int:
        return self.rounds * self.steps_per_round

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TextBench:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


# -- readings of the results -------------------------------------------------------------

def find_record(records: list[dict[str, Any]], kind: str, m: int, r: int = 1) -> dict[str, Any]:
    for rec in records:
        if (rec["kind"], rec["microbatches"], rec["repeats"]) == (kind, m, r):
            return rec
    raise KeyError((kind, m, r))


def measured_ticks(traffic: dict[str, Any]) -> dict[str, int]:
    """Ticks of the compiled loops, from their activation sends (:func:`stage_traffic`):
    ``forward_ring`` / ``backward_ring``, the sends per step to the next / previous stage
    (one per tick that forwards / back-propagates), ``both``, the ticks holding one of
    each (iterations of the loops whose body sends both ways, times the copies of a
    send per iteration: XLA's unrolling), and ``iterations = forward_ring +
    backward_ring - both``, the ticks the loops run in all."""
    out = {"forward_ring": 0, "backward_ring": 0, "both": 0}
    copies: dict[str, dict[int, int]] = {}
    trips: dict[str, int] = {}
    for e in traffic["activations"]:
        out["forward_ring" if e["direction"] == 1 else "backward_ring"] += e["executions"]
        for name, trip, n in e["loops"]:
            copies.setdefault(name, {})[e["direction"]] = n
            trips[name] = trip or 0
    for name, by_direction in copies.items():
        if len(by_direction) == 2:
            out["both"] += trips[name] * min(by_direction.values())
    out["iterations"] = out["forward_ring"] + out["backward_ring"] - out["both"]
    return out


def expected_ticks(rec: dict[str, Any]) -> dict[str, int]:
    """:func:`measured_ticks` as the schedule's tables say: a send to the next stage
    per tick in which some stage forwards, one to the previous stage per tick in which
    some stage back-propagates; GPipe's two loops (forward, then its autodiff) each run
    ``num_ticks``, 1F1B's ``num_ticks`` together."""
    sch = rec["schedule"]
    f, b, n = sch["forward_ticks"], sch["backward_ticks"], sch["num_ticks"]
    if rec["kind"] == "gpipe":
        return {"forward_ring": n, "backward_ring": n, "both": 0, "iterations": 2 * n}
    return {"forward_ring": f, "backward_ring": b, "both": f + b - n, "iterations": n}


def analytic_bytes(rec: dict[str, Any], shard_bytes: int) -> int:
    """Activation bytes per step and device: one ``[b, s/(c t), h]`` shard per send of
    :func:`expected_ticks`."""
    ticks = expected_ticks(rec)
    return (ticks["forward_ring"] + ticks["backward_ring"]) * shard_bytes


def collectives_per_token(gpu: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per collective kind of the decode step: instructions in the HLO, how many run per
    decoded token and their bytes per GPU (each instruction's bytes x its runs), and how
    many instructions sit in a loop body (with the loop's trip count)."""
    out: dict[str, dict[str, Any]] = {}
    for c in gpu["collectives"]:
        k = out.setdefault(c["kind"], {"in_hlo": 0, "runs": 0, "bytes": 0, "in_loop": 0,
                                       "trips": set(), "async": 0, "overlapped": 0})
        runs = c["runs"] if c["runs"] is not None else 1
        k["in_hlo"] += 1
        k["runs"] += runs
        k["bytes"] += c["bytes"] * runs
        k["async"] += int(c["async"])
        k["overlapped"] += int(c.get("overlapped_ops", 0) > 0)
        if runs > 1:
            k["in_loop"] += 1
            k["trips"].add(runs)
    for k in out.values():
        k["trips"] = sorted(k["trips"])
    return out


def copies(live: list[dict[str, Any]]) -> int:
    """Bytes of the buffers at a peak that XLA's copy insertion made (``copy.N``)."""
    return sum(b["bytes"] for b in live if b["name"].startswith("copy"))


# -- the sections make bench does not measure ------------------------------------------------

RECORDED_FIELDS = ("key", "after", "heading", "date", "command", "machine", "why", "markdown")
"""The fields of each entry of ``docs/bench_recorded.json`` (:func:`load_recorded`)."""


def load_recorded(path: Any) -> list[dict[str, Any]]:
    """The recorded sections of ``BENCHMARKS.md`` (``docs/bench_recorded.json``): what
    ``make bench`` does not measure (too long for its budget, or needing a cluster or a
    GPU), each entry with :data:`RECORDED_FIELDS`: ``key``, ``after`` (the section it
    follows: a key of the run's results or another entry's), ``heading`` (``"## ..."``,
    ``"### ..."`` or None for a note), when (``date``), how (``command``) and where
    (``machine``) it was measured, ``why`` it is not in the run, and its ``markdown``.
    Empty for a path that does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    entries = json.loads(path.read_text())["sections"]
    for e in entries:
        missing = [f for f in RECORDED_FIELDS if f not in e]
        if missing:
            raise ValueError(f"{path}: recorded section {e.get('key')!r} lacks {missing}")
    return entries
