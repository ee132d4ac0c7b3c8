"""LayerNorm and RMSNorm over sequence-sharded activations (the norms outside the TP
region), with a memory-lean backward.

In a sequence-parallel region every device holds ``[batch, seq / t, hidden]``. These are
:mod:`flax.nnx` norms with the same parameters, whose input is placed in the SP layout
``P(data, tensor, None)`` first, so each device normalises only its own tokens. The
scale/bias are replicated; their gradient is a sum over every token of every device,
which JAX inserts itself (the transpose of broadcasting a replicated parameter over
sharded activations): what Paddle does by hand with
``register_sequence_parallel_allreduce_hooks``. They normalise in fp32 but keep for
backward only the input (in its own dtype) and two fp32 numbers per token, recomputing
the normalised values: 2 bytes per element for a bf16 input instead of the three fp32
arrays plain autodiff of ``nnx.LayerNorm`` keeps.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from sp_jax.config import ParallelConfig
from sp_jax.mesh import check_activations, to_sequence_parallel

__all__ = ["NORMS", "LayerNorm", "RMSNorm", "layer_norm", "make_norm", "rms_norm"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x, scale, bias, epsilon: float, center: bool, out_dtype):
    return _norm_fwd(x, scale, bias, epsilon, center, out_dtype)[0]


def _norm_stats(x, epsilon, center):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True) if center else jnp.zeros((), jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + epsilon)
    return (xf - mean) * rstd, mean, rstd


def _norm_fwd(x, scale, bias, epsilon, center, out_dtype):
    x_hat, mean, rstd = _norm_stats(x, epsilon, center)
    y = x_hat
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    # Residuals: the input in its own dtype and two fp32 numbers per token; the
    # normalised fp32 copy is recomputed in backward.
    return y.astype(out_dtype), (x, mean, rstd, scale, bias)


def _norm_bwd(epsilon, center, out_dtype, res, g):
    x, mean, rstd, scale, bias = res
    x_hat = (x.astype(jnp.float32) - mean) * rstd
    g = g.astype(jnp.float32)
    lead = tuple(range(g.ndim - 1))
    d_scale = None if scale is None else jnp.sum(g * x_hat, axis=lead).astype(scale.dtype)
    d_bias = None if bias is None else jnp.sum(g, axis=lead).astype(bias.dtype)
    d_xhat = g * scale.astype(jnp.float32) if scale is not None else g
    proj = jnp.mean(d_xhat * x_hat, axis=-1, keepdims=True)
    d_x = d_xhat - x_hat * proj
    if center:
        d_x = d_x - jnp.mean(d_xhat, axis=-1, keepdims=True)
    # The parameter gradients are reductions over this device's tokens; released with
    # d_x, they are computed here instead of at the end of the backward pass, where XLA
    # would otherwise keep every layer's incoming gradient alive until then.
    return lax.optimization_barrier(((d_x * rstd).astype(x.dtype), d_scale, d_bias))


_norm.defvjp(_norm_fwd, _norm_bwd)


def layer_norm(x: jax.Array, scale: jax.Array | None, bias: jax.Array | None, *,
               epsilon: float = 1e-6, dtype=None) -> jax.Array:
    """LayerNorm over the last axis with a memory-lean backward (no mesh needed).

    Normalises in fp32; keeps for backward only ``x`` (in its own dtype) and two fp32
    numbers per token. Equal to :class:`flax.nnx.LayerNorm` forward and backward.

    Args:
      x: ``[..., features]`` activations, any sharding.
      scale / bias: ``[features]`` parameters, or None for none.
      epsilon: added to the variance.
      dtype: output dtype (default: promoted dtype of ``x`` and the parameters).
    """
    if dtype is None:
        dtype = jnp.result_type(x, *(p for p in (scale, bias) if p is not None))
    return _norm(x, scale, bias, epsilon, True, dtype)


def rms_norm(x: jax.Array, scale: jax.Array | None, *, epsilon: float = 1e-6,
             dtype=None) -> jax.Array:
    """RMSNorm over the last axis with the memory-lean backward of :func:`layer_norm`."""
    if dtype is None:
        dtype = jnp.result_type(x, *(p for p in (scale,) if p is not None))
    return _norm(x, scale, None, epsilon, False, dtype)


def _fast_path(module: nnx.Module, mask: jax.Array | None) -> bool:
    """Our lean VJP covers the usual case: normalise and scale the last axis only."""
    return (mask is None and module.axis_name is None
            and module.reduction_axes in (-1, (-1,)) and module.feature_axes in (-1, (-1,)))


def _check_input(module: nnx.Module, x: jax.Array) -> None:
    """``x`` must be ``[batch, seq, num_features]`` (the features on the last axis unless
    the norm was built with other ``feature_axes``)."""
    last = module.feature_axes in (-1, (-1,))
    check_activations(type(module).__name__, x,
                      module.num_features if last else jnp.shape(x)[-1], "num_features")


def _out_dtype(module: nnx.Module, x: jax.Array):
    if module.dtype is not None:
        return module.dtype
    params = [v[...] for v in (getattr(module, "scale", None), getattr(module, "bias", None))
              if v is not None]
    return jnp.result_type(x, *params)


class LayerNorm(nnx.LayerNorm):
    """:class:`flax.nnx.LayerNorm` over the last axis of SP-sharded activations.

    Same arguments as ``nnx.LayerNorm`` plus ``parallel`` (the
    :class:`~sp_jax.ParallelConfig`); parameters ``scale`` / ``bias`` ``[num_features]``,
    replicated.
    """

    def __init__(self, num_features: int, *, parallel: ParallelConfig = ParallelConfig(),
                 **kwargs: Any):
        super().__init__(num_features, **kwargs)
        self.parallel = parallel

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        x = jnp.asarray(x)
        _check_input(self, x)
        return self.local(to_sequence_parallel(x, self.parallel, where="LayerNorm"), mask=mask)

    def local(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """The norm of the rows this device holds, per device (inside a ``shard_map``;
        parameters replicated): what :meth:`__call__` computes after placing ``x`` in the
        SP layout, and what decoding runs on whole rows ``[b, 1, features]``."""
        if not _fast_path(self, mask):
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        return layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=_out_dtype(self, x))


class RMSNorm(nnx.RMSNorm):
    """:class:`flax.nnx.RMSNorm` over the last axis of SP-sharded activations.

    Same arguments as ``nnx.RMSNorm`` plus ``parallel`` (the
    :class:`~sp_jax.ParallelConfig`); parameter ``scale`` ``[num_features]``, replicated.
    """

    def __init__(self, num_features: int, *, parallel: ParallelConfig = ParallelConfig(),
                 **kwargs: Any):
        super().__init__(num_features, **kwargs)
        self.parallel = parallel

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        x = jnp.asarray(x)
        _check_input(self, x)
        return self.local(to_sequence_parallel(x, self.parallel, where="RMSNorm"), mask=mask)

    def local(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Per device, as :meth:`LayerNorm.local`."""
        if not _fast_path(self, mask):
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        return rms_norm(x, scale, epsilon=self.epsilon, dtype=_out_dtype(self, x))


NORMS: dict[str, type[nnx.Module]] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
"""The norms a block or model can be configured with, by name."""


def make_norm(kind: str, features: int, *, parallel: ParallelConfig, epsilon: float,
              dtype: Any, param_dtype: Any, rngs: nnx.Rngs) -> nnx.Module:
    """The :data:`NORMS` entry ``kind`` over ``features``; a ValueError names the valid
    kinds for an unknown one."""
    if kind not in NORMS:
        raise ValueError(f"norm={kind!r} is not a known norm; use one of {sorted(NORMS)}.")
    return NORMS[kind](features, parallel=parallel, epsilon=epsilon, dtype=dtype,
                       param_dtype=param_dtype, rngs=rngs)

