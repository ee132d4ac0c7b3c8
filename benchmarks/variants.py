"""The four block variants the benchmark compares, built the same way for every measurement.

=================  ===========================================================  ==========
variant            what                                                         mesh
=================  ===========================================================  ==========
``unsharded``      :class:`~benchmarks.baseline.GspmdBlock` with no mesh         one device
                   (its sharding constraints are skipped: the plain block)
``gspmd``          :class:`~benchmarks.baseline.GspmdBlock`: annotations,        Auto axes
                   XLA inserts the collectives
``sp_save``        :class:`sp_jax.models.Block`, ``recompute_allgather=False``  Explicit
``sp_recompute``   :class:`sp_jax.models.Block`, ``recompute_allgather=True``   Explicit
=================  ===========================================================  ==========

A :class:`Setup` holds a variant's mesh, model split into graph and parameters, and an
input; :meth:`Setup.apply` / :meth:`Setup.loss` are pure functions of
``(params, x)`` for ``jax.vjp`` / ``jax.jit`` / deviceless compilation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding

import sp_jax
from benchmarks.baseline import GspmdBlock, copy_weights, param_specs
from benchmarks.records import SP_VARIANTS, VARIANTS
from sp_jax import Layout
from sp_jax.models import Block, GPTConfig

__all__ = ["VARIANTS", "SP_VARIANTS", "Shape", "Setup", "make_setup", "make_mesh"]

SEED = 0  # parameter seed of every variant; the input is drawn with SEED + 1


@dataclasses.dataclass(frozen=True)
class Shape:
    """A block shape: hidden ``h``, heads ``a``, sequence ``s``, global batch ``b``,
    tensor size ``t``, data size ``d`` (``b`` is split over ``d``)."""

    h: int
    a: int
    s: int
    b: int
    t: int
    d: int = 1
    dtype: Any = jnp.bfloat16

    @property
    def b_local(self) -> int:
        return self.b // self.d

    def replace(self, **kw) -> Shape:
        return dataclasses.replace(self, **kw)

    def as_dict(self) -> dict[str, Any]:
        return {"h": self.h, "a": self.a, "s": self.s, "b": self.b, "t": self.t, "d": self.d,
                "dtype": jnp.dtype(self.dtype).name}


def make_mesh(shape: Shape, axis_type: AxisType):
    """A ``(data, tensor)`` mesh of the first ``d x t`` devices."""
    devices = jax.devices()[: shape.d * shape.t]
    if len(devices) < shape.d * shape.t:
        raise ValueError(f"need {shape.d * shape.t} devices for {shape}, have {len(devices)}")
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape.d, shape.t), ("data", "tensor"),
                             axis_types=(axis_type, axis_type))


@dataclasses.dataclass
class Setup:
    """One variant ready to run: ``mesh`` (``None`` for unsharded), ``graphdef`` and
    ``params`` of the block (placed in their shardings), input ``x`` ``[b, s, h]``."""

    variant: str
    shape: Shape
    mesh: Any
    graphdef: Any
    params: Any
    x: Any

    def apply(self, params, x):
        """Block output ``[b, s, h]``."""
        return nnx.merge(self.graphdef, params)(x)

    def loss(self, params, x):
        """A scalar of the block output (mean square, fp32)."""
        return jnp.mean(jnp.square(self.apply(params, x).astype(jnp.float32)))

    def grad_fn(self):
        """``(params, x) -> (d params, d x)``."""
        return jax.grad(self.loss, argnums=(0, 1))

    def context(self):
        """``jax.set_mesh(mesh)``, or a null context for the unsharded variant."""
        import contextlib

        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()


def _gpt_config(shape: Shape) -> GPTConfig:
    return GPTConfig(vocab_size=256, max_seq_len=shape.s, num_layers=1, num_heads=shape.a,
                     hidden=shape.h, dtype=shape.dtype, param_dtype=jnp.float32)


def _parallel(variant: str, shape: Shape) -> sp_jax.ParallelConfig:
    wgrad = jnp.float32 if jnp.dtype(shape.dtype) != jnp.float32 else None
    return sp_jax.ParallelConfig(recompute_allgather=variant == "sp_recompute",
                                 data_axis="data", wgrad_dtype=wgrad)


def _build(variant: str, shape: Shape) -> nnx.Module:
    if variant in SP_VARIANTS:
        return Block(_gpt_config(shape), _parallel(variant, shape), rngs=nnx.Rngs(SEED))
    return GspmdBlock(shape.h, shape.a, dtype=shape.dtype, layout=Layout(),
                      rngs=nnx.Rngs(SEED))


def make_setup(variant: str, shape: Shape, *, abstract: bool,
               weights_from: nnx.Module | None = None) -> Setup:
    """Builds ``variant`` at ``shape``.

    Args:
      variant: one of :data:`VARIANTS`.
      shape: the block shape (``unsharded`` ignores ``t`` and ``d``).
      abstract: ``True``: parameters and input are ``jax.ShapeDtypeStruct`` s (nothing is
        allocated; for residual listings and compiles). ``False``: real arrays, placed in
        their shardings.
      weights_from: copy this module's parameter values (same tree) instead of
        :data:`SEED`'s.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")
    if variant == "unsharded":
        mesh = None
    else:
        axis = AxisType.Auto if variant == "gspmd" else AxisType.Explicit
        mesh = make_mesh(shape, axis)
    ctx = Setup(variant, shape, mesh, None, None, None).context()
    x_spec = Layout().sp  # [b, s, h] in the SP layout: P(data, tensor, None)
    with ctx:
        if abstract:
            model = nnx.eval_shape(lambda: _build(variant, shape))
        else:
            model = _build(variant, shape)
            if weights_from is not None:
                copy_weights(model, weights_from)
        graphdef, params = nnx.split(model)
        if mesh is not None:
            shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(model))
            if abstract:
                params = jax.tree.map(
                    lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh),
                    params, shardings)
            else:
                params = jax.device_put(params, shardings)
            x_sharding = NamedSharding(mesh, x_spec)
        else:
            x_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            if not abstract:
                params = jax.device_put(params, x_sharding)
        xshape = (shape.b, shape.s, shape.h)
        if abstract:
            x = jax.ShapeDtypeStruct(xshape, shape.dtype, sharding=x_sharding)
        else:
            host = np.random.default_rng(SEED + 1).normal(size=xshape).astype(np.float32)
            x = jax.device_put(jnp.asarray(host, shape.dtype), x_sharding)
    return Setup(variant, shape, mesh, graphdef, params, x)
