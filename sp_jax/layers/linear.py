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

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from jax.sharding import PartitionSpec as P

from sp_jax import ops
from sp_jax.config import Fp8Recipe, LoRAConfig, ParallelConfig, check_layer_args
from sp_jax.layers.gemm import LayerGemm, layer_gemm
from sp_jax.layers.lora import (
    LORA_SALT,
    LoRAParts,
    adapter_params,
    adapter_specs,
    base_spec,
    base_value,
    masked_b,
    quantized_base,
)
from sp_jax.layers.taps import layer_taps
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
from sp_jax.ops.deferred import local_taps, placed_taps
from sp_jax.ops.gemm import Gemm
from sp_jax.ops.lora import LoRAGemm, LoRAKernel
from sp_jax.ops.quant import kernel_dtype

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ColumnSequenceParallelLinear",
    "RowSequenceParallelLinear",
    "column_sp_matmul",
    "decode_layout",
    "shard_linear",
]

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()

Initializer = Callable[..., jax.Array]


def shard_linear(local: Callable[..., jax.Array], x: jax.Array, x_spec: P, out_spec: P,
                 params: Sequence[tuple[jax.Array | None, P]], *, parallel: ParallelConfig,
                 gemm: LayerGemm | None = None, taps: Any = None,
                 where: str = "shard_linear") -> jax.Array:
    """The shard_map plumbing of a parallel linear layer: ``local(x, *params, **kwargs)``
    per device, in one :func:`jax.shard_map` over the current mesh of ``parallel``.

    ``x`` is resharded to ``x_spec`` and each parameter (``None`` stays ``None``, e.g. a
    missing bias) to its spec; the layer's GEMM (:class:`~sp_jax.layers.gemm.LayerGemm`)
    reaches ``local`` as the ops' keyword arguments ``gemm`` (its op face) and
    ``gemm_state`` (its state, replicated; none without ``gemm``). Used by every parallel
    linear layer, the grouped-query projection and the GPT's LM head.

    Args:
      local: the per-device computation, ``local(x, *params, **kwargs) -> y``.
      x: the global input; x_spec / out_spec: the activations' specs in and out.
      params: ``(value, spec)`` of each global parameter, in ``local``'s order.
      parallel: the :class:`~sp_jax.ParallelConfig` (its mesh is the current one).
      gemm: the layer's :class:`~sp_jax.layers.gemm.LayerGemm`, or None (the ops'
        default GEMM, in the compute dtype).
      taps: the layer's weight-gradient taps (:func:`~sp_jax.layers.taps.layer_taps`),
        or None; ``local`` gets the first op's as the ops' keyword argument ``tap``.
      where: the caller's name, for errors.
    Returns:
      ``local``'s output, sharded ``out_spec``.
    """
    mesh = current_mesh(parallel, where=where)
    args = [reshard(x, x_spec, mesh)]
    in_specs = [x_spec]
    for value, spec in (*params, (None if gemm is None else gemm.state_value(), P())):
        # a pytree value (an adapted or a quantized kernel) with its pytree of specs
        args.append(None if value is None else jax.tree.map(
            lambda p, v: reshard(v, p, mesh), spec, value,
            is_leaf=lambda v: isinstance(v, P)))
        in_specs.append(None if value is None else spec)

    def body(x, taps, *rest):
        *values, state = rest
        kwargs = {} if gemm is None else {"gemm": gemm.op, "gemm_state": state}
        if taps is not None:
            kwargs["tap"] = local_taps(taps)
        return local(x, *values, **kwargs)

    taps, tap_in_specs = placed_taps(taps, mesh)
    return jax.shard_map(body, in_specs=(in_specs[0], tap_in_specs, *in_specs[1:]),
                         out_specs=out_spec)(args[0], taps, *args[1:])


def decode_layout(parallel: ParallelConfig) -> Layout:
    """The layout of the single-token (decode) mode: training's tensor split, nothing
    over the data axes (no fsdp)."""
    return dataclasses.replace(Layout.of(parallel), fsdp_axes=())


