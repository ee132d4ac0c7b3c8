"""AdamW with its moments kept in a chosen precision (Megatron's precision-aware optimizer).

:func:`adamw` is ``optax.adamw`` built from the same optax pieces (``scale_by_adam``'s
arithmetic, then ``add_decayed_weights`` and ``scale_by_learning_rate``), with both
moments' storage dtypes free: ``mu_dtype`` for the first moment (optax has it too) and
``nu_dtype`` for the second (optax keeps it in the parameters' dtype). With a storage
dtype given, each step reads the moments, computes their update, the bias corrections and
the update direction in (at least) fp32, and rounds the moments to their dtype only
when it stores them; with both None it is ``optax.adamw``'s arithmetic, bitwise
(tests/test_optimizer_precision.py). bf16 moments halve the 8 bytes per parameter fp32
moments take.

FP8 moments are not offered: the second moment of typical gradients (``g**2`` around
1e-10 .. 1e-6) lies below ``float8_e4m3fn``'s smallest subnormal (about 2e-3), so it
would round to zero without a per-tensor scale.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["MOMENTS_DTYPES", "adamw", "scale_by_adam"]

MOMENTS_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
"""``--moments-dtype``: the names of the moments' storage dtypes."""


def _dtype(name: str, value: Any) -> Any:
    """None, or ``value`` as a floating dtype (a TypeError naming ``name`` otherwise)."""
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(f"adamw: {name}={value!r} is not a dtype; use None, jnp.float32 "
                        "or jnp.bfloat16.") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"adamw: {name}={value!r} must be a floating dtype; use None, "
                        "jnp.float32 or jnp.bfloat16.")
    return dtype


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  mu_dtype: Any = None, nu_dtype: Any = None
                  ) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` with the second moment's dtype free too.

    The state is optax's ``ScaleByAdamState(count, mu, nu)``, ``mu`` in ``mu_dtype`` and
    ``nu`` in ``nu_dtype`` (None: the parameters' dtype). Where a moment dtype is given,
    the update of that leaf computes in ``promote(gradient dtype, float32)`` and rounds
    the moments to their dtypes when storing them; with both None the arithmetic is
    optax's.

    Raises:
      TypeError: a moment dtype that is not a floating dtype (naming it).
    """
    mu_dtype, nu_dtype = _dtype("mu_dtype", mu_dtype), _dtype("nu_dtype", nu_dtype)
    cast = mu_dtype is not None or nu_dtype is not None

    def init_fn(params):
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                      mu=optax.tree.zeros_like(params, dtype=mu_dtype),
                                      nu=optax.tree.zeros_like(params, dtype=nu_dtype))

    def compute(g):  # the dtype a leaf's update computes in
        return jnp.promote_types(g.dtype, jnp.float32) if cast else g.dtype

    def update_fn(updates, state, params=None):
        del params
        up = jax.tree.map(lambda g: g.astype(compute(g)), updates)
        mu = jax.tree.map(lambda m, g: m.astype(compute(g)), state.mu, updates)
        nu = jax.tree.map(lambda v, g: v.astype(compute(g)), state.nu, updates)
        # optax.scale_by_adam's own steps (nesterov=False, eps_root=0)
        mu = optax.tree.update_moment(up, mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(up, nu, b2, 2)
        count_inc = optax.safe_increment(state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
        nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + 0.0) + eps), mu_hat, nu_hat)
        mu = optax.tree.cast_like(mu, state.mu)
        nu = optax.tree.cast_like(nu, state.nu)
        return out, optax.ScaleByAdamState(count=count_inc, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def adamw(learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 0.0, mu_dtype: Any = None,
          nu_dtype: Any = None) -> optax.GradientTransformation:
    """AdamW whose first and second moments are stored in ``mu_dtype`` / ``nu_dtype``.

    ``optax.adamw``'s chain: :func:`scale_by_adam`, ``optax.add_decayed_weights
    (weight_decay)`` (every parameter, as optax's default mask), then
    ``optax.scale_by_learning_rate(learning_rate)``. With both dtypes None it is bitwise
    ``optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay)``.

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1, b2, eps: Adam's decay rates and the denominator's epsilon (outside the root).
      weight_decay: decoupled weight decay (0: none; note optax.adamw's default is 1e-4).
      mu_dtype, nu_dtype: the storage dtypes of the first and second moments (e.g.
        ``jnp.bfloat16``), or None: the parameters' dtype.
    Raises:
      TypeError: a moment dtype that is not a floating dtype.

    Example::

        tx = sp_jax.training.adamw(3e-4, weight_decay=0.1, mu_dtype=jnp.bfloat16,
                                   nu_dtype=jnp.bfloat16)
    """
    return optax.chain(scale_by_adam(b1, b2, eps, mu_dtype, nu_dtype),
                       optax.add_decayed_weights(weight_decay),
                       optax.scale_by_learning_rate(learning_rate))
