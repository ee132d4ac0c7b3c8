"""Grouped GEMMs whose work grows with the routed rows: :func:`grouped_matmul`, the
semantics of :func:`jax.lax.ragged_dot` in pure XLA.

XLA (jax 0.10.2) lowers ``ragged_dot`` on CPU and GPU as a dense product over every
group with the other groups' rows masked: ``groups`` times the FLOPs, and on GPU a
``[groups, rows, n]`` buffer. :func:`grouped_matmul` pads each group, conceptually, to a
multiple of ``tile`` rows and runs one ``[tile, k] @ [k, n]`` GEMM per tile against its
group's weights in a ``lax.while_loop`` over the *dynamic* number of tiles
``sum(ceil(group_sizes / tile))``: the work is that of the routed rows (plus at most one
partial tile per group), never that of the static row count (the expert axis's receive
buffer holds ``ep`` times more rows than are routed) nor ``groups x rows``. Its backward
(a custom VJP: a ``while_loop`` is not reverse-differentiable) is one more loop over the
same tiles computing both ``dx = dy_t @ w[g]^T`` and ``dW[g] += x_t^T @ dy_t``
(:func:`grouped_backward`; with ``weight=False`` ``dx`` alone, the weight gradient then a
loop of its own, :func:`grouped_wgrad`: the experts' GEMMs as a linear rule,
:class:`sp_jax.ops.rules.Grouped`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.ops.primitives import fresh_zeros, vary, vma

__all__ = ["CPU_TILE", "GPU_TILE", "grouped_backward", "grouped_forward", "grouped_matmul",
           "grouped_matmul_tiles", "grouped_wgrad"]

CPU_TILE = 128
"""The default tile (rows per GEMM) on XLA:CPU (``benchmarks/grouped_gemm.py``, BENCHMARKS.md:
of 16, 32, 64 and 128, 128 the fastest alone and in the 8-expert layer, 64 and 128 equal in
the 64-expert one)."""
GPU_TILE = 128
"""The default tile on GPUs and TPUs (a multiple of the tensor cores' 64-row tiles)."""


def grouped_matmul_tiles(group_sizes: jax.Array, tile: int, rows: int | None = None
                         ) -> jax.Array:
    """The number of ``tile``-row GEMMs :func:`grouped_matmul` runs for ``group_sizes``
    (``sum(ceil(group_sizes / tile))``), counted by running its loop over the tiles with a
    counter for a body: an int32 scalar. ``rows``: the static row count of ``x`` (None:
    ``tile * groups``; it sizes the tile table, not the count)."""
    group_sizes = jnp.asarray(group_sizes)
    rows = tile * group_sizes.size if rows is None else rows
    return _tiles(lambda n, *_: n + 1, group_sizes, rows, tile,
                  vary(jnp.zeros((), jnp.int32), vma(group_sizes)))


def _tile_table(group_sizes, rows, tile):
    """``(count, group, start, valid)``: the dynamic number of tiles, and for each of the
    static upper bound ``rows // tile + segments`` tiles its group, first row and number
    of rows of its segment (the first ``count`` entries are used). ``group_sizes``
    ``[groups]``, or ``[blocks, groups]``: ``blocks x groups`` segments in row-major order,
    segment ``(b, g)`` of group ``g``."""
    groups = group_sizes.shape[-1]
    sizes = jnp.maximum(group_sizes.reshape(-1).astype(jnp.int32), 0)
    n = sizes.shape[0]
    per = (sizes + tile - 1) // tile
    tile_end = jnp.cumsum(per)
    row_end = jnp.cumsum(sizes)
    i = jnp.arange(rows // tile + n, dtype=jnp.int32)
    segment = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), n - 1).astype(jnp.int32)
    local = (i - (tile_end - per)[segment]) * tile
    start = (row_end - sizes)[segment] + local
    valid = jnp.minimum(sizes[segment] - local, tile)
    return tile_end[-1], segment % groups, start, valid


def _tiles(fn, group_sizes, rows, tile, init):
    """``lax.while_loop`` of ``fn(carry, group, at, mask)`` over the tiles: ``at`` the first
    row of the ``tile``-row slice (clamped into ``[0, rows - tile]``), ``mask`` ``[tile]``
    its rows that belong to the tile's group."""
    count, group, start, valid = _tile_table(group_sizes, rows, tile)
    offsets = jnp.arange(tile, dtype=jnp.int32)

    def body(carry):
        i, inner = carry
        s = start[i]
        at = jnp.minimum(s, rows - tile)
        mask = (offsets >= s - at) & (offsets < s - at + valid[i])
        return i + 1, fn(inner, group[i], at, mask)

    i0 = vary(jnp.zeros((), jnp.int32), vma(count))
    return lax.while_loop(lambda c: c[0] < count, body, (i0, init))[1]


