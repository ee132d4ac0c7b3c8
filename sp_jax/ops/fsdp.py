"""Parameters sharded over the data axes (ZeRO-3 / FSDP): the gather of a parameter paired
with the reduce-scatter of its gradient, and the FSDP form of any linear rule
(:func:`fsdp_linear_op`).

A weight sharded over the data axes is all-gathered inside the op that uses it, just
before use, and gathered again in that op's backward pass instead of being kept: the
residual is the local shard. (A ``jax.checkpoint`` policy cannot do this: its names are
invisible through a custom VJP's residuals.) The weight gradient is reduce-scattered over
the data axes, so it comes out sharded like the parameter and no full-size all-reduce
exists. :class:`Fsdp` is that form as a rule, its backward in an input-gradient and a
weight-gradient part like every rule's; the weight-gradient part ends with the
reduce-scatter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.ops.lora import is_lora
from sp_jax.ops.primitives import AxisName, canonical_dim, conjugate_pair, vary, vma
from sp_jax.ops.quant import QuantizedKernel
from sp_jax.ops.rules import RuleWrapper, linear_op

__all__ = ["Fsdp", "fsdp_gather", "fsdp_linear_op", "full_kernel"]


def _fsdp_all_gather(w: jax.Array, axes: tuple, dim: int) -> jax.Array:
    with jax.named_scope("fsdp_gather"):
        return lax.all_gather(vary(w, axes), axes, axis=dim, tiled=True)


def _fsdp_reduce_scatter(g: jax.Array, axes: tuple, dim: int) -> jax.Array:
    with jax.named_scope("fsdp_wgrad_reduce_scatter"):
        return lax.psum_scatter(vary(g, axes), axes, scatter_dimension=dim, tiled=True)


_fsdp_pair = conjugate_pair(_fsdp_all_gather, _fsdp_reduce_scatter)


def _gather_in(kernel: jax.Array, dtype, axes: tuple, dim: int) -> jax.Array:
    """The whole kernel in the compute ``dtype`` where that is narrower than its own: the
    shard is cast before the gather, so a gather moves bf16, not the fp32 master weights
    (XLA moves such a cast across the forward gather by itself, but not across the
    backward's, which an optimization barrier holds)."""
    if jnp.dtype(dtype).itemsize < jnp.dtype(kernel.dtype).itemsize:
        kernel = kernel.astype(dtype)
    return _fsdp_all_gather(kernel, axes, dim)


def fsdp_gather(w: jax.Array, axes: tuple[AxisName, ...], dim: int) -> jax.Array:
    """The whole of a parameter sharded over the data ``axes`` along ``dim``, for uses
    whose backward does not need the parameter (an embedding lookup); the matmul ops
    take ``fsdp_axes`` instead and gather inside their own VJP.

    Forward: all-gather over ``axes`` (tiled, in the order of ``axes``, as
    ``P(..., axes, ...)`` lays the shards out). Backward: reduce-scatter of the gradient
    over ``axes``: the per-device partial gradients (each from its own batch shard) are
    summed and every device keeps its own shard, so the gradient comes out sharded like
    the parameter and no full-size all-reduce exists. No-op with empty ``axes``.
    """
    axes = tuple(axes)
    if not axes:
        return w
    return _fsdp_pair(w, axes, canonical_dim(dim, w.ndim, "dim"))


@dataclasses.dataclass(frozen=True)
class Fsdp(RuleWrapper):
    """The FSDP form of a linear ``rule`` (:mod:`sp_jax.ops.rules`), its kernel this
    device's shard over the data ``axes`` along ``dim``: itself a rule (``fwd``,
    ``bwd``, ``bwd_input``, ``bwd_weight``), run by :func:`fsdp_linear_op`.

    Forward: the kernel is all-gathered over ``axes`` (in the compute dtype) just
    before the op and dropped after it: the residual is the local shard. Input-gradient
    part: the shard is gathered again, in the compute dtype (behind a barrier with the
    incoming cotangent, so no CSE merges it with the forward gather and it is not issued
    before the backward reaches this layer), and the rule's input-gradient part runs.
    Weight-gradient part: the rule's, then the weight gradient, in the parameter's dtype
    (the rule's GEMM's ``param_dtype``), is reduce-scattered over ``axes``."""

    rule: Any
    axes: tuple[AxisName, ...]
    dim: int

    def _gather(self, kernel, dtype):
        """The whole kernel; of an adapted one (:class:`~sp_jax.ops.lora.LoRAKernel`),
        the base gathered and the adapters (not sharded over the data axes) as they
        are."""
        if is_lora(kernel):
            if isinstance(kernel.w, QuantizedKernel):  # every array of it along dim
                return kernel._replace(w=jax.tree.map(
                    lambda v: _fsdp_all_gather(v, self.axes, self.dim), kernel.w))
            return kernel._replace(w=_gather_in(kernel.w, dtype, self.axes, self.dim))
        return _gather_in(kernel, dtype, self.axes, self.dim)

    def fwd(self, x, kernel, aux):
        y, (a, _, rest) = self.rule.fwd(x, self._gather(kernel, x.dtype), aux)
        return y, (a, kernel, rest)

    def _gathered(self, res, g):
        a, kernel, rest = res
        kernel, g = lax.optimization_barrier((kernel, g))
        return (a, self._gather(kernel, g.dtype), rest), g

    def _scatter(self, dkernel):
        if is_lora(dkernel):  # the frozen base has no gradient; the adapters' are summed
            return dkernel      # over the data axes by the cast to vary (rules.Varying)
        return _fsdp_reduce_scatter(dkernel, self.axes, self.dim)

    def bwd_input(self, res, g):
        return self.rule.bwd_input(*self._gathered(res, g))

    def bwd_weight(self, w):
        dkernel, daux = self.rule.bwd_weight(w)
        return self._scatter(dkernel), daux

    def bwd(self, res, g):
        dx, dkernel, daux = self.rule.bwd(*self._gathered(res, g))
        # The weight gradient leaves this op reduce-scattered: dx is released with the
        # shard, so each full-size gradient is freed in this op's backward instead of
        # waiting for a reduce-scatter XLA would otherwise start at the end. A dx that
        # varies over fewer axes (the column form's, all-reduced over the tensor axis)
        # only holds the shard back: a barrier types its outputs as varying over the
        # union of its operands' axes.
        dkernel = self._scatter(dkernel)
        if vma(dx) == vma(dkernel):
            dx, dkernel = lax.optimization_barrier((dx, dkernel))
        else:
            dkernel, _ = lax.optimization_barrier((dkernel, dx))
        return dx, dkernel, daux


def fsdp_linear_op(x: jax.Array, kernel: jax.Array, aux: Any, rule: Any,
                   axes: tuple[AxisName, ...], dim: int) -> jax.Array:
    """The FSDP form of the linear ``rule`` (:mod:`sp_jax.ops.rules`; any object with
    ``fwd(x, kernel, aux) -> (y, (a, kernel, rest))`` and ``bwd(res, g) -> (dx,
    dkernel, daux)``), ``kernel`` this device's shard over the data ``axes`` along
    ``dim``: :class:`Fsdp`'s forward and fused backward as one custom-VJP op
    (:func:`~sp_jax.ops.rules.linear_op` of ``Fsdp(rule, axes, dim)``, what the public
    ops run with ``fsdp_axes``)."""
    return linear_op(x, kernel, aux, Fsdp(rule, axes, dim))


def full_kernel(kernel: jax.Array, axes: tuple, dim: int) -> jax.ShapeDtypeStruct:
    """The shape the kernel has after the FSDP gather over ``axes`` (for shape checks)."""
    shape = list(kernel.shape)
    for a in axes:
        shape[dim] *= lax.axis_size(a)
    return jax.ShapeDtypeStruct(tuple(shape), kernel.dtype)
