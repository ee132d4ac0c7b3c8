"""Tensor- and sequence-parallel linear layers (Flax NNX) on global arrays.

Every layer holds ``kernel`` ``[in_features, out_features]`` and ``bias``
``[out_features]`` exactly like :class:`flax.nnx.Linear` (global shapes, same initialisers
and the same order of rng draws), plus sharding metadata over the tensor axis. A layer is
called on a global ``[batch, seq, features]`` :class:`jax.Array` under ``jax.set_mesh``;
inside it, one :func:`jax.shard_map` runs the per-device computation from
:mod:`sp_jax.ops`. Inputs with another sharding are resharded to the layout below.

Layouts (``d`` = data axis, ``t`` = tensor axis of the :class:`~sp_jax.ParallelConfig`):

================================  =================  =================  ===============
layer                             input              output             kernel
================================  =================  =================  ===============
ColumnParallelLinear              ``P(d, None, None)``  ``P(d, None, t)`` ``P(None, t)``
  ``gather_output=True``          ``P(d, None, None)``  ``P(d, None, None)``
RowParallelLinear                 ``P(d, None, t)``  ``P(d, None, None)``  ``P(t, None)``
  ``input_is_parallel=False``     ``P(d, None, None)``
ColumnSequenceParallelLinear      ``P(d, t, None)``  ``P(d, None, t)``  ``P(None, t)``
RowSequenceParallelLinear         ``P(d, None, t)``  ``P(d, t, None)``  ``P(t, None)``
================================  =================  =================  ===============
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from jax.sharding import PartitionSpec as P

from sp_jax import ops
from sp_jax.config import Fp8Recipe, ParallelConfig
from sp_jax.layers.fp8 import check_fp8_recipe, fp8_history, fp8_spec
from sp_jax.layout import Layout
from sp_jax.mesh import (
    Mesh,
    check_activations,
    check_batch_and_sequence,
    check_divisible,
    current_mesh,
    reshard,
    warn_if_recompute_may_be_merged,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ColumnSequenceParallelLinear",
    "RowSequenceParallelLinear",
    "column_sp_matmul",
]

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()

Initializer = Callable[..., jax.Array]


class _ParallelLinear(nnx.Module):
    """Parameters, validation and the shard_map call shared by the four layers.

    Subclasses set ``_split_in`` (row layers: the kernel's input dimension is sharded;
    column layers: its output dimension) and ``_sequence_parallel``, and implement
    ``_specs`` and ``_local``.
    """

    _split_in: bool = False
    _sequence_parallel: bool = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        parallel: ParallelConfig = ParallelConfig(),
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        fp8: Fp8Recipe | None = None,
        rngs: nnx.Rngs,
    ):
        name = type(self).__name__
        for arg, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: {arg}={value!r} must be a positive int.")
        if not isinstance(parallel, ParallelConfig):
            raise TypeError(
                f"{name}: parallel={parallel!r} must be a sp_jax.ParallelConfig "
                "(use ParallelConfig.from_dict for a plain dict)."
            )
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.parallel = parallel
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.fp8 = check_fp8_recipe(name, fp8)
        fp8_spec(self.fp8, parallel)  # FP8 options the layer cannot run fail here

        mesh = current_mesh(parallel, where=name, required=False)
        if mesh is not None:
            self._check_features(mesh)
        kernel_axes, bias_axes = (tuple(spec) for spec in self._param_specs(Layout.of(parallel)))
        # Same rng draws as nnx.Linear, so equal seeds give equal weights.
        kernel_key = rngs.params()
        self.kernel = nnx.Param(
            kernel_init(kernel_key, (in_features, out_features), param_dtype),
            out_sharding=kernel_axes,
            eager_sharding=mesh is not None,
        )
        self.bias: nnx.Param[jax.Array] | None
        if use_bias:
            bias_key = rngs.params()
            self.bias = nnx.Param(
                bias_init(bias_key, (out_features,), param_dtype),
                out_sharding=bias_axes,
                eager_sharding=mesh is not None,
            )
        else:
            self.bias = None
        self.fp8_history = fp8_history(self.fp8, eager=mesh is not None)

    def _param_specs(self, layout: Layout) -> tuple[P, P]:
        """(kernel spec, bias spec): row layers split the input features, column layers
        the output features."""
        if self._split_in:
            return layout.row_kernel, layout.row_bias
        return layout.column_kernel, layout.column_bias

    # -- validation --------------------------------------------------------------------

    def _check_features(self, mesh: Mesh) -> None:
        name, t = type(self).__name__, self.parallel.tensor_axis
        arg, size = (
            ("in_features", self.in_features)
            if self._split_in
            else ("out_features", self.out_features)
        )
        check_divisible(
            name, arg, size, mesh, t,
            f"choose {arg} as a multiple of the tensor-parallel size",
        )
        if self.parallel.fsdp:  # the other kernel dimension is sharded over the data axes
            arg, size = (("out_features", self.out_features) if self._split_in
                         else ("in_features", self.in_features))
            check_divisible(
                f"{name} (fsdp)", arg, size, mesh, self.parallel.fsdp_axes,
                f"choose {arg} as a multiple of the data-parallel size, or fsdp=False")

    def _check_input(self, x: jax.Array, mesh: Mesh) -> None:
        name = type(self).__name__
        check_activations(name, x, self.in_features, "in_features", fix=False)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{name}: input dtype {x.dtype} is not floating point; cast the input "
                "(e.g. x.astype(jnp.float32))."
            )
        check_batch_and_sequence(name, mesh, self.parallel, x.shape[0],
                                 x.shape[1] if self._sequence_parallel else None,
                                 length=x.shape[1])

    # -- forward ------------------------------------------------------------------------

    def _specs(self, layout: Layout) -> tuple[P, P]:
        """(input spec, output spec) of the activations."""
        raise NotImplementedError

    def _local(self, x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
               fp8: dict) -> jax.Array:
        """The per-device computation (inside ``shard_map``); ``fp8``: the FP8 keyword
        arguments of the op (``fp8``, ``fp8_history``; empty without FP8)."""
        raise NotImplementedError

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the layer to a global ``[batch, seq, in_features]`` array.

        Returns ``[batch, seq, out_features]`` in the compute dtype (``dtype``, or the
        promoted dtype of input and parameters) with the layer's output sharding.
        """
        return self._apply(x)

    def _apply(self, x: jax.Array, activation=None) -> jax.Array:
        """:meth:`__call__`, with ``activation`` (if given) handed to :meth:`_local`."""
        mesh = current_mesh(self.parallel, where=type(self).__name__)
        self._check_features(mesh)
        x = jnp.asarray(x)
        self._check_input(x if activation is None else jax.eval_shape(activation, x), mesh)
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        dtype = self.dtype if self.dtype is not None else jnp.result_type(x.dtype, kernel.dtype)
        x = x.astype(dtype)

        layout = Layout.of(self.parallel)
        x_spec, out_spec = self._specs(layout)
        k_spec, b_spec = self._param_specs(layout)
        args, in_specs = [reshard(x, x_spec, mesh), reshard(kernel, k_spec, mesh)], [x_spec, k_spec]
        args.append(None if bias is None else reshard(bias, b_spec, mesh))
        in_specs.append(None if bias is None else b_spec)
        history = None if self.fp8_history is None else self.fp8_history[...]
        args.append(None if history is None else reshard(history, P(), mesh))
        in_specs.append(None if history is None else P())
        extra = {} if activation is None else {"activation": activation}
        spec = fp8_spec(self.fp8, self.parallel)

        def local(x, k, b, h):
            fp8 = {} if spec is None else {"fp8": spec, "fp8_history": h}
            return self._local(x, k, b, fp8, **extra)

        return jax.shard_map(local, in_specs=tuple(in_specs), out_specs=out_spec)(*args)


