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
from sp_jax.ops.primitives import residuals_to_device, residuals_to_host

__all__ = ["NORMS", "LayerNorm", "RMSNorm", "layer_norm", "make_norm", "norm_bwd_input",
           "norm_bwd_weight", "rms_norm"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _norm(x, scale, bias, epsilon: float, center: bool, out_dtype, offset: float = 0.0,
          offload: bool = False):
    return _norm_fwd(x, scale, bias, epsilon, center, out_dtype, offset)[0]


def _factor(scale, offset):
    """The fp32 factor of the normalised values: ``offset + scale`` (Gemma's ``1.0 +
    weight.float()``), the scale itself for offset 0 (bitwise as without an offset)."""
    scale = scale.astype(jnp.float32)
    return scale if offset == 0 else jnp.float32(offset) + scale


def _norm_stats(x, epsilon, center):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True) if center else jnp.zeros((), jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + epsilon)
    return (xf - mean) * rstd, mean, rstd


def _norm_fwd(x, scale, bias, epsilon, center, out_dtype, offset=0.0):
    x_hat, mean, rstd = _norm_stats(x, epsilon, center)
    y = x_hat
    if scale is not None:
        y = y * _factor(scale, offset)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    # Residuals: the input in its own dtype and two fp32 numbers per token; the
    # normalised fp32 copy is recomputed in backward.
    return y.astype(out_dtype), (x, mean, rstd, scale, bias)


