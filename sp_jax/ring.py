"""Bidirectional ring schedules: an all-gather or a reduce-scatter over a mesh axis as
``t - 1`` collective-permutes, each overlapped with the computation on one chunk.

The building blocks of collective matmul (the shard_map notebook's pattern, and
Wang et al. 2023, "Overlap communication with dependent computation via decomposition"):
instead of gathering a whole ``[.., s, ..]`` array and then multiplying, every device
multiplies the chunk it has while the next chunk is in flight. Chunks travel both ways
around the ring at once (half of the ``t - 1`` transfers each way, so each chunk makes at
most ``t / 2`` hops and both link directions carry data).

Both functions run per device, inside :func:`jax.shard_map` over ``axis_name``, and are
unrolled Python loops over a static axis size. Between steps, an optimization barrier
ties the next step's operands to this step's results: XLA's dot merger would otherwise
fuse the independent chunk GEMMs back into one GEMM (which waits for every chunk and
undoes the overlap). The permute of a step never waits for that step's computation.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from jax import lax

__all__ = ["ring_gather", "ring_reduce_scatter", "ring_steps"]

AxisName = Hashable
Acc = TypeVar("Acc")


def ring_steps(t: int) -> tuple[int, int]:
    """(hops forward, hops backward) of a bidirectional ring of size ``t``: ``t // 2``
    chunks arrive from the previous devices and ``(t - 1) // 2`` from the next ones,
    ``t - 1`` transfers in all."""
    return t // 2, (t - 1) // 2


def _shift(x: Any, axis_name: AxisName, t: int, step: int) -> Any:
    """``x`` of device ``i`` moved to device ``i + step`` (mod ``t``)."""
    return lax.ppermute(x, axis_name, perm=[(i, (i + step) % t) for i in range(t)])


def ring_gather(x: Any, axis_name: AxisName, fn: Callable[[Acc, Any, Any], Acc],
                acc: Acc) -> Acc:
    """Folds ``fn`` over the ``t`` chunks of ``all_gather(x)`` without gathering them.

    Args:
      x: this device's chunk (a pytree of arrays; every device's has the same shape).
      axis_name: the mesh axis of size ``t``.
      fn: ``fn(acc, position, chunk) -> acc``, called once per chunk: first with this
        device's own chunk (``position = axis_index``), then with the chunks of devices
        ``i - 1, i + 1, i - 2, ...`` as they arrive (``position`` is a traced int32, the
        index of the device the chunk came from).
      acc: the initial accumulator (a pytree, e.g. an output buffer and a weight
        gradient).
    Returns:
      the final accumulator.
    """
    t = lax.axis_size(axis_name)
    idx = lax.axis_index(axis_name)
    hops_fwd, hops_bwd = ring_steps(t)
    recv_f = _shift(x, axis_name, t, 1) if hops_fwd else None
    recv_b = _shift(x, axis_name, t, -1) if hops_bwd else None
    acc = fn(acc, idx, x)  # overlaps with the first transfers
    for k in range(1, max(hops_fwd, hops_bwd) + 1):
        # The chunks that arrived, tied to what was computed so far (no dot merging).
        (cur_f, cur_b), acc = lax.optimization_barrier(((recv_f, recv_b), acc))
        recv_f = _shift(cur_f, axis_name, t, 1) if k < hops_fwd else None
        recv_b = _shift(cur_b, axis_name, t, -1) if k < hops_bwd else None
        if k <= hops_fwd:
            acc = fn(acc, (idx - k) % t, cur_f)
        if k <= hops_bwd:
            acc = fn(acc, (idx + k) % t, cur_b)
    return acc


def ring_reduce_scatter(operand: Any, axis_name: AxisName,
                        partial: Callable[[Any, Any], Any], *,
                        gather: tuple[Any, Callable[[Acc, Any, Any], Acc], Acc] | None = None,
                        ) -> Any:
    """This device's chunk of ``psum`` over ``axis_name`` of per-chunk partial results,
    with each partial computed while the previous one travels.

    Device ``i`` ends with ``sum over devices d of partial_d(operand_d, i)``. Partial sums
    travel both ways around the ring: the forward chain collects the contributions of
    devices ``i - t // 2 .. i - 1``, the backward chain those of ``i + 1 ..
    i + (t - 1) // 2``; the own contribution is added last.

    Args:
      operand: this device's operand of ``partial`` (a pytree; e.g. the full-sequence
        activations whose chunk ``position`` feeds the GEMM).
      axis_name: the mesh axis of size ``t``.
      partial: ``partial(operand, position) -> array``, this device's contribution to
        chunk ``position`` (a traced int32); every call returns the same shape and dtype.
      gather: optionally ``(x, fn, acc)``: a :func:`ring_gather` of ``x`` run in lockstep,
        its transfers of each step issued with this ring's and in flight during this
        ring's GEMMs (for a gather with little computation of its own, such as the
        re-gather of an input for a weight gradient).
    Returns:
      the reduced chunk of this device, or ``(chunk, acc)`` with ``gather``.
    """
    t = lax.axis_size(axis_name)
    idx = lax.axis_index(axis_name)
    hops_fwd, hops_bwd = ring_steps(t)
    recv_f = recv_b = None
    if gather is not None:
        x, fn, acc = gather
        g_f = _shift(x, axis_name, t, 1) if hops_fwd else None
        g_b = _shift(x, axis_name, t, -1) if hops_bwd else None
        acc = fn(acc, idx, x)
    for k in range(max(hops_fwd, hops_bwd)):
        parts = {}
        if k < hops_fwd:
            part = partial(operand, (idx + hops_fwd - k) % t)
            parts[1] = part if recv_f is None else recv_f + part
        if k < hops_bwd:
            part = partial(operand, (idx - hops_bwd + k) % t)
            parts[-1] = part if recv_b is None else recv_b + part
        if gather is not None:
            # The gathered chunks in flight during this step's GEMMs arrive before this
            # step's partial sums leave: two transfers XLA cannot combine into one that
            # would wait for the GEMMs.
            (cur_f, cur_b), parts = lax.optimization_barrier(((g_f, g_b), parts))
            g_f = _shift(cur_f, axis_name, t, 1) if k + 1 < hops_fwd else None
            g_b = _shift(cur_b, axis_name, t, -1) if k + 1 < hops_bwd else None
            if k < hops_fwd:
                acc = fn(acc, (idx - k - 1) % t, cur_f)
            if k < hops_bwd:
                acc = fn(acc, (idx + k + 1) % t, cur_b)
        if 1 in parts:
            recv_f = _shift(parts[1], axis_name, t, 1)
        if -1 in parts:
            recv_b = _shift(parts[-1], axis_name, t, -1)
        # The next partials wait for these (no dot merging); the transfers do not.
        operand, _ = lax.optimization_barrier((operand, parts))
    out = partial(operand, idx)
    for recv in (recv_f, recv_b):
        if recv is not None:
            out = out + recv
    return out if gather is None else (out, acc)
