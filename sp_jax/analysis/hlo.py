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
                    "all-to-all", "ragged-all-to-all")
"""The HLO collective opcodes the parser recognises (async forms: ``<kind>-start``). A
``ragged-all-to-all``'s bytes are those of its result, the static receive buffer; the
rows it moves are data-dependent (its ``send_sizes`` operand)."""

_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>" + "|".join(COLLECTIVE_KINDS) + r")(?P<suffix>-start|-done)?"
    r"\((?P<operands>[^)]*)\)(?P<rest>.*)$"
)
_ANY_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\S.*?)\s(?P<op>[\w\-]+)"
    r"\((?P<operands>[^)]*)\)"
)
# FP8 types (f8e4m3fn, f8e5m2, ...) spell their exponent and mantissa widths
_ARRAY = re.compile(r"(?P<dtype>pred|f8e\d+m\d+(?:fnuz|fn)?|[a-z]+\d+)\[(?P<dims>[\d,]*)\]")
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
      overlapped_gemms: how many of ``overlapped_ops`` are matrix multiplications.
      name: the instruction's name (the ``-start`` of an async pair).
      computation: the HLO computation it belongs to (``""`` for text outside any); its
        execution count per step is ``execution_counts(hlo)[computation]``.
      groups: the devices of each replica group (:func:`replica_groups`): ``()`` when the
        op lists none (every device takes part); ``None`` for a collective-permute.
      pairs: a collective-permute's ``(source, target)`` devices
        (:func:`source_target_pairs`); ``()`` for the other kinds.
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
    name: str = ""
    computation: str = ""
    groups: tuple[tuple[int, ...], ...] | None = None
    pairs: tuple[tuple[int, int], ...] = ()

    @property
    def operands(self) -> int:
        """Number of arrays it moves."""
        return len(self.arrays)


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(m.group("dtype"), tuple(int(d) for d in m.group("dims").split(",") if d))
            for m in _ARRAY.finditer(shape_text)]


def array_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    """Bytes of an HLO array ``dtype[dims]`` (e.g. ``"bf16", (2, 3)`` -> 12)."""
    bits = _BITS.get(dtype) or (8 if dtype.startswith("f8") else
                                int(re.sub(r"\D", "", dtype) or 8))
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
    computation = ""
    for i, line in enumerate(lines):
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group("name")
            continue
        if line.startswith("}"):
            computation = ""
            continue
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
        if kind == "ragged-all-to-all":  # ((operand, output, 4 offsets/sizes), result)
            arrays = arrays[-1:]
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
            functions=functions, overlapped_gemms=gemms, name=m.group("name"),
            computation=computation,
            groups=None if kind == "collective-permute" else (replica_groups(rest) or ()),
            pairs=source_target_pairs(rest) if kind == "collective-permute" else ()))
    return out


# -- device groups -----------------------------------------------------------------------

_GROUP_LIST = re.compile(r"replica_groups=\{(?P<groups>(?:\{[\d,\s]*\},?\s*)*)\}")
_GROUP_IOTA = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\]"
                         r"(?:T\((?P<perm>[\d,]+)\))?")