def _accumulator(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _forward(x, w, group_sizes, tile, out_dtype):
    rows, n = x.shape[0], w.shape[2]
    acc = _accumulator(out_dtype)

    def step(out, g, at, mask):
        xt = lax.dynamic_slice_in_dim(x, at, tile)
        y = jnp.matmul(xt, lax.dynamic_index_in_dim(w, g, keepdims=False),
                       preferred_element_type=acc).astype(out_dtype)
        old = lax.dynamic_slice_in_dim(out, at, tile)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(mask[:, None], y, old), at, 0)

    return _tiles(step, group_sizes, rows, tile, fresh_zeros((rows, n), out_dtype, x))


def _tile_rows(a, at, tile, keep):
    """The ``tile`` rows of ``a`` from ``at``, those not of the tile's group zeroed."""
    return jnp.where(keep, lax.dynamic_slice_in_dim(a, at, tile), jnp.zeros((), a.dtype))


def _add_wgrad(dw, xt, dyt, g, acc):
    """``dw[g] += xt^T dyt`` (in ``acc``)."""
    dwg = lax.dynamic_index_in_dim(dw, g, keepdims=True)
    dwg = dwg + jnp.matmul(xt.T, dyt, preferred_element_type=acc)[None]
    return lax.dynamic_update_slice_in_dim(dw, dwg, g, 0)


def _backward(x, w, group_sizes, dy, tile, weight=True):
    """``(dx, dW)`` in one loop over the tiles, or with ``weight`` False ``dx`` alone
    (``x`` then gives only its shape and dtype)."""
    rows = x.shape[0]
    acc = _accumulator(jnp.result_type(x, w, dy))

    def step(carry, g, at, mask):
        dx, dw = carry
        keep = mask[:, None]
        xt = None if dw is None else _tile_rows(x, at, tile, keep)
        dyt = _tile_rows(dy, at, tile, keep)
        wg = lax.dynamic_index_in_dim(w, g, keepdims=False)  # [k, n]
        dxt = jnp.matmul(dyt, wg.T, preferred_element_type=acc).astype(dx.dtype)
        old = lax.dynamic_slice_in_dim(dx, at, tile)
        dx = lax.dynamic_update_slice_in_dim(dx, jnp.where(keep, dxt, old), at, 0)
        return dx, None if dw is None else _add_wgrad(dw, xt, dyt, g, acc)

    init = (fresh_zeros(x.shape, x.dtype, x), fresh_zeros(w.shape, acc, w) if weight else None)
    dx, dw = _tiles(step, group_sizes, rows, tile, init)
    return (dx, dw.astype(w.dtype)) if weight else dx


def _wgrad(x, dy, group_sizes, tile, groups):
    rows = x.shape[0]
    acc = _accumulator(jnp.result_type(x, dy))

    def step(dw, g, at, mask):
        keep = mask[:, None]
        return _add_wgrad(dw, _tile_rows(x, at, tile, keep), _tile_rows(dy, at, tile, keep),
                          g, acc)

    init = fresh_zeros((groups, x.shape[1], dy.shape[1]), acc, x)
    return _tiles(step, group_sizes, rows, tile, init)


def _per_platform(fn, tile, *args):
    """``fn(*args, tile=...)`` with ``tile``, or None: :data:`CPU_TILE` on XLA:CPU and
    :data:`GPU_TILE` elsewhere (chosen at lowering time)."""
    rows = args[0].shape[0]
    if tile is not None:
        return fn(*args, tile=min(tile, rows))
    return lax.platform_dependent(
        *args, cpu=functools.partial(fn, tile=min(CPU_TILE, rows)),
        default=functools.partial(fn, tile=min(GPU_TILE, rows)))


def grouped_forward(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                    tile: int | None, out_dtype) -> jax.Array:
    """:func:`grouped_matmul`'s product, not differentiated (its loop over the tiles;
    ``x`` and ``w`` typed alike, ``group_sizes`` int32)."""
    return _per_platform(functools.partial(_forward, out_dtype=out_dtype), tile, x, w,
                         group_sizes)


def grouped_backward(x: jax.Array, w: jax.Array, group_sizes: jax.Array, dy: jax.Array, *,
                     tile: int | None, weight: bool = True) -> Any:
    """:func:`grouped_matmul`'s backward, one loop over the tiles: ``(dx, dW)`` (``dW`` in
    ``w``'s dtype), or with ``weight`` False ``dx`` alone (the weight gradient then comes
    from :func:`grouped_wgrad`)."""
    return _per_platform(functools.partial(_backward, weight=weight), tile, x, w,
                         group_sizes, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x, w, group_sizes, tile, out_dtype):
    return grouped_forward(x, w, group_sizes, tile=tile, out_dtype=out_dtype)


