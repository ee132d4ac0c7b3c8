"""Collectives of one block (forward and backward) in compiled HLO, CPU or H100, by role.

Every array a collective moves is classified as

- ``activation``: anything that is not a parameter (e.g. ``[b, s, h]`` hidden states);
- ``param``: its dimensions equal a parameter's (global or per-device) shape, e.g. the
  all-reduce of a replicated parameter's gradient over the data or tensor axis;
- ``scalar``: one element (the loss).

The HLO is parsed by :func:`sp_jax.analysis.parse_collectives`. Counts are of moved
arrays (``operands``), not instructions, so XLA's combiners do not change them. The phase
of a collective is read from JAX's ``op_name`` metadata (backward ops are named
``transpose(jvp(...))``); on CPU the forward counts also come from a separate compile of
the forward pass alone, and backward = forward+backward - forward.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import AxisType

from benchmarks.variants import Setup
from sp_jax.analysis import (
    COLLECTIVE_KINDS,
    Collective,
    array_bytes,
    compile_for_gpu,
    parse_collectives,
)

__all__ = ["MEGATRON", "classify", "role", "count_table", "ops_list", "cpu_block_collectives",
           "gpu_compile"]

# Megatron-LM per TP+SP layer: (all-gathers, reduce-scatters) of [s, b, h] per direction;
# the backward adds one re-gather per column layer with recompute.
MEGATRON = {
    "forward": {"all-gather": 2, "reduce-scatter": 2, "all-reduce": 0},
    "backward": {"all-gather": 2, "reduce-scatter": 2, "all-reduce": 0},
    "backward_recompute": {"all-gather": 4, "reduce-scatter": 2, "all-reduce": 0},
}


def _param_shapes(setup: Setup) -> set[tuple[int, ...]]:
    """Shapes (sorted dims, 1s dropped) a parameter or its gradient can have in the HLO:
    every global shape (GSPMD may gather a parameter), and the per-device shape of every
    parameter replicated over some mesh axis of size > 1 (its gradient is all-reduced)."""
    mesh = setup.mesh
    out = set()
    for leaf in jax.tree.leaves(setup.params):
        out.add(_key(leaf.shape))
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", None)
        if mesh is None or spec is None:
            continue
        used = {a for entry in spec if entry is not None
                for a in ((entry,) if isinstance(entry, str) else entry)}
        if any(size > 1 and name not in used for name, size in mesh.shape.items()):
            out.add(_key(sharding.shard_shape(leaf.shape)))
    return out


def _key(dims) -> tuple[int, ...]:
    return tuple(sorted(d for d in dims if d != 1))


def classify(dims: tuple[int, ...], param_shapes: set[tuple[int, ...]]) -> str:
    """``activation``, ``param`` or ``scalar`` for a moved array of per-device ``dims``
    (``param_shapes`` from :func:`_param_shapes`: XLA may transpose a gradient)."""
    if math.prod(dims) <= 1:
        return "scalar"
    if _key(dims) in param_shapes:
        return "param"
    return "activation"


def role(c: Collective) -> str:
    """What an sp_jax collective does, from the Python functions that issued it."""
    f = c.functions
    block_fns = ("Block.", "CausalSelfAttention.", "MLP.", "_ParallelLinear.", "Gspmd",
                 "Linear.", "ColumnSequenceParallelLinear.", "RowSequenceParallelLinear.",
                 "column_sequence_parallel_matmul", "_csp_", "reduce_scatter_with_all_gather_grad",
                 "row_sequence_parallel_matmul", "_rsp_", "column_parallel_matmul", "_cp_")
    if any("VocabParallelEmbedding" in x for x in f):
        where = "embedding"
    elif any("lm_head" in x or "logits_from_hidden" in x for x in f):  # GPT's LM head
        where = "LM head"
    elif any("cross_entropy" in x for x in f):
        where = "cross-entropy"
    elif any(x.startswith(block_fns) for x in f) or not f:
        where = "block"
    else:
        where = f[0]
    column = any(x.startswith(("column_sequence_parallel_matmul", "_csp_")) for x in f)
    row = any(x.startswith(("reduce_scatter_with_all_gather_grad", "row_sequence_parallel_matmul",
                             "_rsp_"))
              for x in f)
    what = ""
    if c.phase == "forward":
        if c.kind == "all-gather" and column:
            what = "column input all-gather"
        elif c.kind == "reduce-scatter" and row:
            what = "row output reduce-scatter"
    elif c.phase == "backward":
        if c.kind == "all-gather" and column:
            what = "re-gather of the column input (recompute)"
        elif c.kind == "reduce-scatter" and column:
            what = "column dx reduce-scatter"
        elif c.kind == "all-gather" and row:
            what = "row dy all-gather"
    if not what:
        return f"{where}: {c.kind} ({'/'.join(f[:1]) or c.op_name or 'XLA'})"
    return f"{where}: {what}"


def count_table(collectives: list[Collective], param_shapes, unit_elements: int,
                phase: str | None = None) -> dict[str, dict[str, float]]:
    """Per kind: moved arrays by class, activation elements in units of
    ``unit_elements`` (Megatron's ``s*b*h``), bytes, instructions and async ones."""
    out = {k: {"activation": 0, "param": 0, "scalar": 0, "activation_bytes": 0,
               "activation_units": 0.0, "param_bytes": 0, "ops": 0, "async_ops": 0,
               "activation_ops": 0, "activation_async_ops": 0}
           for k in COLLECTIVE_KINDS}
    for c in collectives:
        if phase is not None and c.phase != phase:
            continue
        row = out[c.kind]
        row["ops"] += 1
        row["async_ops"] += int(c.is_async)
        if any(classify(d, param_shapes) == "activation" for _, d in c.arrays):
            row["activation_ops"] += 1
            row["activation_async_ops"] += int(c.is_async)
        for dtype, dims in c.arrays:
            cls = classify(dims, param_shapes)
            row[cls] += 1
            if cls == "activation":
                row["activation_bytes"] += array_bytes(dtype, dims)
                row["activation_units"] += math.prod(dims) / unit_elements
            elif cls == "param":
                row["param_bytes"] += array_bytes(dtype, dims)
    return {k: v for k, v in out.items() if v["ops"]}


def _unit_elements(setup: Setup) -> int:
    sh = setup.shape
    return sh.s * sh.b_local * sh.h


def ops_list(collectives: list[Collective], param_shapes) -> list[dict[str, Any]]:
    return [{
        "kind": c.kind, "phase": c.phase, "role": role(c),
        "op": c.op_name.rsplit("/", 1)[-1] if c.op_name else "",
        "arrays": [f"{dt}{list(d)}" for dt, d in c.arrays],
        "classes": [classify(d, param_shapes) for _, d in c.arrays],
        "bytes": c.bytes, "async": c.is_async, "overlapped_ops": c.overlapped_ops,
    } for c in collectives]


def cpu_block_collectives(setup: Setup) -> dict[str, Any]:
    """Compiles ``setup``'s block forward+backward (grads of a scalar loss) on its CPU
    mesh and counts the collectives per phase; the forward pass is also compiled alone
    as a check of the phase attribution."""
    with setup.context():
        fwd = jax.jit(setup.loss).lower(setup.params, setup.x).compile().as_text()
        both = jax.jit(setup.grad_fn()).lower(setup.params, setup.x).compile().as_text()
    params = _param_shapes(setup)
    unit = _unit_elements(setup)
    ops = parse_collectives(both)
    return {
        "by_phase": {p: count_table(ops, params, unit, phase=p)
                     for p in ("forward", "backward", "unknown")},
        "forward_only_compile": count_table(parse_collectives(fwd), params, unit),
        "unit_elements": unit,
        "ops": ops_list(ops, params),
    }


def gpu_compile(fn, args: tuple, setup: Setup | None, *, mesh_shape, axis_names,
                axis_types: AxisType = AxisType.Explicit, unit_elements: int,
                param_shapes=None, live_buffers: bool = True) -> dict[str, Any]:
    """Deviceless H100 compile of ``fn(*args)`` (:func:`sp_jax.analysis.compile_for_gpu`,
    sp_jax's GPU compile options): memory (with what is live at the peak, from XLA's
    live-range dump, when ``live_buffers``) and collectives by phase."""
    rep = compile_for_gpu(fn, *args, mesh_shape=mesh_shape, axis_names=axis_names,
                          axis_types=axis_types, live_buffers=live_buffers)
    if param_shapes is None:
        param_shapes = _param_shapes(setup) if setup is not None else set()
    ops = parse_collectives(rep.hlo)
    return {
        "memory": {k: v for k, v in rep.as_dict().items()
                   if k not in ("collectives", "peak_live")},
        "peak_live": rep.peak_live.as_dict() if rep.peak_live is not None else None,
        "by_phase": {p: count_table(ops, param_shapes, unit_elements, phase=p)
                     for p in ("forward", "backward", "unknown")},
        "all_phases": count_table(ops, param_shapes, unit_elements),
        "unit_elements": unit_elements,
        "ops": ops_list(ops, param_shapes),
    }
