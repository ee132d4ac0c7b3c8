"""The local GEMMs of the linear ops: compute-dtype products, weight and bias gradients
accumulated in ``wgrad_dtype``, the backward pass's barrier'd kernel cast, and
:class:`ComputeGemm`, the GEMM object of the linear rules in the compute dtype.

The weight gradient is computed straight from the low-precision operands into
``wgrad_dtype`` (``preferred_element_type``), the analog of Paddle's
``mp_fused_linear_param_grad_add`` / Megatron's ``gradient_accumulation_fusion``.

A *GEMM object* is what a linear rule (:mod:`sp_jax.ops.rules`) multiplies with, the way
``flax.nnx.Linear(dot_general=...)`` injects its product: :class:`ComputeGemm` here, and
:class:`sp_jax.ops.fp8.Fp8Gemm` in FP8, both a :class:`Gemm`. It is the op face of a
layer's precision: the ops take it as ``gemm=`` with its state (``gemm_state=``: the FP8
amax history of delayed scaling, else None) and bind the op's dtypes to it
(:meth:`Gemm.bound`); the layer face, the nnx module that holds the state, is
:class:`sp_jax.layers.gemm.LayerGemm`. GEMM objects are frozen dataclasses (static
arguments of the ops) with the same methods:

======================================  ==============================================
method                                  meaning
======================================  ==============================================
``bound(wgrad_dtype, param_dtype)``     the object with an op's dtypes
``init_state()`` /                      the state's initial value (None: stateless) /
``check_state(where, state)``           errors for a state the GEMM cannot take
``operands(x, kernel, state)``          the forward's operands ``(a, w, ctx)``: ``a`` the
                                        input as the GEMM takes it (the compute-dtype
                                        ``x``, or e4m3), ``w`` the kernel, ``ctx`` what
                                        the backward needs besides (``None``, or the
                                        scales and recorded amaxes)
``forward(a, w, ctx, dtype)``           ``a @ w`` in ``dtype``
``requantize(h, ctx)``                  a recomputed input (an activation) as ``a``
``recorded(ctx)`` /                     the values the op's barriers must hold with its
``with_recorded(ctx, values)``          outputs (delayed scaling's amaxes; ``None``)
``cotangent(a, kernel, ctx, g, tie)``   the backward's entry: ``g`` as the GEMM takes it,
                                        and the barrier that ties the residuals to it
``tie_input(a, g)``                     ``a`` tied to ``g`` where ``cotangent`` does not
``kernel_for(kernel, g, ctx, tie)``     the kernel for the backward GEMMs
``backward(g, w, ctx, dtype)``          ``g @ w.T``
``wgrad(a, g, ctx)``                    the weight gradient in the parameter's dtype
``bias_cotangent(gq, g)``               the cotangent the bias gradient sums
``state_cotangent(ctx)``                the cotangent of the op's state (amax history)
``grouped_operands(x, w, sizes,``       the grouped GEMM's (the experts'; ``sizes`` the
``state)``, ``grouped_forward(a, w,``   rows of each group): operands, forward, the
``sizes, ctx, dtype, tile)``,           backward's entry, dgrad, weight gradient and both
``grouped_cotangent(a, w, sizes, ctx,`` at once (:class:`~sp_jax.ops.rules.Grouped`;
``g)``, ``grouped_dgrad(a, g, w,``      ``tile``: rows per GEMM of the tile loops)
``sizes, ctx, dtype, tile)``,
``grouped_wgrad(a, g, sizes, ctx,``
``tile)``, ``grouped_backward(...)``
``wgrad_values(ctx)`` /                 the context's arrays the weight-gradient part
``wgrad_context(state, values)``        needs, and the context again from them and the
                                        op's state (a deferred weight gradient,
                                        :mod:`sp_jax.ops.deferred`)
======================================  ==============================================
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.ops import grouped

__all__ = ["ComputeGemm", "Gemm", "bgrad", "bwd_cast", "check_linear_shapes", "dot_nt",
           "wgrad"]


def wgrad(x: jax.Array, g: jax.Array, wgrad_dtype, param_dtype) -> jax.Array:
    """``sum over leading dims of x^T g`` -> ``[in, out]``, accumulated in ``wgrad_dtype``.

    With ``wgrad_dtype=None`` it reproduces plain autodiff: the product is rounded to the
    compute dtype and then cast to the parameter dtype.
    """
    acc = wgrad_dtype if wgrad_dtype is not None else jnp.result_type(x, g)
    lead = tuple(range(x.ndim - 1))
    dw = lax.dot_general(x, g, ((lead, lead), ((), ())), preferred_element_type=acc)
    return dw.astype(param_dtype)


def bgrad(g: jax.Array, wgrad_dtype, param_dtype) -> jax.Array:
    """``sum over leading dims of g`` -> ``[out]``, accumulated in ``wgrad_dtype``."""
    acc = wgrad_dtype if wgrad_dtype is not None else g.dtype
    return jnp.sum(g, axis=tuple(range(g.ndim - 1)), dtype=acc).astype(param_dtype)


def dot_nt(g: jax.Array, kernel: jax.Array) -> jax.Array:
    """``g [..., out] @ kernel.T`` -> ``[..., in]``, ``kernel`` already in the dtype
    wanted."""
    return lax.dot_general(g, kernel, (((g.ndim - 1,), (1,)), ((), ())))


def bwd_cast(kernel: jax.Array, g: jax.Array) -> jax.Array:
    """``kernel`` in the dtype of the cotangent ``g``, cast anew in the backward pass.

    The cast follows an optimization barrier that ties the kernel to ``g``: otherwise
    XLA's CSE merges it with the forward pass's cast and keeps a low-precision copy of
    every weight alive from forward to backward (48 MiB per layer at h=4096, t=8, fp32
    parameters with bf16 compute).
    """
    if kernel.dtype == g.dtype:
        return kernel
    kernel, _ = lax.optimization_barrier((kernel, g))
    return kernel.astype(g.dtype)


def check_linear_shapes(name: str, x: jax.Array, kernel, bias=None) -> None:
    """ValueErrors naming ``name`` unless ``x [..., in]``, ``kernel [in, out]`` and
    ``bias [out]`` (or None) fit together."""
    if kernel.ndim != 2:
        raise ValueError(f"{name}: kernel must be [in, out], got shape {kernel.shape}.")
    if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(
            f"{name}: the last dimension of x {x.shape} must equal the kernel's input "
            f"dimension {kernel.shape[0]} (kernel shape {kernel.shape})."
        )
    if bias is not None and bias.shape != (kernel.shape[1],):
        raise ValueError(
            f"{name}: bias must have shape ({kernel.shape[1]},), got {bias.shape}."
        )


class Gemm:
    """What every GEMM object shares: the op's dtypes bound to it, and a state check."""

    wgrad_dtype: Any
    param_dtype: Any

    def bound(self, wgrad_dtype, param_dtype) -> Gemm:
        """This GEMM with an op's weight-gradient accumulation dtype (None: as plain
        autodiff) and its kernel's own dtype (that of the kernel's gradient)."""
        return dataclasses.replace(
            self, wgrad_dtype=None if wgrad_dtype is None else jnp.dtype(wgrad_dtype),
            param_dtype=jnp.dtype(param_dtype))

    def init_state(self):
        """The initial value of the op's state (None: the GEMM has none)."""
        return None

    def check_state(self, where: str, state) -> None:
        """A ValueError naming ``where`` for a state this GEMM does not take."""
        if state is not None:
            raise ValueError(f"{where}: gemm_state is given, but {type(self).__name__} "
                             "takes none; pass gemm_state=None.")