def _recomputed(res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The normalised values (fp32, recomputed from the input and its statistics) and the
    output gradient in fp32."""
    x, mean, rstd, _, _ = res
    return (x.astype(jnp.float32) - mean) * rstd, g.astype(jnp.float32)


def _input_grad(center: bool, offset: float, res: tuple, x_hat: jax.Array, g: jax.Array
                ) -> jax.Array:
    x, _, rstd, scale, _ = res
    d_xhat = g * _factor(scale, offset) if scale is not None else g
    proj = jnp.mean(d_xhat * x_hat, axis=-1, keepdims=True)
    d_x = d_xhat - x_hat * proj
    if center:
        d_x = d_x - jnp.mean(d_xhat, axis=-1, keepdims=True)
    return (d_x * rstd).astype(x.dtype)


def norm_bwd_input(center: bool, offset: float, res: tuple, g: jax.Array
                   ) -> tuple[jax.Array, tuple]:
    """The input-gradient part of the norms' backward: ``(dx, wres)`` from the forward's
    residuals ``res`` (the input, its two fp32 statistics per token, scale and bias) and
    the output gradient ``g`` (``center``: LayerNorm, else RMSNorm; ``offset`` as
    :func:`layer_norm`'s); ``wres`` is what :func:`norm_bwd_weight` needs (the
    normalised values, recomputed here, and ``g`` in fp32, with the parameters)."""
    x_hat, g = _recomputed(res, g)
    return _input_grad(center, offset, res, x_hat, g), (x_hat, g, res[3], res[4])


def norm_bwd_weight(wres: tuple) -> tuple[jax.Array | None, jax.Array | None]:
    """The weight-gradient part of the norms' backward: ``(d_scale, d_bias)`` (None for a
    missing parameter), reductions over the tokens of :func:`norm_bwd_input`'s ``wres``.

    A pipeline's deferred weight gradients (:func:`~sp_jax.layers.backward_input`) leave
    the norms' in the input-gradient pass: deferring them would keep an activation-sized
    ``wres`` (the normalised input and the output gradient) per norm until the W action
    to save a reduction."""
    x_hat, g, scale, bias = wres
    lead = tuple(range(g.ndim - 1))
    d_scale = None if scale is None else jnp.sum(g * x_hat, axis=lead).astype(scale.dtype)
    d_bias = None if bias is None else jnp.sum(g, axis=lead).astype(bias.dtype)
    return d_scale, d_bias


def _norm_bwd(epsilon, center, out_dtype, offset, res, g):
    # norm_bwd_input then norm_bwd_weight, traced weight part first (today's HLO)
    x_hat, g = _recomputed(res, g)
    d_scale, d_bias = norm_bwd_weight((x_hat, g, res[3], res[4]))
    d_x = _input_grad(center, offset, res, x_hat, g)
    # The parameter gradients are reductions over this device's tokens; released with
    # d_x, they are computed here instead of at the end of the backward pass, where XLA
    # would otherwise keep every layer's incoming gradient alive until then.
    return lax.optimization_barrier((d_x, d_scale, d_bias))


def _norm_offload_fwd(x, scale, bias, epsilon, center, out_dtype, offset, offload):
    y, (x, mean, rstd, scale, bias) = _norm_fwd(x, scale, bias, epsilon, center, out_dtype,
                                                offset)
    (x, mean, rstd), y = residuals_to_host((x, mean, rstd), y, offload)
    return y, (x, mean, rstd, scale, bias)


def _norm_offload_bwd(epsilon, center, out_dtype, offset, offload, res, g):
    x, mean, rstd, scale, bias = res
    (x, mean, rstd), g = residuals_to_device((x, mean, rstd), g, offload)
    return _norm_bwd(epsilon, center, out_dtype, offset, (x, mean, rstd, scale, bias), g)


_norm.defvjp(_norm_offload_fwd, _norm_offload_bwd)


def layer_norm(x: jax.Array, scale: jax.Array | None, bias: jax.Array | None, *,
               epsilon: float = 1e-6, dtype=None, offset: float = 0.0,
               offload: bool = False) -> jax.Array:
    """LayerNorm over the last axis with a memory-lean backward (no mesh needed).

    Normalises in fp32; keeps for backward only ``x`` (in its own dtype) and two fp32
    numbers per token. Equal to :class:`flax.nnx.LayerNorm` forward and backward.

    Args:
      x: ``[..., features]`` activations, any sharding.
      scale / bias: ``[features]`` parameters, or None for none.
      epsilon: added to the variance.
      dtype: output dtype (default: promoted dtype of ``x`` and the parameters).
      offset: the normalised values are scaled by ``offset + scale`` (in fp32; Gemma's
        ``1 + weight``: 1.0), by ``scale`` for 0.0.
      offload: keep ``x`` and the statistics in host memory between the passes
        (``ParallelConfig.offload_activations``).
    """
    if dtype is None:
        dtype = jnp.result_type(x, *(p for p in (scale, bias) if p is not None))
    return _norm(x, scale, bias, epsilon, True, dtype, float(offset), bool(offload))


def rms_norm(x: jax.Array, scale: jax.Array | None, *, epsilon: float = 1e-6,
             dtype=None, offset: float = 0.0, offload: bool = False) -> jax.Array:
    """RMSNorm over the last axis with the memory-lean backward of :func:`layer_norm`
    (``offset`` as there: Gemma's ``x * rsqrt(mean(x ** 2) + eps) * (1 + weight)`` in
    fp32 with 1.0; ``offload`` as there)."""
    if dtype is None:
        dtype = jnp.result_type(x, *(p for p in (scale,) if p is not None))
    return _norm(x, scale, None, epsilon, False, dtype, float(offset), bool(offload))


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


def _offset_init(norm_offset: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the scale starting at ``1 - norm_offset`` (a factor of 1) unless a
    ``scale_init`` is given; a TypeError for a ``norm_offset`` that is not a number."""
    if isinstance(norm_offset, bool) or not isinstance(norm_offset, int | float):
        raise TypeError(f"norm_offset={norm_offset!r} must be a number (0.0: scale by the "
                        "weight; 1.0: by 1 + weight, as Gemma).")
    if norm_offset and "scale_init" not in kwargs:
        kwargs = {**kwargs, "scale_init": nnx.initializers.constant(1.0 - norm_offset)}
    return kwargs


