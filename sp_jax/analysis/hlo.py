"""Collectives in a compiled XLA program: one parser of optimized HLO text, per instruction
(:func:`parse_collectives`) and summed per kind (:func:`collective_stats`).

For each collective the parser reads what it moves, whether XLA scheduled it
asynchronously and how much work runs between its start and done, whether it belongs to
the forward or the backward pass (JAX names backward ops ``transpose(jvp(...))`` in the
``op_name`` metadata), and which Python functions issued it (the HLO's stack-frame
tables).

For a program with loops, :func:`while_loops` lists each ``while`` with the trip count
XLA proved for it, and :func:`execution_counts` how many times each computation runs per
call of the program, so a collective's bytes per step are its bytes times the count of
the computation it sits in (:attr:`Collective.computation`). :func:`replica_groups`
reads the devices of each group of a collective (every form XLA prints), and
:func:`crosses` tells whether a collective moves data between devices that differ on
some coordinate (e.g. the pipeline stage of a device).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "CollectiveStats",
    "WhileLoop",
    "array_bytes",
    "collective_stats",
    "crosses",
    "execution_counts",
    "parse_collectives",
    "replica_groups",
    "source_target_pairs",
    "while_loops",
]

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute",
                    "all-to-all")
"""The HLO collective opcodes the parser recognises (async forms: ``<kind>-start``)."""

_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>" + "|".join(COLLECTIVE_KINDS) + r")(?P<suffix>-start|-done)?"
    r"\((?P<operands>[^)]*)\)(?P<rest>.*)$"
)
_ANY_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\S.*?)\s(?P<op>[\w\-]+)"
    r"\((?P<operands>[^)]*)\)"
)
_ARRAY = re.compile(r"(?P<dtype>pred|[a-z]+\d+)\[(?P<dims>[\d,]*)\]")
_BITS = {"pred": 8}
# Instructions that do no work of their own (not counted as overlapped computation).
_TRIVIAL = {"bitcast", "get-tuple-element", "tuple", "parameter", "constant", "copy-start",
            "copy-done", "opt-barrier", "partition-id", "replica-id"}


@dataclasses.dataclass
class Collective:
    """One collective instruction (an async start/done pair counts once).

    Attributes:
      kind: one of :data:`COLLECTIVE_KINDS`.
      phase: ``"forward"``, ``"backward"`` or ``"unknown"`` (no JAX metadata, e.g. an op
        made by XLA's all-reduce combiner).
      arrays: the per-device result arrays, ``(dtype, dims)`` each; a combined op has
        several (an all-reduce of a concatenation lists the concatenated arrays).
      bytes: per-device bytes of the results.
      is_async: XLA scheduled it asynchronously (``is_sync`` false on the start).
      overlapped_ops: instructions doing work between its start and done.
      overlapped_gemms: how many of those are matrix multiplications (``dot``, a GEMM
        fusion, or a cuBLAS custom call).
      op_name: JAX's ``op_name`` metadata (empty without it).
      functions: Python functions of the issuing stack, innermost first (empty when the
        HLO has no stack-frame tables).
    """

    kind: str
    phase: str
    arrays: list[tuple[str, tuple[int, ...]]]
    bytes: int
    is_async: bool
    overlapped_ops: int
    op_name: str
    functions: list[str]
    overlapped_gemms: int = 0

    @property
    def operands(self) -> int:
        """Number of arrays it moves."""
        return len(self.arrays)


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(m.group("dtype"), tuple(int(d) for d in m.group("dims").split(",") if d))
            for m in _ARRAY.finditer(shape_text)]


def array_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    """Bytes of an HLO array ``dtype[dims]`` (e.g. ``"bf16", (2, 3)`` -> 12)."""
    bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype) or 8)
    return math.prod(dims) * bits // 8


def _stack_tables(text: str):
    """(location id -> function name, frame id -> (location id, parent frame id))."""
    section, functions, locations, frames = None, {}, {}, {}
    for line in text.splitlines():
        s = line.strip()
        if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = s
            continue
        m = re.match(r"^(\d+)\s+(.*)$", s)
        if section is None or m is None:
            if s:
                section = None
            continue
        i, rest = int(m.group(1)), m.group(2)
        fields = dict(re.findall(r"(\w+)=(\d+)", rest))
        if section == "FunctionNames":
            functions[i] = rest.strip('"')
        elif section == "FileLocations":
            locations[i] = functions.get(int(fields.get("function_name_id", 0)), "?")
        elif section == "StackFrames":
            frames[i] = (int(fields.get("file_location_id", 0)),
                         int(fields.get("parent_frame_id", 0)))
    return locations, frames


def _functions(frame: int, locations, frames) -> list[str]:
    out, seen = [], set()
    while frame in frames and frame not in seen:
        seen.add(frame)
        location, parent = frames[frame]
        out.append(locations.get(location, "?"))
        frame = parent - 1  # parent ids are 1-based; 0 = none
    return out


def _operand_names(operands: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", re.sub(r"/\*.*?\*/", "", operands))


def _split_concatenated(operands: str, arrays, defs):
    """XLA's all-reduce combiner on GPU concatenates small arrays into one flat operand:
    report the arrays that went into the concatenation instead."""
    names = _operand_names(operands)
    if len(names) != 1 or names[0] not in defs:
        return arrays
    _, opcode, inner = defs[names[0]]
    if opcode != "concatenate" and not (opcode == "fusion" and "concatenate" in names[0]):
        return arrays
    parts = []
    for name in _operand_names(inner):
        if name not in defs:
            return arrays
        found = _arrays(defs[name][0])
        if len(found) != 1:
            return arrays
        parts.append(found[0])
    return parts or arrays


def _is_gemm(name: str, opcode: str, line: str) -> bool:
    """Whether an HLO instruction is a matrix multiplication: a ``dot``, a fusion XLA
    made around one (``gemm_fusion_*`` on GPU, ``*dot*`` fusions on CPU), or a call to
    cuBLAS."""
    if opcode in ("dot", "convolution"):
        return True
    if opcode == "fusion":
        return "gemm" in name or "dot" in name
    return opcode == "custom-call" and "cublas" in line


def _hlo_text(compiled: Any) -> str:
    return compiled if isinstance(compiled, str) else compiled.as_text()


def parse_collectives(compiled: Any) -> list[Collective]:
    """Every collective of a compiled program, in program order (all computations).

    Args:
      compiled: a ``jax.stages.Compiled`` or its optimized HLO text (``as_text()``).
    """
    text = _hlo_text(compiled)
    locations, frames = _stack_tables(text)
    lines = text.splitlines()
    done_at: dict[str, int] = {}
    defs: dict[str, tuple[str, str, str]] = {}  # name -> (shape, opcode, operands)
    for i, line in enumerate(lines):
        d = _ANY_INSTR.match(line)
        if d:
            defs[d.group("name")] = (d.group("shape"), d.group("op"), d.group("operands"))
        m = _INSTR.match(line)
        if m and m.group("suffix") == "-done":
            started = m.group("operands").strip().lstrip("%")
            done_at[started] = i
    out = []
    for i, line in enumerate(lines):
        m = _INSTR.match(line)
        if m is None or m.group("suffix") == "-done":
            continue
        kind, rest = m.group("op"), m.group("rest")
        arrays = _arrays(m.group("shape"))
        if m.group("suffix") == "-start":
            n_in = m.group("operands").count("%") or 1
            if len(arrays) >= 2 * n_in and kind != "all-reduce":
                arrays = arrays[n_in:]  # (operands..., results...) -> results
        if kind == "all-reduce":
            arrays = _split_concatenated(m.group("operands"), arrays, defs)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        op_name = op_name.group(1) if op_name else ""
        phase = ("backward" if "transpose(" in op_name else "forward") if op_name else "unknown"
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        functions = _functions(int(frame.group(1)), locations, frames) if frame else []
        is_async = m.group("suffix") == "-start" and '"is_sync":true' not in rest
        overlapped = gemms = 0
        if m.group("suffix") == "-start" and m.group("name") in done_at:
            for between in lines[i + 1:done_at[m.group("name")]]:
                b = _ANY_INSTR.match(between)
                if b and b.group("op") not in _TRIVIAL and not b.group("op").endswith("-done"):
                    overlapped += 1
                    gemms += _is_gemm(b.group("name"), b.group("op"), between)
        out.append(Collective(
            kind=kind, phase=phase, arrays=arrays,
            bytes=sum(array_bytes(dtype, dims) for dtype, dims in arrays),
            is_async=is_async, overlapped_ops=overlapped, op_name=op_name,
            functions=functions, overlapped_gemms=gemms))
    return out


def _per_kind() -> dict[str, int]:
    return dict.fromkeys(COLLECTIVE_KINDS, 0)


@dataclasses.dataclass
class CollectiveStats:
    """Counts per collective kind (every key of :data:`COLLECTIVE_KINDS`) in one program.

    Attributes:
      ops: number of collective instructions (a combined op counts once).
      operands: number of arrays they move (a combined op counts each array).
      bytes: per-device bytes of their results.
      async_ops: how many XLA scheduled asynchronously (``is_sync`` false).
    """

    ops: dict[str, int] = dataclasses.field(default_factory=_per_kind)
    operands: dict[str, int] = dataclasses.field(default_factory=_per_kind)
    bytes: dict[str, int] = dataclasses.field(default_factory=_per_kind)
    async_ops: dict[str, int] = dataclasses.field(default_factory=_per_kind)

    @classmethod
    def of(cls, collectives: list[Collective]) -> CollectiveStats:
        """The sums over ``collectives`` (from :func:`parse_collectives`)."""
        stats = cls()
        for c in collectives:
            stats.ops[c.kind] += 1
            stats.operands[c.kind] += c.operands
            stats.bytes[c.kind] += c.bytes
            stats.async_ops[c.kind] += int(c.is_async)
        return stats


def collective_stats(compiled: Any) -> CollectiveStats:
    """Collective instructions of ``compiled`` (a ``jax.stages.Compiled`` or HLO text),
    counted per kind: :func:`parse_collectives` summed."""
    return CollectiveStats.of(parse_collectives(compiled))