class ColumnParallelLinear(_ParallelLinear):
    """Linear layer with the kernel split by columns (output features) over the tensor axis.

    ``y = x @ kernel + bias`` where device ``i`` holds ``kernel[:, i*o/t:(i+1)*o/t]``. The
    replicated input enters the tensor region by ``identity_with_all_reduce_grad`` (identity;
    backward all-reduce).

    Shapes: input ``[b, s, in]`` ``P(data, None, None)``; output ``[b, s, out]``
    ``P(data, None, tensor)`` (``gather_output=False``) or ``P(data, None, None)``.

    Args:
      in_features: input feature size.
      out_features: output feature size; divisible by the tensor-axis size.
      use_bias: whether to add a bias.
      gather_output: all-gather the output features so every device holds all of them.
      parallel: the :class:`~sp_jax.ParallelConfig`.
      dtype: compute dtype (default: promoted dtype of input and parameters).
      param_dtype: parameter dtype.
      kernel_init: initializer of the global ``[in, out]`` kernel.
      bias_init: initializer of the global ``[out]`` bias.
      fp8: an :class:`~sp_jax.Fp8Recipe` to compute in FP8 (e4m3 input and kernel, e5m2
        output gradient, whole-tensor scales, fp32 accumulation; with delayed scaling the
        layer holds its amax history as ``fp8_history``, an
        :class:`~sp_jax.layers.fp8.Fp8History`), or ``None`` (the compute dtype).
      rngs: rng streams; one ``params`` draw for the kernel and one for the bias.
    """

    def __init__(self, in_features: int, out_features: int, *, gather_output: bool = False,
                 **kwargs: Any):
        super().__init__(in_features, out_features, **kwargs)
        self.gather_output = gather_output

    def _specs(self, layout):
        out = layout.tensor_replicated if self.gather_output else layout.tp
        return layout.tensor_replicated, out

    def _local(self, x, kernel, bias, fp8):
        t, wd = self.parallel.tensor_axis, self.parallel.wgrad_dtype
        y = ops.column_parallel_matmul(x, kernel, bias, axis_name=t, wgrad_dtype=wd,
                                       fsdp_axes=self.parallel.fsdp_axes, **fp8)
        if self.gather_output:
            y = ops.all_gather_with_split_grad(y, t, dim=-1)
        return y


