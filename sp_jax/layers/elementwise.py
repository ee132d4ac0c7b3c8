"""Norms and dropout on sequence-sharded activations (the layers outside the TP region).

In a sequence-parallel region every device holds ``[batch, seq / t, hidden]``. These
layers are :mod:`flax.nnx` layers with the same parameters, whose input is placed in the
SP layout ``P(data, tensor, None)`` first, so each device normalises / masks only its own
tokens:

- :class:`LayerNorm`, :class:`RMSNorm`: the scale/bias are replicated. Their gradient is
  a sum over every token of every device; JAX inserts that all-reduce itself (the
  transpose of broadcasting a replicated parameter over sharded activations), which is
  what Paddle does by hand with ``register_sequence_parallel_allreduce_hooks``. They
  normalise in fp32 but keep for backward only the input (in its own dtype) and two fp32
  numbers per token, recomputing the normalised values: 2 bytes per element for a bf16
  input instead of the three fp32 arrays plain autodiff of ``nnx.LayerNorm`` keeps.
- :class:`Dropout`: the mask is drawn with the input's sharding from a partitionable
  (threefry) key, so the mask at every ``(batch, position, feature)`` equals the one the
  unsharded model draws from the same key, whatever the mesh. Megatron and Paddle seed
  each rank separately and cannot reproduce the unsharded model's dropout.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from sp_jax.config import ParallelConfig
from sp_jax.layers._sharding import axis_size, current_mesh, reshard, sequence_order
from sp_jax.layout import Layout

__all__ = ["NORMS", "LayerNorm", "RMSNorm", "Dropout", "layer_norm", "make_norm", "rms_norm",
           "to_sequence_parallel"]


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


def _out_dtype(module: nnx.Module, x: jax.Array):
    if module.dtype is not None:
        return module.dtype
    params = [v[...] for v in (getattr(module, "scale", None), getattr(module, "bias", None))
              if v is not None]
    return jnp.result_type(x, *params)


def to_sequence_parallel(x: jax.Array, config: ParallelConfig, *, where: str) -> jax.Array:
    """Places ``[batch, seq, hidden]`` ``x`` in the SP layout ``P(data, tensor, None)``
    (``P(data, (context, tensor), None)`` with a context axis).

    A sequence (or batch) that does not split evenly is left as it is (GSPMD then
    chooses).
    """
    mesh = current_mesh(config, where=where)
    if x.ndim != 3 or x.shape[1] % axis_size(mesh, (*config.context_axes, config.tensor_axis)):
        return x
    if x.shape[0] % axis_size(mesh, config.data_axes):
        return x
    return reshard(x, Layout.of(config).sp, mesh)


class LayerNorm(nnx.LayerNorm):
    """:class:`flax.nnx.LayerNorm` over the last axis of SP-sharded activations.

    Same arguments as ``nnx.LayerNorm`` plus ``config``; parameters ``scale`` / ``bias``
    ``[num_features]``, replicated.
    """

    def __init__(self, num_features: int, *, config: ParallelConfig = ParallelConfig(),
                 **kwargs: Any):
        super().__init__(num_features, **kwargs)
        self.config = config

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        x = to_sequence_parallel(x, self.config, where="LayerNorm")
        if not _fast_path(self, mask):
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        return layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=_out_dtype(self, x))


class RMSNorm(nnx.RMSNorm):
    """:class:`flax.nnx.RMSNorm` over the last axis of SP-sharded activations.

    Same arguments as ``nnx.RMSNorm`` plus ``config``; parameter ``scale``
    ``[num_features]``, replicated.
    """

    def __init__(self, num_features: int, *, config: ParallelConfig = ParallelConfig(),
                 **kwargs: Any):
        super().__init__(num_features, **kwargs)
        self.config = config

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        x = to_sequence_parallel(x, self.config, where="RMSNorm")
        if not _fast_path(self, mask):
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        return rms_norm(x, scale, epsilon=self.epsilon, dtype=_out_dtype(self, x))


NORMS: dict[str, type[nnx.Module]] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
"""The norms a block or model can be configured with, by name."""


def make_norm(kind: str, features: int, *, config: ParallelConfig, epsilon: float,
              dtype: Any, param_dtype: Any, rngs: nnx.Rngs) -> nnx.Module:
    """The :data:`NORMS` entry ``kind`` over ``features``; a ValueError names the valid
    kinds for an unknown one."""
    if kind not in NORMS:
        raise ValueError(f"norm={kind!r} is not a known norm; use one of {sorted(NORMS)}.")
    return NORMS[kind](features, config=config, epsilon=epsilon, dtype=dtype,
                       param_dtype=param_dtype, rngs=rngs)


class Dropout(nnx.Dropout):
    """:class:`flax.nnx.Dropout` whose mask does not depend on the sharding.

    Same arguments as ``nnx.Dropout`` plus ``config``. The mask is drawn with
    ``out_sharding`` equal to the input's (SP) sharding: each device generates only its
    own block, and, keys being partitionable, the values equal the unsharded draw. When
    the model holds the sequence in another order (ring context parallelism's zigzag
    order, :func:`~sp_jax.layers._sharding.sequence_order`), the mask is drawn in the
    natural order and permuted like the activations, so it still equals the unsharded
    model's at every (batch, position, feature).
    """

    def __init__(self, rate: float, *, config: ParallelConfig = ParallelConfig(),
                 **kwargs: Any):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"Dropout: rate={rate} must be in [0, 1].")
        super().__init__(rate, **kwargs)
        self.config = config

    def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None,
                 rngs: Any = None) -> jax.Array:
        active = self.rate and not (deterministic if deterministic is not None
                                    else self.deterministic)
        if not active:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        inputs = to_sequence_parallel(inputs, self.config, where="Dropout")
        order = None
        if inputs.ndim == 3:
            order = sequence_order(self.config, current_mesh(self.config, where="Dropout"),
                                   inputs.shape[1])
        if order is None or self.rate == 1.0 or self.broadcast_dims:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        return self._permuted(inputs, order, rngs)

    def _permuted(self, inputs: jax.Array, order: np.ndarray, rngs: Any) -> jax.Array:
        """Dropout with the mask of the natural order, permuted to ``order``."""
        stream = rngs if rngs is not None else self.rngs
        if isinstance(stream, nnx.Rngs):
            key = stream[self.rng_collection]()
        elif isinstance(stream, nnx.RngStream):
            key = stream()
        else:
            key = stream
        keep = 1.0 - self.rate
        sharding = jax.typeof(inputs).sharding
        mask = jax.random.bernoulli(key, p=keep, shape=inputs.shape, out_sharding=sharding)
        mesh = current_mesh(self.config, where="Dropout")
        whole = Layout.of(self.config).spec("batch", None, None)
        mask = reshard(jnp.take(reshard(mask, whole, mesh), jnp.asarray(order), axis=1),
                       Layout.of(self.config).sp, mesh)
        return lax.select(mask, inputs / keep, jnp.zeros_like(inputs))