class _ParallelLinear(nnx.Module):
    """Parameters, validation and the shard_map call shared by the four layers.

    Subclasses set ``_split_in`` (row layers: the kernel's input dimension is sharded;
    column layers: its output dimension) and ``_sequence_parallel``, and implement
    ``_specs`` and ``_local``.
    """

    _split_in: bool = False
    _sequence_parallel: bool = False
    input_is_parallel: bool = True  # the options of RowParallelLinear and
    gather_output: bool = False     # ColumnParallelLinear (fixed for the others)

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
        gemm: Gemm | None = None,
        lora: LoRAConfig | None = None,
        lora_parts: LoRAParts | None = None,
        rngs: nnx.Rngs,
    ):
        name = type(self).__name__
        check_layer_args(name, parallel, in_features=in_features, out_features=out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.parallel = parallel
        self.dtype = dtype
        self.param_dtype = param_dtype
        mesh = current_mesh(parallel, where=name, required=False)
        self.lora_parts = lora_parts if lora_parts is not None else LoRAParts(
            ("o",) if self._split_in else ("q",))  # a lone layer: one adapter
        self.lora = lora
        if lora is not None and (fp8 is not None or gemm is not None):
            raise ValueError(f"{name}: lora={lora!r} with fp8={fp8!r} / gemm={gemm!r}: the "
                             "adapters multiply in the compute dtype; pass fp8=None and "
                             "gemm=None (or lora=None).")

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
        # adapters from a key of the kernel's: the base draws what it draws without them
        self.lora_a, self.lora_b = adapter_params(
            name, lora, self.lora_parts, in_features, out_features, split_in=self._split_in,
            layout=Layout.of(parallel), key=jax.random.fold_in(kernel_key, LORA_SALT),
            dtype=param_dtype, eager=mesh is not None)
        if self.lora_a is None:
            self.lora = None
        elif self.lora.base_dtype is not None:  # QLoRA: the frozen base stored in fewer bits
            self.kernel = quantized_base(self.kernel[...], P(*kernel_axes),
                                         self.lora.base_dtype, mesh)
        self.gemm = layer_gemm(name, fp8, gemm if self.lora is None else LoRAGemm(
            scale=self.lora.scale), parallel, eager=mesh is not None)
        self.fp8_history = self.gemm.state  # the GEMM's state at the layer's path
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

    def _param_specs(self, layout: Layout) -> tuple[P, P]:
        """(kernel spec, bias spec): row layers split the input features, column layers
        the output features."""
        if self._split_in:
            return layout.row_kernel, layout.row_bias
        return layout.column_kernel, layout.column_bias

    def weight_grad_covers(self) -> tuple[str, ...]:
        """The parameters whose gradients this layer's op can defer (a weight-gradient
        tap, :mod:`sp_jax.layers.taps`): the kernel, the bias, the amax history."""
        names = ["kernel"]
        if self.bias is not None:
            names.append("bias")
        if self.fp8_history is not None:
            names.append("fp8_history")
        return tuple(names)

    def param_specs(self, layout: Layout, mesh: Mesh | None = None) -> dict[str, P]:
        """The spec of each parameter by name (``kernel``, ``bias``; ``lora_a``,
        ``lora_b`` with adapters) in ``layout``: training's (``Layout.of(parallel)``) or
        the single-token mode's (:func:`decode_layout`). ``mesh`` is not needed here
        (the grouped-query projection's spec depends on it)."""
        specs = dict(zip(("kernel", "bias"), self._param_specs(layout), strict=True))
        if self.lora_a is not None:
            specs.update(zip(("lora_a", "lora_b"), adapter_specs(layout, self._split_in),
                             strict=True))
        return specs

    def _kernel_and_spec(self, layout: Layout, kernel: jax.Array, spec: P, mask: bool):
        """The op's kernel and its spec: the base's, or with adapters a
        :class:`~sp_jax.ops.lora.LoRAKernel` of the base and adapters (``lora_b``
        masked to each adapter's columns with ``mask``: training)."""
        if self.lora_a is None:
            return kernel, spec
        b = self.lora_b[...]
        if mask:
            b = masked_b(b, self.lora_parts, self.lora)
        return (LoRAKernel(kernel, self.lora_a[...], b),
                LoRAKernel(base_spec(kernel, spec), *adapter_specs(layout, self._split_in)))

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
        if self.parallel.fsdp_axes:  # the other kernel dimension is sharded over the data axes
            arg, size = (("out_features", self.out_features) if self._split_in
                         else ("in_features", self.in_features))
            check_divisible(
                f"{name} (fsdp)", arg, size, mesh, self.parallel.fsdp_axes,
                f"choose {arg} as a multiple of the data-parallel size, or fsdp=False")

    def _check_input(self, x: jax.Array, mesh: Mesh, decode: bool = False) -> None:
        name = type(self).__name__
        check_activations(name, x, self.in_features, "in_features", fix=False)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{name}: input dtype {x.dtype} is not floating point; cast the input "
                "(e.g. x.astype(jnp.float32))."
            )
        if decode:  # one token per row: nothing splits the sequence
            check_batch_and_sequence(name, mesh, self.parallel, x.shape[0])
            return
        check_batch_and_sequence(name, mesh, self.parallel, x.shape[0],
                                 x.shape[1] if self._sequence_parallel else None,
                                 length=x.shape[1])

    # -- forward ------------------------------------------------------------------------

    def _specs(self, layout: Layout) -> tuple[P, P]:
        """(input spec, output spec) of the activations."""
        raise NotImplementedError

    def _decode_specs(self, layout: Layout) -> tuple[P, P]:
        """(input spec, output spec) of the activations in the single-token mode: column
        layers take whole rows and give their column block (whole rows with
        ``gather_output``), row layers the reverse (whole rows in without
        ``input_is_parallel``)."""
        if self._split_in:
            x_spec = layout.tp if self.input_is_parallel else layout.tensor_replicated
            return x_spec, layout.tensor_replicated
        return layout.tensor_replicated, (layout.tensor_replicated if self.gather_output
                                          else layout.tp)

    def _local(self, x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
               activation=None, **gemm: Any) -> jax.Array:
        """The per-device computation (inside ``shard_map``); ``gemm``: the ops' keyword
        arguments from :func:`shard_linear` (``gemm``, ``gemm_state``, ``tap``)."""
        raise NotImplementedError

    def _decode(self, x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                activation=None) -> jax.Array:
        """Per device, the single-token mode: this device's block of the product, summed
        over the tensor axis (one all-reduce) by row layers."""
        t = self.parallel.tensor_axis
        if activation is not None:
            x = activation(x)
        if not self.input_is_parallel:
            x = ops.split_with_all_gather_grad(x, t, dim=-1)
        y = ops.decode_matmul(x, kernel, bias, axis_name=t if self._split_in else None,
                              gemm=None if self.lora is None else self.gemm.op)
        if self.gather_output:
            y = ops.all_gather_with_split_grad(y, t, dim=-1)
        return y

    def local_decode(self, x: jax.Array, *, activation=None) -> jax.Array:
        """The single-token (decode) mode per device, inside a ``shard_map`` whose copy of
        this layer holds its blocks of the decode layout (:func:`decode_layout`; what
        generation runs): ``x`` ``[b, 1, in]`` whole rows (column layers) or this
        device's feature block (row layers) -> this device's column block (no
        collective) or the whole row (one all-reduce over the tensor axis), in the
        compute dtype (no FP8). Forward only."""
        kernel = base_value(self.kernel)
        dtype = self.dtype if self.dtype is not None else jnp.result_type(
            x.dtype, kernel_dtype(kernel))
        if self.lora_a is not None:  # lora_b's entries outside its parts are zeros
            kernel = LoRAKernel(kernel, self.lora_a[...], self.lora_b[...])
        return self._decode(x.astype(dtype), kernel,
                            None if self.bias is None else self.bias[...], activation)

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        """Applies the layer to a global ``[batch, seq, in_features]`` array.

        With ``decode``, the single-token mode (generation: ``seq = 1``, activations whole
        over the tensor axis): column layers take ``P(data, None, None)`` and multiply
        their own column block (no collective), row layers take ``P(data, None, tensor)``
        and all-reduce their partial products (no reduce-scatter); parameters in
        :func:`decode_layout`; compute dtype, forward only.

        Returns ``[batch, seq, out_features]`` in the compute dtype (``dtype``, or the
        promoted dtype of input and parameters) with the layer's output sharding.
        """
        return self._apply(x, decode=decode)

    def _apply(self, x: jax.Array, activation=None, decode: bool = False) -> jax.Array:
        """:meth:`__call__`, with ``activation`` (if given) handed to :meth:`_local`."""
        mesh = current_mesh(self.parallel, where=type(self).__name__)
        self._check_features(mesh)
        x = jnp.asarray(x)
        self._check_input(x if activation is None else jax.eval_shape(activation, x), mesh,
                          decode)
        kernel = base_value(self.kernel)
        bias = self.bias[...] if self.bias is not None else None
        dtype = self.dtype if self.dtype is not None else jnp.result_type(
            x.dtype, kernel_dtype(kernel))
        if decode:
            layout, local, gemm, taps = decode_layout(self.parallel), self._decode, None, None
            x_spec, out_spec = self._decode_specs(layout)
        else:
            layout, local, gemm = Layout.of(self.parallel), self._local, self.gemm
            x_spec, out_spec = self._specs(layout)
            taps = layer_taps(self)
        if activation is not None:
            local = functools.partial(local, activation=activation)
        kernel_spec, bias_spec = self._param_specs(layout)
        kernel, kernel_spec = self._kernel_and_spec(layout, kernel, kernel_spec, not decode)
        return shard_linear(local, x.astype(dtype), x_spec, out_spec,
                            ((kernel, kernel_spec), (bias, bias_spec)),
                            parallel=self.parallel, gemm=gemm, taps=taps,
                            where=type(self).__name__)


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
      gemm: instead of ``fp8``, the GEMM object the layer multiplies with
        (:class:`~sp_jax.ops.gemm.ComputeGemm`, :class:`~sp_jax.ops.fp8.Fp8Gemm`); the
        layer holds it and its state as ``gemm``, a
        :class:`~sp_jax.layers.gemm.LayerGemm`.
      rngs: rng streams; one ``params`` draw for the kernel and one for the bias.
    """

    def __init__(self, in_features: int, out_features: int, *, gather_output: bool = False,
                 **kwargs: Any):
        super().__init__(in_features, out_features, **kwargs)
        self.gather_output = gather_output

    def _specs(self, layout):
        return self._decode_specs(layout)  # a sequence of one token or many: the same

    def _local(self, x, kernel, bias, activation=None, **gemm):
        t, wd = self.parallel.tensor_axis, self.parallel.wgrad_dtype
        y = ops.column_parallel_matmul(
            x, kernel, bias, axis_name=t, wgrad_dtype=wd, fsdp_axes=self.parallel.fsdp_axes,
            offload_activations=self.parallel.offload_activations, **gemm)
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
        return self._decode_specs(layout)  # a sequence of one token or many: the same

    def _local(self, x, kernel, bias, activation=None, **gemm):
        t, wd = self.parallel.tensor_axis, self.parallel.wgrad_dtype
        if not self.input_is_parallel:
            x = ops.split_with_all_gather_grad(x, t, dim=-1)
        return ops.row_parallel_matmul(
            x, kernel, bias, axis_name=t, wgrad_dtype=wd, fsdp_axes=self.parallel.fsdp_axes,
            offload_activations=self.parallel.offload_activations, **gemm)


def column_sp_matmul(x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                     parallel: ParallelConfig, **gemm: Any) -> jax.Array:
    """Per device (inside ``shard_map``): :func:`sp_jax.ops.column_sequence_parallel_matmul`
    of the sequence shard ``x [b, s / t, in]`` with this device's column block ``kernel``
    (and ``bias``), with every option of ``parallel`` (recompute, wgrad dtype, collective
    matmul, fsdp) and the ops' keyword arguments ``gemm`` (its ``gemm``, ``gemm_state``
    and ``tap``). Shared by :class:`ColumnSequenceParallelLinear`, the grouped-query
    projection and the GPT's LM head."""
    return ops.column_sequence_parallel_matmul(
        x, kernel, bias,
        axis_name=parallel.tensor_axis,
        seq_dim=1,
        recompute_allgather=parallel.recompute_allgather,
        wgrad_dtype=parallel.wgrad_dtype,
        collective_matmul=parallel.collective_matmul,
        fsdp_axes=parallel.fsdp_axes,
        offload_activations=parallel.offload_activations,
        **gemm,
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

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        if not decode:
            warn_if_recompute_may_be_merged(self.parallel)
        return super().__call__(x, decode=decode)

    def _local(self, x, kernel, bias, activation=None, **gemm):
        return column_sp_matmul(x, kernel, bias, self.parallel, **gemm)


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

    def __call__(self, x: jax.Array, *, activation=None, decode: bool = False) -> jax.Array:
        """Applies the layer to a global ``[batch, seq, in_features]`` array, or, with
        ``activation``, to ``activation(x)``; ``decode``: the single-token mode
        (:meth:`_ParallelLinear.__call__`), the activation applied per device first.

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
        return self._apply(x, activation, decode)

    def _specs(self, layout):
        return layout.tp, layout.sp

    def _local(self, x, kernel, bias, activation=None, **gemm):
        cfg = self.parallel
        return ops.row_sequence_parallel_matmul(
            x, kernel, bias, axis_name=cfg.tensor_axis, seq_dim=1, wgrad_dtype=cfg.wgrad_dtype,
            collective_matmul=cfg.collective_matmul, fsdp_axes=cfg.fsdp_axes,
            activation=activation, offload_activations=cfg.offload_activations, **gemm)