class RowParallelLinear(_ParallelLinear):
    """Linear layer with the kernel split by rows (input features) over the tensor axis.

    Each device multiplies its input-feature block by its row block of the kernel and the
    partial results are all-reduced (``all_reduce_with_identity_grad``); the bias is added
    once, after the reduction.

    Shapes: input ``[b, s, in]`` ``P(data, None, tensor)`` (``input_is_parallel=True``)
    or ``P(data, None, None)`` (split on entry); output ``[b, s, out]``
    ``P(data, None, None)``.

    Args:
      in_features: input feature size; divisible by the tensor-axis size.
      input_is_parallel: the input is already split over features (the output of a
        :class:`ColumnParallelLinear`); otherwise it is split on entry
        (``split_with_all_gather_grad`` on the feature dimension).
      others: as :class:`ColumnParallelLinear`.
    """

    _split_in = True

    def __init__(self, in_features: int, out_features: int, *, input_is_parallel: bool = True,
                 **kwargs: Any):
        super().__init__(in_features, out_features, **kwargs)
        self.input_is_parallel = input_is_parallel

    def _specs(self, layout):
        x_spec = layout.tp if self.input_is_parallel else layout.tensor_replicated
        return x_spec, layout.tensor_replicated

    def _local(self, x, kernel, bias, fp8):
        t, wd = self.parallel.tensor_axis, self.parallel.wgrad_dtype
        if not self.input_is_parallel:
            x = ops.split_with_all_gather_grad(x, t, dim=-1)
        y = ops.matmul(x, kernel, wgrad_dtype=wd, fsdp_axes=self.parallel.fsdp_axes, fsdp_dim=1,
                       **fp8)
        y = ops.all_reduce_with_identity_grad(y, t)
        return ops.add_bias(y, bias, wgrad_dtype=wd)


