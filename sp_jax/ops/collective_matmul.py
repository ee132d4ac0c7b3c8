"""Collective matmul: the column and row sequence-parallel linear rules as rings of
collective-permutes, each transfer overlapped with the GEMM of one sequence chunk, in the
forward and the backward pass (Megatron's ``tp_comm_overlap``; Wang et al. 2023).

Each rule is a pair ``fwd(x, kernel, bias, *static) -> (y, residuals)`` and
``bwd(*static, residuals, g) -> (dx, dkernel, dbias)`` with the same statics and
residuals as its plain counterpart in :mod:`sp_jax.ops.linear`, which turns them into
custom-VJP ops (plain or FSDP). The ring schedules are :mod:`sp_jax.ring`'s.
"""

from __future__ import annotations

import jax
from jax import lax

from sp_jax.ops.gemm import bgrad, bwd_cast, dot, dot_nt, wgrad
from sp_jax.ops.primitives import fresh_zeros
from sp_jax.ring import ring_gather, ring_reduce_scatter

__all__ = ["column_ring_bwd", "column_ring_fwd", "row_ring_bwd", "row_ring_fwd"]


def _chunk(x: jax.Array, position, size: int, dim: int) -> jax.Array:
    """Chunk ``position`` (traced) of ``x`` along ``dim``, ``size`` long."""
    return lax.dynamic_slice_in_dim(x, position * size, size, axis=dim)


def _put(buf: jax.Array, value: jax.Array, position, dim: int) -> jax.Array:
    """``buf`` with chunk ``position`` along ``dim`` replaced by ``value``."""
    return lax.dynamic_update_slice_in_dim(buf, value, position * value.shape[dim], axis=dim)


def _buffer(shape, dtype, tie: jax.Array) -> jax.Array:
    """A buffer to assemble chunks in, made from ``tie`` (:func:`fresh_zeros`): a
    ``jnp.zeros`` constant is shared by every layer and kept alive across them, a fixed
    ``[b, s, h]`` and ``[b, s, mlp_hidden / t]`` on top of the plain path (measured: +80
    MiB at 4 layers, s=8192; a barrier with ``tie`` did not prevent the sharing)."""
    return fresh_zeros(shape, dtype, tie)


def _csp_ring_fwd(x, kernel, bias, axis_name, seq_dim, recompute, wgrad_dtype, param_dtype):
    t, n = lax.axis_size(axis_name), x.shape[seq_dim]
    kernel_c = kernel.astype(x.dtype)
    full = list(x.shape)
    full[seq_dim] = n * t
    out = list(full)
    out[-1] = kernel.shape[1]

    def fn(acc, position, x_chunk):
        y, x_full = acc
        y = _put(y, dot(x_chunk, kernel_c), position, seq_dim)
        if x_full is not None:  # save mode keeps the gathered input for backward
            x_full = _put(x_full, x_chunk, position, seq_dim)
        return y, x_full

    with jax.named_scope("sp_cm_column"):
        init = (_buffer(out, x.dtype, x), None if recompute else _buffer(full, x.dtype, x))
        y, x_full = ring_gather(x, axis_name, fn, init)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y, (x if recompute else x_full, kernel, bias)


def _csp_ring_bwd(axis_name, seq_dim, recompute, wgrad_dtype, param_dtype, res, dy):
    x, kernel, bias = res
    t = lax.axis_size(axis_name)
    n = dy.shape[seq_dim] // t
    kernel_c = bwd_cast(kernel, dy)

    def partial_dx(dy, position):
        return dot_nt(_chunk(dy, position, n, seq_dim), kernel_c)

    with jax.named_scope("sp_cm_column_bwd"):
        if recompute:
            # The input's chunks travel the ring again, in lockstep with the dx ring, so
            # that each transfer runs during a dx GEMM; tied to dy, so that CSE cannot
            # reuse the forward ring's transfers (which would keep every received chunk
            # alive from forward to backward).
            x, _ = lax.optimization_barrier((x, dy))
            full = list(x.shape)
            full[seq_dim] *= t
            dx, x = ring_reduce_scatter(
                dy, axis_name, partial_dx,
                gather=(x, lambda buf, position, chunk: _put(buf, chunk, position, seq_dim),
                        _buffer(full, x.dtype, x)))
        else:
            dx = ring_reduce_scatter(dy, axis_name, partial_dx)
        dkernel = wgrad(x, dy, wgrad_dtype, param_dtype)
    dbias = None if bias is None else bgrad(dy, wgrad_dtype, bias.dtype)
    return lax.optimization_barrier((dx, dkernel, dbias))


def _rsp_ring_fwd(x, kernel, bias, axis_name, seq_dim, wgrad_dtype, param_dtype):
    n = x.shape[seq_dim] // lax.axis_size(axis_name)
    kernel_c = kernel.astype(x.dtype)
    with jax.named_scope("sp_cm_row"):
        y = ring_reduce_scatter(x, axis_name,
                                lambda x, position: dot(_chunk(x, position, n, seq_dim),
                                                        kernel_c))
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y, (x, kernel, bias)


def _rsp_ring_bwd(axis_name, seq_dim, wgrad_dtype, param_dtype, res, dy):
    x, kernel, bias = res
    kernel_c = bwd_cast(kernel, dy)

    def fn(carry, position, g):
        dx, dy_full = carry
        dx = _put(dx, dot_nt(g, kernel_c), position, seq_dim)
        return dx, _put(dy_full, g, position, seq_dim)

    with jax.named_scope("sp_cm_row_bwd"):
        # dy's chunks arrive one by one, each feeding its dx GEMM; they are also kept in
        # one buffer for the weight gradient, a single GEMM once all have arrived.
        full = list(dy.shape)
        full[seq_dim] = x.shape[seq_dim]
        dx, dy_full = ring_gather(dy, axis_name, fn, (_buffer(x.shape, dy.dtype, dy),
                                                      _buffer(full, dy.dtype, dy)))
        dkernel = wgrad(x, dy_full, wgrad_dtype, param_dtype)
    dbias = None if bias is None else bgrad(dy, wgrad_dtype, bias.dtype)
    return lax.optimization_barrier((dx.astype(x.dtype), dkernel, dbias))


# The rules under the names the dispatch of sp_jax.ops.linear uses.
column_ring_fwd, column_ring_bwd = _csp_ring_fwd, _csp_ring_bwd
row_ring_fwd, row_ring_bwd = _rsp_ring_fwd, _rsp_ring_bwd