@dataclasses.dataclass(frozen=True)
class ComputeGemm(Gemm):
    """The GEMM of the linear rules in the compute dtype (the dtype of the input).

    Attributes:
      wgrad_dtype: accumulation dtype of the weight and bias gradients (``None``: as
        plain autodiff).
      param_dtype: the kernel's own dtype, that of its gradient (the FSDP form hands the
        rule a kernel gathered in the compute dtype); None until an op binds it
        (:meth:`Gemm.bound`).
    """

    wgrad_dtype: Any = None
    param_dtype: Any = None
    tag = ""
    """The tag of the ops' HLO scope names (``""``: the plain names)."""
    ties_local_release = False
    """A local matmul's gradients leave without a barrier (nothing to overlap)."""
    releases_input_grad = False
    """A row op's release barrier holds the GEMM's dx; a fused activation's backward
    follows it."""

    def operands(self, x, kernel, state):
        return x, kernel.astype(x.dtype), None

    def forward(self, a, w, ctx, dtype):
        return lax.dot_general(a, w, (((a.ndim - 1,), (0,)), ((), ())))

    def requantize(self, h, ctx):
        return h

    def recorded(self, ctx):
        return None

    def with_recorded(self, ctx, values):
        return ctx

    def cotangent(self, a, kernel, ctx, g, tie_input: bool):
        """``(a, kernel, g, ctx)``; with ``tie_input``, ``a`` (and the kernel, cast after
        it, when it is not in the compute dtype) tied to ``g`` by one barrier: a re-gather
        of ``a`` then cannot be hoisted into the forward pass or merged (CSE) with the
        forward gather, which would keep the full input alive and silently undo the
        memory saving; the re-gather and the dx GEMM become ready together and the gather
        runs during the GEMM. A kernel already in the compute dtype has no cast to tie
        (bf16 parameters; the FSDP form's kernel, gathered anew in this backward): it is
        not held back, so the weight gather of the FSDP form runs during the
        weight-gradient GEMM."""
        if not tie_input:
            return a, kernel, g, ctx
        if kernel.dtype == g.dtype:
            a, g = lax.optimization_barrier((a, g))
        else:
            a, kernel, g = lax.optimization_barrier((a, kernel, g))
        return a, kernel.astype(g.dtype), g, ctx

    def tie_input(self, a, g):
        """``(a, g)`` tied by a barrier: a recomputation from ``a`` (a re-gather, an
        activation) can be neither hoisted into the forward pass nor merged (CSE) with the
        forward one, which would keep its result alive until here."""
        return lax.optimization_barrier((a, g))

    def kernel_for(self, kernel, g, ctx, tie: bool = True):
        """The kernel in the dtype of ``g``: cast behind a barrier with ``g``
        (:func:`bwd_cast`), or, without ``tie``, cast where it is used."""
        return bwd_cast(kernel, g) if tie else kernel.astype(g.dtype)

    def backward(self, g, w, ctx, dtype):
        return dot_nt(g, w)

    def wgrad(self, a, g, ctx):
        return wgrad(a, g, self.wgrad_dtype, self.param_dtype)

    def bias_cotangent(self, gq, g):
        return gq

    def state_cotangent(self, ctx):
        return None

    def wgrad_values(self, ctx):
        return None

    # The grouped GEMMs (the experts'): the tile loops of sp_jax.ops.grouped, in the
    # compute dtype with fp32 accumulation (the kernel comes cast to it).

    def grouped_kernel(self, w, dtype):
        """The experts' kernel as the grouped op takes it: cast to the compute dtype
        before the op (its gradient is cast back by the cast's own VJP)."""
        return w.astype(dtype)

    def grouped_operands(self, x, w, sizes, state):
        return x, w, None

    def grouped_forward(self, a, w, sizes, ctx, dtype, tile):
        return grouped.grouped_forward(a, w, sizes, tile=tile, out_dtype=dtype)

    def grouped_cotangent(self, a, w, sizes, ctx, g):
        return a, w, g, ctx

    def grouped_dgrad(self, a, g, w, sizes, ctx, dtype, tile):
        return grouped.grouped_backward(a, w, sizes, g, tile=tile, weight=False)

    def grouped_wgrad(self, a, g, sizes, ctx, tile):
        return grouped.grouped_wgrad(a, g, sizes, tile=tile).astype(self.param_dtype)

    def grouped_backward(self, a, g, w, sizes, ctx, dtype, tile):
        """``(dx, dW)`` in one loop over the tiles."""
        return grouped.grouped_backward(a, w, sizes, g, tile=tile)

    def wgrad_context(self, state, values):
        return None