def column_sp_matmul(x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                     parallel: ParallelConfig, **fp8: Any) -> jax.Array:
    """Per device (inside ``shard_map``): :func:`sp_jax.ops.column_sequence_parallel_matmul`
    of the sequence shard ``x [b, s / t, in]`` with this device's column block ``kernel``
    (and ``bias``), with every option of ``parallel`` (recompute, wgrad dtype, collective
    matmul, fsdp), and in FP8 with ``fp8`` (the op's ``fp8`` and ``fp8_history``
    arguments). Shared by :class:`ColumnSequenceParallelLinear`, the grouped-query
    projection and the GPT's LM head."""
    return ops.column_sequence_parallel_matmul(
        x, kernel, bias,
        axis_name=parallel.tensor_axis,
        seq_dim=1,
        recompute_allgather=parallel.recompute_allgather,
        wgrad_dtype=parallel.wgrad_dtype,
        collective_matmul=parallel.collective_matmul,
        fsdp_axes=parallel.fsdp_axes,
        **fp8,
    )


class ColumnSequenceParallelLinear(_ParallelLinear):
    """Column-parallel linear whose input is sharded along the sequence (SP).

    Forward: all-gather the sequence, multiply by this device's column block
    (``ops.column_sequence_parallel_matmul``). Backward: reduce-scatter ``dx`` back to
    the sequence shards; with ``parallel.recompute_allgather`` only the local shard is kept
    for the backward pass and gathered again there.

    Shapes: input ``[b, s, in]`` ``P(data, tensor, None)`` (``s`` divisible by the tensor
    size); output ``[b, s, out]`` ``P(data, None, tensor)``.

    Args: as :class:`ColumnParallelLinear` (the output is never gathered).
    """

    _sequence_parallel = True

    def _specs(self, layout):
        return layout.sp, layout.tp

    def __call__(self, x: jax.Array) -> jax.Array:
        warn_if_recompute_may_be_merged(self.parallel)
        return super().__call__(x)

    def _local(self, x, kernel, bias, fp8):
        return column_sp_matmul(x, kernel, bias, self.parallel, **fp8)


class RowSequenceParallelLinear(_ParallelLinear):
    """Row-parallel linear whose output is sharded along the sequence (SP).

    Forward: multiply this device's feature block by its row block of the kernel, then
    reduce-scatter the partial sums along the sequence (one op with the matmul);
    the bias is added once, after the reduction. Backward: all-gather ``dy``.

    Shapes: input ``[b, s, in]`` ``P(data, None, tensor)``; output ``[b, s, out]``
    ``P(data, tensor, None)`` (``s`` divisible by the tensor size).

    Args: as :class:`RowParallelLinear` (the input is always parallel).
    """

    _split_in = True
    _sequence_parallel = True

    def __call__(self, x: jax.Array, *, activation=None) -> jax.Array:
        """Applies the layer to a global ``[batch, seq, in_features]`` array, or, with
        ``activation``, to ``activation(x)``.

        Args:
          x: ``[batch, seq, width]`` ``P(data, None, tensor)``; ``width = in_features``
            without ``activation``.
          activation: ``None``, or a hashable function applied per device to this
            device's block of ``x`` inside the op (``[b, s, width / t] -> [b, s,
            in_features / t]``, elementwise along the sequence; an MLP's activation,
            gated ones included): only ``x`` is kept for the backward pass, which
            computes the activation again (see
            :func:`sp_jax.ops.row_sequence_parallel_matmul`).
        Returns:
          ``[batch, seq, out_features]`` ``P(data, tensor, None)``, compute dtype.
        """
        return self._apply(x, activation)

    def _specs(self, layout):
        return layout.tp, layout.sp

    def _local(self, x, kernel, bias, fp8, activation=None):
        cfg = self.parallel
        return ops.row_sequence_parallel_matmul(
            x, kernel, bias, axis_name=cfg.tensor_axis, seq_dim=1, wgrad_dtype=cfg.wgrad_dtype,
            collective_matmul=cfg.collective_matmul, fsdp_axes=cfg.fsdp_axes,
            activation=activation, **fp8)
