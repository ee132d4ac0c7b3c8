"""The local GEMMs of the linear ops: compute-dtype products, weight and bias gradients
accumulated in ``wgrad_dtype``, and the backward pass's barrier'd kernel cast.

The weight gradient is computed straight from the low-precision operands into
``wgrad_dtype`` (``preferred_element_type``), the analog of Paddle's
``mp_fused_linear_param_grad_add`` / Megatron's ``gradient_accumulation_fusion``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["bgrad", "bwd_cast", "check_linear_shapes", "dot", "dot_nt", "dot_t", "wgrad"]


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


def dot(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x [..., in] @ kernel [in, out]`` in the dtype of ``x`` (the compute dtype)."""
    return lax.dot_general(x, kernel.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())))


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


def dot_t(g: jax.Array, kernel: jax.Array) -> jax.Array:
    """``g [..., out] @ kernel.T`` -> ``[..., in]`` in the dtype of ``g`` (backward only;
    the kernel is cast by :func:`bwd_cast`)."""
    return dot_nt(g, bwd_cast(kernel, g))


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
