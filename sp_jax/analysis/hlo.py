"""Collectives in a compiled XLA program."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")

_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?\S+\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all)"
    r"(?P<start>-start)?\((?P<operands>[^)]*)\)(?P<rest>.*)$"
)
_ARRAY = re.compile(r"(?P<dtype>pred|[a-z]+\d+)\[(?P<dims>[\d,]*)\]")
_BITS = {"pred": 8}


def _bytes(shape_text: str) -> int:
    total = 0
    for m in _ARRAY.finditer(shape_text):
        dtype = m.group("dtype")
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype) or 8)
        dims = [int(d) for d in m.group("dims").split(",") if d]
        total += int(np.prod(dims, dtype=np.int64)) * bits // 8
    return total


@dataclasses.dataclass
class CollectiveStats:
    """Counts per collective kind in one compiled program.

    Attributes:
      ops: number of collective instructions (a combined op counts once).
      operands: number of arrays they move (a combined op counts each operand).
      bytes: per-device bytes of their results.
      async_ops: how many XLA scheduled asynchronously (``is_sync`` false).
    """

    ops: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    operands: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(KINDS, 0)
    )
    bytes: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    async_ops: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(KINDS, 0)
    )


def collective_stats(compiled: Any) -> CollectiveStats:
    """Collective instructions of ``compiled`` (a ``jax.stages.Compiled`` or HLO text)."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    stats = CollectiveStats()
    for line in text.splitlines():
        m = _OP.match(line)
        if m is None:
            continue
        kind = m.group("op")
        operand_text = m.group("operands")
        n_operands = operand_text.count("%") or len(
            [o for o in operand_text.split(",") if o.strip()]
        )
        shape = m.group("shape")
        if m.group("start"):
            # An async start returns (operands..., results...); count the results only.
            arrays = _ARRAY.findall(shape)
            n = n_operands
            if len(arrays) >= 2 * n:
                shape = " ".join(f"{d}[{s}]" for d, s in arrays[n:])
        stats.ops[kind] += 1
        stats.operands[kind] += n_operands
        stats.bytes[kind] += _bytes(shape)
        if m.group("start") and '"is_sync":true' not in m.group("rest"):
            stats.async_ops[kind] += 1
    return stats