_GROUP_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>\[[\d,]+\](?:T\([\d,]+\))?|\{[\d,{}\s]*\})\))?"
    r"\s*\{(?P<grouped>[^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>(?:\{\d+,\s*\d+\},?\s*)*)\}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    """XLA's iota tile assignment ``[dims]T(perm)``: ``arange`` reshaped to ``dims``,
    transposed by ``perm``, flattened."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def _mesh_groups(m: re.Match) -> tuple[tuple[int, ...], ...]:
    """Groups of a ``mesh[...] {axes}`` device list: the devices that differ only on the
    grouped (sub-)axes, ordered by those axes as listed."""
    axes = [(name, int(size)) for name, size in
            re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group("axes"))]
    sizes = [size for _, size in axes]
    index = {name: i for i, (name, _) in enumerate(axes)}
    ids_text = m.group("ids")
    if ids_text is None:
        ids = np.arange(math.prod(sizes))
    elif ids_text.startswith("{"):
        ids = np.asarray(_ints(ids_text))
    else:
        dims, _, perm = ids_text.partition("T")
        ids = _iota(_ints(dims), _ints(perm) or None)
    ids = ids.reshape(sizes)
    # (axis, size of what is left of the axis below the sub-axis, sub-axis size) per ref
    refs = []
    for name, pre, size in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?",
                                      m.group("grouped")):
        axis = index[name]
        if pre:
            refs.append((axis, sizes[axis] // (int(pre) * int(size)), int(size)))
        else:
            refs.append((axis, 1, sizes[axis]))
    groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
    for coords in np.ndindex(*sizes):
        inner = tuple(coords[a] // below % size for a, below, size in refs)
        rest = list(coords)
        for a, below, size in refs:  # remove the sub-axis digit from the coordinate
            rest[a] = rest[a] // (below * size) * below + rest[a] % below
        groups.setdefault(tuple(rest), []).append((inner, int(ids[coords])))
    return tuple(tuple(d for _, d in sorted(members)) for _, members in sorted(groups.items()))


def replica_groups(instruction: str) -> tuple[tuple[int, ...], ...] | None:
    """The device groups of a collective instruction's ``replica_groups`` attribute, in
    any of the forms XLA prints: ``{{0,1},{2,3}}``, the iota form ``[2,4]<=[4,2]T(1,0)``,
    and the mesh-axes form ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}`` (the
    devices that differ only on the listed axes; sub-axes ``'a':(1)2`` included).

    Args:
      instruction: one line of HLO text (or any text holding the attribute).

    Returns:
      one tuple of device ids per group; ``()`` for ``replica_groups={}`` (one group of
      every device); ``None`` when the text has no ``replica_groups``.

    Raises:
      ValueError: the attribute is there in a form this parser does not know.
    """
    if "replica_groups=" not in instruction:
        return None
    m = _GROUP_LIST.search(instruction)
    if m:
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", m.group("groups")))
    m = _GROUP_IOTA.search(instruction)
    if m:
        shape = _ints(m.group("shape"))
        ids = _iota(_ints(m.group("dims")), _ints(m.group("perm") or "") or None)
        return tuple(tuple(int(d) for d in g) for g in ids.reshape(shape))
    m = _GROUP_MESH.search(instruction)
    if m:
        return _mesh_groups(m)
    raise ValueError("replica_groups: unknown form in "
                     f"{instruction[instruction.index('replica_groups='):][:200]!r}")


def source_target_pairs(instruction: str) -> tuple[tuple[int, int], ...]:
    """The ``(source, target)`` device pairs of a collective-permute instruction's
    ``source_target_pairs`` (``()`` when the text has none)."""
    m = _PAIRS.search(instruction)
    if m is None:
        return ()
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),\s*(\d+)\}", m.group("pairs")))


def crosses(collective: Collective, key: Callable[[int], Any]) -> bool:
    """Whether ``collective`` moves data between devices with different ``key(device)``
    (e.g. ``key = lambda d: d // 2``: the pipeline stage of device ``d`` on a
    ``(stages, 1, 1, 2)`` mesh): a pair of a collective-permute, or a replica group,
    with devices of more than one key. A collective that lists no groups spans every
    device and counts as crossing."""
    if collective.kind == "collective-permute":
        return any(key(a) != key(b) for a, b in collective.pairs)
    if not collective.groups:
        return True
    return any(len({key(d) for d in group}) > 1 for group in collective.groups)


# -- loops and how often each computation runs ---------------------------------------------

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\{\s*$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(r"\b(?P<attr>body|condition|calls|to_apply|true_computation|"
                     r"false_computation)=%?(?P<name>[\w.\-]+)")
_CALLED_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{(?P<names>[^}]*)\}")


@dataclasses.dataclass(frozen=True)
class WhileLoop:
    """One ``while`` instruction of a compiled program.

    Attributes:
      name: the instruction's name.
      computation: the computation it sits in.
      body / condition: the computations it runs each iteration.
      trip_count: iterations per execution of the ``while``, as XLA proved them
        (``known_trip_count`` in its backend config); ``None`` if XLA does not know.
        XLA may unroll a loop (GPU: "double buffering" runs two iterations of the
        source loop per iteration and peels one before or after), so one iteration of
        ``body`` may hold several copies of the source loop's body.
      op_name: JAX's ``op_name`` metadata of the ``while``.
    """

    name: str
    computation: str
    body: str
    condition: str
    trip_count: int | None
    op_name: str


def _structure(text: str) -> tuple[str | None, list[tuple[str, str]], list[WhileLoop],
                                   list[tuple[str, str, int | None]]]:
    """(entry computation, (computation, instruction line) pairs, while loops, call
    edges ``(caller, callee, times per caller execution or None)``)."""
    entry, current, lines, loops, edges = None, "", [], [], []
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group("name")
            if line.startswith("ENTRY"):
                entry = current
            continue
        if line.startswith("}"):
            current = ""
            continue
        if not current or "=" not in line:
            continue
        lines.append((current, line))
        d = _ANY_INSTR.match(line)
        trip = None
        if d and d.group("op") == "while":
            t = _TRIP.search(line)
            trip = int(t.group(1)) if t else None
            called = dict((m.group("attr"), m.group("name")) for m in _CALLED.finditer(line))
            op = re.search(r'op_name="([^"]*)"', line)
            loops.append(WhileLoop(d.group("name"), current, called.get("body", ""),
                                   called.get("condition", ""), trip,
                                   op.group(1) if op else ""))
        for m in _CALLED.finditer(line):
            times: int | None = 1
            if m.group("attr") == "body":
                times = trip
            elif m.group("attr") == "condition":
                times = None if trip is None else trip + 1
            edges.append((current, m.group("name"), times))
        for m in _CALLED_LISTS.finditer(line):
            for name in re.findall(r"%?([\w.\-]+)", m.group("names")):
                edges.append((current, name, 1))
    return entry, lines, loops, edges


def while_loops(compiled: Any) -> list[WhileLoop]:
    """Every ``while`` of a compiled program (a ``jax.stages.Compiled`` or its optimized
    HLO text), in program order, with the trip count XLA proved for it."""
    return _structure(_hlo_text(compiled))[2]


def execution_counts(compiled: Any) -> dict[str, int | None]:
    """How many times each computation of a compiled program (a ``jax.stages.Compiled``
    or its optimized HLO text) runs per call of the program: 1 for the entry
    computation; a ``while`` body runs its loop's trip count times per execution of the
    computation holding the loop (the condition once more); other called computations
    (fusions, calls, reducers) as often as their caller. Each branch of a
    ``conditional`` is counted as often as the conditional runs: an upper bound, as
    only one branch runs each time. ``None`` where a loop's trip count is unknown;
    0 for computations the entry never reaches.

    Multiply a collective's bytes by the count of its :attr:`Collective.computation`
    for the bytes it moves per call of the program."""
    entry, _, _, edges = _structure(_hlo_text(compiled))
    callers: dict[str, list[tuple[str, int | None]]] = {}
    names = set()
    for caller, callee, times in edges:
        callers.setdefault(callee, []).append((caller, times))
        names.update((caller, callee))
    counts: dict[str, int | None] = {}

    def count(name: str, seen: frozenset[str] = frozenset()) -> int | None:
        if name in counts:
            return counts[name]
        if name == entry or (entry is None and name not in callers):
            counts[name] = 1
            return 1
        total: int | None = 0
        for caller, times in callers.get(name, []):
            if caller in seen:
                continue
            n = count(caller, seen | {name})
            if n is None or times is None:
                if n != 0:
                    total = None
                    break
                continue
            total += n * times
        counts[name] = total
        return total

    for name in sorted(names | ({entry} if entry else set())):
        count(name)
    return counts


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
