"""The linear rules in FP8: inputs and weights in e4m3, output gradients in e5m2, per-tensor
scales of whole-tensor amaxes, fp32 accumulation (:mod:`sp_jax.ops.fp8`), with the
collectives of their plain counterparts in :mod:`sp_jax.ops.linear` moving FP8 where
they gather:

==================================  ===================================================
rule                                what moves / is kept in FP8
==================================  ===================================================
column sequence-parallel            the input shard is quantised, then all-gathered
                                    (e4m3 bytes); the residual is the e4m3 shard
                                    (``recompute``, gathered again in e4m3) or the
                                    gathered e4m3 input
row sequence-parallel               the residual is the e4m3 input (or, with an
                                    activation, its input, quantised again in the
                                    backward); the backward all-gathers ``dy`` as e5m2
column / matmul (no sequence)       the residual is the e4m3 input
==================================  ===================================================

The collective-matmul forms run the same arithmetic over rings of FP8 chunks. Reductions
(the reduce-scatter of ``y`` and of ``dx``, the all-reduce of ``dx``) stay in the
compute dtype.

Every rule has the signature of the plain rules, ``fwd(x, kernel, aux, *static)`` /
``bwd(*static, (a, kernel, b), g)``, with ``aux = (bias, history)``: ``history`` is the
amax history ``[3, n]`` of delayed scaling (``None`` with current scaling), whose
cotangent is this step's amaxes (:func:`~sp_jax.ops.fp8.history_amax_cotangent`). The
static arguments hold an :class:`~sp_jax.ops.fp8.Fp8Spec` before ``wgrad_dtype,
param_dtype``. The kernel is kept as given and quantised again in the backward pass with
the forward's scale (the same bytes; no FP8 copy of every weight stays alive).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.ops.collective_matmul import _buffer, _chunk, _put
from sp_jax.ops.fp8 import (
    E4M3,
    FORMATS,
    GRAD,
    INPUT,
    KERNEL,
    Fp8Spec,
    gemm,
    history_amax_cotangent,
    local_amax,
    over_shards,
    quantize,
    scale_from_amax,
    whole_amax,
)
from sp_jax.ops.gemm import bgrad
from sp_jax.ops.primitives import all_gather, reduce_scatter, vary
from sp_jax.ring import ring_gather, ring_reduce_scatter

__all__ = ["FP8_RULES"]


def _quantized(x: jax.Array, role: int, history, spec: Fp8Spec):
    """``(q, scale, amax)`` of ``x`` in role ``role``. Current scaling (``history``
    None): ``scale`` from the whole tensor's amax, ``amax`` None. Delayed: ``scale`` from
    the largest amax of ``history``'s row ``role``, and ``amax`` this device's block's
    amax, to be recorded: the op ties it to its outputs (an optimization barrier, so the
    reduction over ``x`` runs while ``x`` is alive instead of keeping it until the end
    of the step, where the scalars' all-reduces are combined) and reduces it over the
    shards after that (:func:`_history_cotangent`)."""
    if history is None:
        amax, recorded = whole_amax(x, spec.amax_axes), None
    else:
        amax, recorded = jnp.max(history[role]), local_amax(x)
    scale = scale_from_amax(amax, FORMATS[role], spec.recipe.margin)
    return quantize(x, FORMATS[role], scale), scale, recorded


def _tied(y, *amaxes):
    """``(y, *amaxes)``, the recorded amaxes (delayed scaling) computed with ``y``."""
    if amaxes[0] is None:
        return (y, *amaxes)
    y, amaxes = lax.optimization_barrier((y, amaxes))
    return (y, *amaxes)


def _operands(x, kernel, aux, spec):
    """The forward's ``bias, history, (qx, sx, ax), (qw, sw, aw)``: ``aux`` unpacked and
    the input and kernel quantised (:func:`_quantized`)."""
    bias, history = aux
    return (bias, history, _quantized(x, INPUT, history, spec),
            _quantized(kernel, KERNEL, history, spec))


def _grad_operands(res, g, spec):
    """The backward's ``a, sa, qw, sw, qg, sg, bias, history, amaxes`` from the
    residuals ``res`` and the cotangent ``g``: ``g`` quantised to e5m2, tied with the
    saved input ``a`` and the kernel (so the kernel's quantisation, with the forward's
    scale, and any re-gather of ``a`` can be neither hoisted into the forward pass nor
    merged with it), and the forward's and ``g``'s recorded amaxes."""
    (a, sa), kernel, (bias, history, sw, ax, aw) = res
    qg, sg, ag = _quantized(g, GRAD, history, spec)
    a, kernel, qg = lax.optimization_barrier((a, kernel, qg))
    return a, sa, quantize(kernel, E4M3, sw), sw, qg, sg, bias, history, (ax, aw, ag)


def _wgrad(qa, a_scale, qg, g_scale, wgrad_dtype, param_dtype):
    """``sum over leading dims of a^T g`` of two FP8 tensors, accumulated in fp32 (or a
    wider ``wgrad_dtype``), in ``param_dtype``."""
    lead = tuple(range(qa.ndim - 1))
    acc = jnp.promote_types(jnp.float32, wgrad_dtype or jnp.float32)
    return gemm(qa, a_scale, qg, g_scale, (lead, lead), acc).astype(param_dtype)


def _forward_gemm(q, scale, qw, w_scale, out_dtype):
    return gemm(q, scale, qw, w_scale, ((q.ndim - 1,), (0,)), out_dtype)


def _backward_gemm(qg, g_scale, qw, w_scale, out_dtype):
    return gemm(qg, g_scale, qw, w_scale, ((qg.ndim - 1,), (1,)), out_dtype)


def _released(dx, dkernel, dbias, history, amaxes, spec):
    """``(dx, dkernel, (dbias, dhistory))``: the gradients released together (an
    optimization barrier, as the plain rules do, which also holds the recorded amaxes,
    see :func:`_quantized`), and the history's cotangent, this step's amaxes, reduced
    over the shards after the barrier (which types its outputs as varying; the amaxes
    are the same on every device once reduced)."""
    if history is None:
        dx, dkernel, dbias = lax.optimization_barrier((dx, dkernel, dbias))
        return dx, dkernel, (dbias, None)
    dx, dkernel, dbias, amaxes = lax.optimization_barrier((dx, dkernel, dbias, amaxes))
    return dx, dkernel, (dbias, _history_cotangent(history, amaxes, spec))


def _history_cotangent(history, amaxes, spec):
    if history is None:
        return None
    return history_amax_cotangent(history, [over_shards(a, spec.amax_axes) for a in amaxes])


def _add_bias(y, bias):
    return y if bias is None else y + bias.astype(y.dtype)


# --------------------------------------------------------------------------------------
# matmul (local) and column (identity into the tensor region, all-reduce of dx)
# --------------------------------------------------------------------------------------


def _matmul_fwd(x, kernel, aux, spec, wgrad_dtype, param_dtype):
    bias, history, (qx, sx, ax), (qw, sw, aw) = _operands(x, kernel, aux, spec)
    y, ax, aw = _tied(_add_bias(_forward_gemm(qx, sx, qw, sw, x.dtype), bias), ax, aw)
    return y, ((qx, sx), kernel, (bias, history, sw, ax, aw))


def _matmul_bwd(spec, wgrad_dtype, param_dtype, res, g, axis_name=None):
    qx, sx, qw, sw, qg, sg, bias, history, amaxes = _grad_operands(res, g, spec)
    dx = _backward_gemm(qg, sg, qw, sw, g.dtype)
    dbias = None if bias is None else bgrad(g, wgrad_dtype, bias.dtype)
    if axis_name is None:
        dkernel = _wgrad(qx, sx, qg, sg, wgrad_dtype, param_dtype)
        return _released(dx, dkernel, dbias, history, amaxes, spec)
    # the column form: dW after dx, while dx is all-reduced (as the plain rule)
    qx, qg, _, amaxes = lax.optimization_barrier((qx, qg, dx, amaxes))
    with jax.named_scope("tp_dx_all_reduce"):
        dx = lax.psum(dx, axis_name)
    dkernel = _wgrad(qx, sx, qg, sg, wgrad_dtype, param_dtype)
    return dx, dkernel, (dbias, _history_cotangent(history, amaxes, spec))


def _cp_fwd(x, kernel, aux, axis_name, spec, wgrad_dtype, param_dtype):
    return _matmul_fwd(vary(x, (axis_name,)), kernel, aux, spec, wgrad_dtype, param_dtype)


def _cp_bwd(axis_name, spec, wgrad_dtype, param_dtype, res, g):
    return _matmul_bwd(spec, wgrad_dtype, param_dtype, res, g, axis_name)


# --------------------------------------------------------------------------------------
# column sequence-parallel: FP8 all-gather of the input
# --------------------------------------------------------------------------------------


def _csp_fwd(x, kernel, aux, axis_name, seq_dim, recompute, spec, wgrad_dtype, param_dtype):
    bias, history, (qx, sx, ax), (qw, sw, aw) = _operands(x, kernel, aux, spec)
    with jax.named_scope("sp_fp8_all_gather"):
        qx_full = all_gather(qx, axis_name, seq_dim)
    y, ax, aw = _tied(_add_bias(_forward_gemm(qx_full, sx, qw, sw, x.dtype), bias), ax, aw)
    return y, ((qx if recompute else qx_full, sx), kernel, (bias, history, sw, ax, aw))


def _csp_bwd(axis_name, seq_dim, recompute, spec, wgrad_dtype, param_dtype, res, dy):
    qx, sx, qw, sw, qg, sg, bias, history, amaxes = _grad_operands(res, dy, spec)
    if recompute:
        with jax.named_scope("sp_fp8_regather"):
            qx = all_gather(qx, axis_name, seq_dim)
    dx = _backward_gemm(qg, sg, qw, sw, dy.dtype)
    with jax.named_scope("sp_dx_reduce_scatter"):
        dx = reduce_scatter(dx, axis_name, seq_dim)
    dkernel = _wgrad(qx, sx, qg, sg, wgrad_dtype, param_dtype)
    dbias = None if bias is None else bgrad(dy, wgrad_dtype, bias.dtype)
    return _released(dx, dkernel, dbias, history, amaxes, spec)


def _csp_ring_fwd(x, kernel, aux, axis_name, seq_dim, recompute, spec, wgrad_dtype,
                  param_dtype):
    bias, history, (qx, sx, ax), (qw, sw, aw) = _operands(x, kernel, aux, spec)
    t = lax.axis_size(axis_name)
    full = list(x.shape)
    full[seq_dim] *= t
    out = [*full[:-1], kernel.shape[1]]

    def fn(acc, position, chunk):
        y, qx_full = acc
        y = _put(y, _forward_gemm(chunk, sx, qw, sw, x.dtype), position, seq_dim)
        if qx_full is not None:
            qx_full = _put(qx_full, chunk, position, seq_dim)
        return y, qx_full

    with jax.named_scope("sp_cm_column_fp8"):
        init = (_buffer(out, x.dtype, x), None if recompute else _buffer(full, qx.dtype, x))
        y, qx_full = ring_gather(qx, axis_name, fn, init)
    y, ax, aw = _tied(_add_bias(y, bias), ax, aw)
    return y, ((qx if recompute else qx_full, sx), kernel, (bias, history, sw, ax, aw))


def _csp_ring_bwd(axis_name, seq_dim, recompute, spec, wgrad_dtype, param_dtype, res, dy):
    qx, sx, qw, sw, qg, sg, bias, history, amaxes = _grad_operands(res, dy, spec)
    t = lax.axis_size(axis_name)
    n = dy.shape[seq_dim] // t

    def partial_dx(g, position):
        return _backward_gemm(_chunk(g, position, n, seq_dim), sg, qw, sw, dy.dtype)

    with jax.named_scope("sp_cm_column_fp8_bwd"):
        if recompute:
            full = list(qx.shape)
            full[seq_dim] *= t
            dx, qx = ring_reduce_scatter(
                qg, axis_name, partial_dx,
                gather=(qx, lambda buf, position, chunk: _put(buf, chunk, position, seq_dim),
                        _buffer(full, qx.dtype, dy)))
        else:
            dx = ring_reduce_scatter(qg, axis_name, partial_dx)
        dkernel = _wgrad(qx, sx, qg, sg, wgrad_dtype, param_dtype)
    dbias = None if bias is None else bgrad(dy, wgrad_dtype, bias.dtype)
    return _released(dx, dkernel, dbias, history, amaxes, spec)


# --------------------------------------------------------------------------------------
# row sequence-parallel (optionally after an activation): FP8 all-gather of dy
# --------------------------------------------------------------------------------------


def _rsp_residual(x, qh, sh, kernel, bias, history, sw, ah, aw, activation):
    # with an activation the residual is its input, quantised again in the backward
    return (qh if activation is None else x, sh), kernel, (bias, history, sw, ah, aw)


def _rsp_backward_input(a, sh, activation):
    """(the e4m3 input of the GEMM, the activation's VJP or None) in the backward."""
    if activation is None:
        return a, None
    h, activation_vjp = jax.vjp(activation, a)
    return quantize(h, E4M3, sh), activation_vjp


def _rsp_fwd(x, kernel, aux, activation, axis_name, seq_dim, spec, wgrad_dtype,
             param_dtype):
    h = x if activation is None else activation(x)
    bias, history, (qh, sh, ah), (qw, sw, aw) = _operands(h, kernel, aux, spec)
    y = reduce_scatter(_forward_gemm(qh, sh, qw, sw, x.dtype), axis_name, seq_dim)
    y, ah, aw = _tied(_add_bias(y, bias), ah, aw)
    return y, _rsp_residual(x, qh, sh, kernel, bias, history, sw, ah, aw, activation)


def _rsp_bwd(activation, axis_name, seq_dim, spec, wgrad_dtype, param_dtype, res, dy):
    a, sh, qw, sw, qg, sg, bias, history, amaxes = _grad_operands(res, dy, spec)
    with jax.named_scope("sp_fp8_dy_all_gather"):
        qg_full = all_gather(qg, axis_name, seq_dim)
    qh, activation_vjp = _rsp_backward_input(a, sh, activation)
    dh = _backward_gemm(qg_full, sg, qw, sw, dy.dtype)
    dkernel = _wgrad(qh, sh, qg_full, sg, wgrad_dtype, param_dtype)
    dx = dh if activation_vjp is None else activation_vjp(dh)[0]
    dbias = None if bias is None else bgrad(dy, wgrad_dtype, bias.dtype)
    return _released(dx, dkernel, dbias, history, amaxes, spec)


def _rsp_ring_fwd(x, kernel, aux, activation, axis_name, seq_dim, spec, wgrad_dtype,
                  param_dtype):
    h = x if activation is None else activation(x)
    bias, history, (qh, sh, ah), (qw, sw, aw) = _operands(h, kernel, aux, spec)
    n = qh.shape[seq_dim] // lax.axis_size(axis_name)
    with jax.named_scope("sp_cm_row_fp8"):
        y = ring_reduce_scatter(
            qh, axis_name,
            lambda q, position: _forward_gemm(_chunk(q, position, n, seq_dim), sh, qw, sw,
                                              x.dtype))
    y, ah, aw = _tied(_add_bias(y, bias), ah, aw)
    return y, _rsp_residual(x, qh, sh, kernel, bias, history, sw, ah, aw, activation)


def _rsp_ring_bwd(activation, axis_name, seq_dim, spec, wgrad_dtype, param_dtype, res, dy):
    a, sh, qw, sw, qg, sg, bias, history, amaxes = _grad_operands(res, dy, spec)
    qh, activation_vjp = _rsp_backward_input(a, sh, activation)

    def fn(carry, position, chunk):
        dh, qg_full = carry
        dh = _put(dh, _backward_gemm(chunk, sg, qw, sw, dy.dtype), position, seq_dim)
        return dh, _put(qg_full, chunk, position, seq_dim)

    with jax.named_scope("sp_cm_row_fp8_bwd"):
        full = list(dy.shape)
        full[seq_dim] = qh.shape[seq_dim]
        dh_shape = (*qh.shape[:-1], qw.shape[0])
        dh, qg_full = ring_gather(qg, axis_name, fn, (_buffer(dh_shape, dy.dtype, dy),
                                                      _buffer(full, qg.dtype, dy)))
        dkernel = _wgrad(qh, sh, qg_full, sg, wgrad_dtype, param_dtype)
    dx = dh if activation_vjp is None else activation_vjp(dh)[0]
    dbias = None if bias is None else bgrad(dy, wgrad_dtype, bias.dtype)
    return _released(dx, dkernel, dbias, history, amaxes, spec)


FP8_RULES = {
    # (op, collective matmul): (forward rule, backward rule), as sp_jax.ops.linear's
    ("matmul_fp8", False): (_matmul_fwd, _matmul_bwd),
    ("column_fp8", False): (_cp_fwd, _cp_bwd),
    ("column_sequence_fp8", False): (_csp_fwd, _csp_bwd),
    ("column_sequence_fp8", True): (_csp_ring_fwd, _csp_ring_bwd),
    ("row_sequence_fp8", False): (_rsp_fwd, _rsp_bwd),
    ("row_sequence_fp8", True): (_rsp_ring_fwd, _rsp_ring_bwd),
}
"""The FP8 rules under the keys of :data:`sp_jax.ops.linear._RULES`; the row rules take
``activation`` (or ``None``) as their first static argument."""