def _grouped_fwd(x, w, group_sizes, tile, out_dtype):
    return _grouped(x, w, group_sizes, tile, out_dtype), (x, w, group_sizes)


def _grouped_bwd(tile, out_dtype, res, dy):
    x, w, group_sizes = res
    dx, dw = grouped_backward(x, w, group_sizes, dy, tile=tile)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   tile: int | None = None, preferred_element_type=None) -> jax.Array:
    """``x_g @ w[g]`` for the ``group_sizes[g]`` consecutive rows of each group ``g``
    (:func:`jax.lax.ragged_dot`'s semantics), one ``tile``-row GEMM per tile of a group's
    rows: the work grows with ``sum(group_sizes)``, not with ``x``'s static row count nor
    with the number of groups (:func:`grouped_matmul_tiles` GEMMs). Accumulates in fp32
    (or wider); differentiable in ``x`` and ``w`` (custom VJP: a loop over the same
    tiles for ``dx`` and ``dW``, ``dW`` accumulated in fp32 and returned in ``w``'s
    dtype). Works per device inside ``shard_map`` (inputs varying over manual axes).

    Args:
      x: ``[rows, k]``, rows sorted by group; rows past ``sum(group_sizes)`` belong to
        no group.
      w: ``[groups, k, n]``.
      group_sizes: int ``[groups]``, ``sum(group_sizes) <= rows``; or ``[blocks,
        groups]``: the rows in ``blocks`` consecutive blocks, each sorted by group
        (the expert axis's received rows, source-major: no regrouping copy).
      tile: rows per GEMM (clipped to ``rows``); None: :data:`CPU_TILE` on XLA:CPU,
        :data:`GPU_TILE` elsewhere.
      preferred_element_type: the result's dtype; None: ``x`` and ``w``'s promoted one.
    Returns:
      ``[rows, n]``; rows past ``sum(group_sizes)`` are zero.
    """
    group_sizes = jnp.asarray(group_sizes)
    if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim not in (1, 2):
        raise ValueError(f"grouped_matmul: x {x.shape} must be [rows, k], w {w.shape} "
                         f"[groups, k, n] and group_sizes {group_sizes.shape} [groups] or "
                         "[blocks, groups].")
    if x.shape[1] != w.shape[1] or w.shape[0] != group_sizes.shape[-1]:
        raise ValueError(f"grouped_matmul: x {x.shape}, w {w.shape} and group_sizes "
                         f"{group_sizes.shape} do not agree (x [rows, k], w [groups, k, n], "
                         "group_sizes [groups] or [blocks, groups]).")
    if tile is not None and tile < 1:
        raise ValueError(f"grouped_matmul: tile={tile} must be a positive number of rows.")
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(x, w))
    if x.shape[0] == 0 or w.shape[0] == 0:
        return jnp.zeros((x.shape[0], w.shape[2]), out_dtype)
    axes = vma(x) | vma(w) | vma(group_sizes)
    return _grouped(vary(x, axes), vary(w, axes), group_sizes.astype(jnp.int32), tile,
                    out_dtype)


def grouped_wgrad(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *,
                  tile: int | None = None) -> jax.Array:
    """``sum_r x_r^T dy_r`` over the rows ``r`` of each group (the weight gradient of
    :func:`grouped_matmul`, :func:`jax.lax.ragged_dot_general` with a ragged contracting
    dimension), one GEMM per tile of the routed rows, in fp32 (or wider); not itself
    differentiated.

    Args:
      x: ``[rows, k]``; dy: ``[rows, n]``, rows sorted by group (rows past
        ``sum(group_sizes)`` belong to no group).
      group_sizes: int ``[groups]`` or ``[blocks, groups]`` (:func:`grouped_matmul`).
      tile: as :func:`grouped_matmul`.
    Returns:
      ``[groups, k, n]``.
    """
    group_sizes = jnp.asarray(group_sizes)
    if (x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0]
            or group_sizes.ndim not in (1, 2)):
        raise ValueError(f"grouped_wgrad: x {x.shape} and dy {dy.shape} must be [rows, k] "
                         f"and [rows, n], group_sizes {group_sizes.shape} [groups] or "
                         "[blocks, groups].")
    groups = group_sizes.shape[-1]
    acc = _accumulator(jnp.result_type(x, dy))
    if x.shape[0] == 0 or groups == 0:
        return jnp.zeros((groups, x.shape[1], dy.shape[1]), acc)
    axes = vma(x) | vma(dy) | vma(group_sizes)
    return _per_platform(functools.partial(_wgrad, groups=groups), tile, vary(x, axes),
                         vary(dy, axes), group_sizes.astype(jnp.int32))