def _check_plain(module: nnx.Module) -> None:
    """Flax's own norm (a mask, an axis name, other axes) has no offset."""
    if module.norm_offset:
        raise ValueError(f"{type(module).__name__}: norm_offset={module.norm_offset} is "
                         "applied on the last axis without a mask only; use norm_offset=0.0 "
                         "with a mask, axis_name or other reduction/feature axes.")


class LayerNorm(nnx.LayerNorm):
    """:class:`flax.nnx.LayerNorm` over the last axis of SP-sharded activations.

    Same arguments as ``nnx.LayerNorm`` plus ``parallel`` (the
    :class:`~sp_jax.ParallelConfig`) and ``norm_offset`` (the normalised values are scaled
    by ``norm_offset + scale``; the scale then starts at ``1 - norm_offset``);
    parameters ``scale`` / ``bias`` ``[num_features]``, replicated.
    """

    def __init__(self, num_features: int, *, parallel: ParallelConfig = ParallelConfig(),
                 norm_offset: float = 0.0, **kwargs: Any):
        super().__init__(num_features, **_offset_init(norm_offset, kwargs))
        self.parallel, self.norm_offset = parallel, float(norm_offset)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        x = jnp.asarray(x)
        _check_input(self, x)
        return self.local(to_sequence_parallel(x, self.parallel, where="LayerNorm"), mask=mask)

    def local(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """The norm of the rows this device holds, per device (inside a ``shard_map``;
        parameters replicated): what :meth:`__call__` computes after placing ``x`` in the
        SP layout, and what decoding runs on whole rows ``[b, 1, features]``."""
        if not _fast_path(self, mask):
            _check_plain(self)
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        return layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=_out_dtype(self, x),
                          offset=self.norm_offset,
                          offload=self.parallel.offload_activations)


class RMSNorm(nnx.RMSNorm):
    """:class:`flax.nnx.RMSNorm` over the last axis of SP-sharded activations.

    Same arguments as ``nnx.RMSNorm`` plus ``parallel`` (the
    :class:`~sp_jax.ParallelConfig`) and ``norm_offset`` (as :class:`LayerNorm`; Gemma's
    RMSNorm: 1.0, ``x * rsqrt(mean(x ** 2) + eps) * (1 + scale)`` in fp32, the scale
    starting at 0); parameter ``scale`` ``[num_features]``, replicated.
    """

    def __init__(self, num_features: int, *, parallel: ParallelConfig = ParallelConfig(),
                 norm_offset: float = 0.0, **kwargs: Any):
        super().__init__(num_features, **_offset_init(norm_offset, kwargs))
        self.parallel, self.norm_offset = parallel, float(norm_offset)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        x = jnp.asarray(x)
        _check_input(self, x)
        return self.local(to_sequence_parallel(x, self.parallel, where="RMSNorm"), mask=mask)

    def local(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Per device, as :meth:`LayerNorm.local`."""
        if not _fast_path(self, mask):
            _check_plain(self)
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        return rms_norm(x, scale, epsilon=self.epsilon, dtype=_out_dtype(self, x),
                        offset=self.norm_offset, offload=self.parallel.offload_activations)


NORMS: dict[str, type[nnx.Module]] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
"""The norms a block or model can be configured with, by name."""


def make_norm(kind: str, features: int, *, parallel: ParallelConfig, epsilon: float,
              dtype: Any, param_dtype: Any, rngs: nnx.Rngs,
              norm_offset: float = 0.0) -> nnx.Module:
    """The :data:`NORMS` entry ``kind`` over ``features`` (scaling by ``norm_offset +
    scale``); a ValueError names the valid kinds for an unknown one."""
    if kind not in NORMS:
        raise ValueError(f"norm={kind!r} is not a known norm; use one of {sorted(NORMS)}.")
    return NORMS[kind](features, parallel=parallel, epsilon=epsilon, dtype=dtype,
                       param_dtype=param_dtype, rngs=rngs, norm_offset=norm_offset)

