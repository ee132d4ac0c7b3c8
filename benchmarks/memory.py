"""Activation memory per block and device: what the backward pass keeps.

Every variant's residuals come from :func:`sp_jax.analysis.saved_residuals` (abstract
``jax.vjp``, no compute; global and per-device shape, dtype and JAX's source of each).
sp_jax variants and the unsharded block: per-device shapes from the residuals' shardings
on the Explicit mesh. The GSPMD baseline runs on an Auto mesh, where shardings are not
part of the types: its per-device shapes are read from the compiled forward pass that
returns the residuals (``jax.jit`` of ``jax.vjp(...)[1]``; XLA:CPU, the shardings GSPMD
chose).

Every residual is classified by evaluating the variant again with a doubled batch:
arrays whose shape does not change and equal a parameter's (or its low-precision copy's)
per-device shape are **weights** and are not counted; everything else is an
**activation**. Activations are also assigned to the terms of Korthikanti et al.'s count
(:data:`TERMS`) from their per-device shape and JAX's source information.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from benchmarks.records import TERMS
from benchmarks.variants import Setup, Shape, make_setup
from sp_jax.analysis import Residual, activation_bytes_formula, saved_residuals

__all__ = ["TERMS", "ResidualRow", "activation_memory", "paper_terms"]


@dataclasses.dataclass
class ResidualRow:
    """One residual: global and per-device shape, dtype, per-device bytes, JAX's source,
    ``kind`` (``activation`` / ``weight``) and ``term`` (a key of :data:`TERMS`)."""

    shape: tuple[int, ...]
    device_shape: tuple[int, ...]
    dtype: str
    bytes: int
    source: str
    kind: str
    term: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _squeeze(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _param_device_shapes(setup: Setup) -> set[tuple[int, ...]]:
    out = set()
    for leaf in jax.tree.leaves(setup.params):
        sharding = getattr(leaf, "sharding", None)
        shape = tuple(sharding.shard_shape(leaf.shape)) if sharding is not None else leaf.shape
        out.add(_squeeze(shape))
    return out


def _term(row: ResidualRow, shape: Shape, t: int, compute_dtype: str, previous: str) -> str:
    b, s, h, a = shape.b_local, shape.s, shape.h, shape.a
    dev, src = row.device_shape, row.source
    columns = ((b, s // t, h), (b, s, h))
    if dev == (b, s, h // t) and (t > 1 or previous in ("qkv_out", "attention_sxs")):
        return "out_proj_copy"  # at t = 1 it has the column inputs' shape: the position tells
    if dev in columns and row.dtype == compute_dtype != "float32":
        return "column_inputs"  # the norms' internals are fp32
    if any(f in src for f in ("normalization.py", "_normalize", "_compute_stats")):
        return "layernorm"
    if row.dtype == "float32" and dev[:2] == (b, s // t):
        return "layernorm"
    if dev in columns:
        return "column_inputs"
    if dev == (b, s, a // t, h // a):
        return "qkv_out"
    if dev in ((b, a // t, s), (b, a // t, s, 1)):
        return "attention_sxs"
    if dev == (b, s, 4 * h // t):
        return "mlp_hidden"
    return "other"


def _residuals(setup: Setup) -> list[Residual]:
    with setup.context():
        return saved_residuals(setup.apply, setup.params, setup.x)


def _gspmd_device_shapes(setup: Setup, residuals: list[Residual]) -> list[tuple[int, ...]]:
    with setup.context():
        compiled = jax.jit(lambda p, x: jax.vjp(setup.apply, p, x)[1]).lower(
            setup.params, setup.x).compile()
    shardings = jax.tree.leaves(compiled.output_shardings)
    if len(shardings) != len(residuals):
        raise RuntimeError(f"{len(shardings)} output shardings for {len(residuals)} residuals")
    return [tuple(s.shard_shape(r.shape)) for s, r in zip(shardings, residuals, strict=True)]


def residual_rows(variant: str, shape: Shape) -> list[ResidualRow]:
    """Every residual of ``variant``'s block at ``shape`` (abstract; GSPMD compiles)."""
    setup = make_setup(variant, shape, abstract=True)
    doubled = make_setup(variant, shape.replace(b=2 * shape.b), abstract=True)
    residuals = _residuals(setup)
    residuals2 = _residuals(doubled)
    if variant == "gspmd":
        device_shapes = _gspmd_device_shapes(setup, residuals)
    else:
        device_shapes = [r.device_shape for r in residuals]
    param_shapes = _param_device_shapes(setup)
    t = shape.t if variant != "unsharded" else 1
    compute = np.dtype(shape.dtype).name
    same_count = len(residuals2) == len(residuals)
    rows, previous = [], ""
    for i, (res, dev) in enumerate(zip(residuals, device_shapes, strict=True)):
        batch_independent = same_count and residuals2[i].shape == res.shape
        is_weight = batch_independent and _squeeze(dev) in param_shapes
        row = ResidualRow(shape=res.shape, device_shape=tuple(dev), dtype=res.dtype.name,
                          bytes=math.prod(dev) * res.dtype.itemsize, source=res.source,
                          kind="weight" if is_weight else "activation", term="")
        if not is_weight:
            row.term = previous = _term(row, shape, t, compute, previous)
        rows.append(row)
    _relabel_norm_inputs(rows, shape, t)
    return rows


def _relabel_norm_inputs(rows: list[ResidualRow], shape: Shape, t: int) -> None:
    """A norm that keeps its own input (e.g. a custom VJP) saves a ``[b, s/t, h]`` array
    right before its per-token statistics; by shape alone it looks like a column input."""
    acts = [r for r in rows if r.kind == "activation"]
    stats = {(shape.b_local, shape.s // t, 1), (shape.b_local, shape.s // t)}
    for this, nxt in zip(acts, acts[1:], strict=False):
        if this.term == "column_inputs" and nxt.term == "layernorm" and \
                nxt.device_shape in stats:
            this.term = "layernorm"


def paper_terms(rows: list[ResidualRow]) -> dict[str, int]:
    """Activation bytes per :data:`TERMS` key."""
    out = {key: 0 for key, _, _ in TERMS}
    for r in rows:
        if r.kind == "activation":
            out[r.term] += r.bytes
    return out


def activation_memory(variant: str, shape: Shape, *, detail: bool = False) -> dict[str, Any]:
    """Per-device activation bytes of one block of ``variant`` at ``shape`` and the
    formula's figures for the same shape.

    Returns a dict with ``activation_bytes``, ``weight_residual_bytes``, ``terms`` (bytes
    per paper term), ``formula`` (bytes per formula mode at this ``t``; ``t = 1`` for the
    unsharded variant) and, with ``detail``, the list of ``residuals``.
    """
    rows = residual_rows(variant, shape)
    t = shape.t if variant != "unsharded" else 1
    s, b, h, a = shape.s, shape.b_local, shape.h, shape.a
    formula = {mode: activation_bytes_formula(s, b, h, a, t, mode)
               for mode in ("none", "tp", "tp_sp", "tp_sp_selective")}
    out = {
        "variant": variant,
        "shape": shape.as_dict(),
        "t": t,
        "activation_bytes": sum(r.bytes for r in rows if r.kind == "activation"),
        "weight_residual_bytes": sum(r.bytes for r in rows if r.kind == "weight"),
        "unit_bytes": s * b * h // t,  # the formula's s*b*h/t
        "terms": paper_terms(rows),
        "formula": formula,
    }
    if detail:
        out["residuals"] = [r.as_dict() for r in rows]
    return out
