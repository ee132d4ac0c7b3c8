"""The fused q/k/v projection of grouped-query attention, sequence-parallel (Flax NNX)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from sp_jax import ops
from sp_jax.config import ParallelConfig
from sp_jax.layers.block_config import AttentionConfig, kv_heads_replicated
from sp_jax.layers.gemm import layer_gemm
from sp_jax.layers.linear import column_sp_matmul, decode_layout, shard_linear
from sp_jax.layers.lora import (
    LORA_SALT,
    LoRAParam,
    LoRAParts,
    adapter_specs,
    base_spec,
    base_value,
    initial_a,
    initial_b,
    masked_b,
    quantized_base,
)
from sp_jax.layers.taps import layer_taps
from sp_jax.layout import Layout
from sp_jax.mesh import (
    Mesh,
    axis_size,
    check_activations,
    check_divisible,
    current_mesh,
    warn_if_recompute_may_be_merged,
)
from sp_jax.ops.lora import LoRAGemm, LoRAKernel
from sp_jax.ops.quant import kernel_dtype

__all__ = ["GroupedQKVProjection"]


class GroupedQKVProjection(nnx.Module):
    """The fused q/k/v projection of grouped-query attention, sequence-parallel.

    Two parameters with mesh-independent global shapes: ``q_kernel [hidden, heads *
    head_dim]`` (columns ``(head, head_dim)``) and ``kv_kernel [hidden, kv_heads * 2 *
    head_dim]`` (columns ``(kv_head, {k, v}, head_dim)``), and biases ``q_bias`` /
    ``kv_bias`` with ``config.qkv_bias``. ``q_kernel`` is split by columns over the
    tensor axis like a :class:`~sp_jax.layers.ColumnSequenceParallelLinear`;
    ``kv_kernel`` too when the tensor size ``t`` divides ``kv_heads``, else (``t`` a
    multiple of ``kv_heads``) it is replicated over the tensor axis and shard ``i`` uses
    kv head ``i * kv_heads / t``: the one its query heads read (Megatron's rule,
    :func:`~sp_jax.layers.kv_heads_per_shard`; its gradient is summed over the shards
    sharing it).

    Per device the two column blocks are concatenated into one kernel and applied by ONE
    :func:`sp_jax.ops.column_sequence_parallel_matmul`: one all-gather of the input per
    block, with every option of the parallel config (``recompute_allgather``,
    ``collective_matmul``, ``wgrad_dtype``, ``fsdp``).

    Shapes: input ``[b, s, hidden]`` ``P(data, tensor, None)``; output ``[b, s, t *
    width]`` ``P(data, None, tensor)`` where shard ``i``'s ``width = (heads / t + 2 *
    kv_local) * head_dim`` columns are its query heads then ``(kv_head, {k, v},
    head_dim)`` of its ``kv_local`` key/value heads.

    Args:
      config: the :class:`~sp_jax.layers.AttentionConfig` (``hidden``, ``num_heads``,
        ``num_kv_heads``, ``qkv_bias``, ``dtype``, ``param_dtype`` are used).
      parallel: the :class:`~sp_jax.ParallelConfig`.
      rngs: two ``params`` draws, q then kv (biases start at zero).
    """

    def __init__(self, config: AttentionConfig, *, parallel: ParallelConfig = ParallelConfig(),
                 rngs: nnx.Rngs):
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"GroupedQKVProjection: config must be an AttentionConfig, got "
                            f"{type(config).__name__}.")
        self.config, self.parallel = config, parallel
        hidden, dtype = config.hidden, config.param_dtype
        q_width, kv_width = config.num_heads * config.head_dim, \
            2 * config.num_kv_heads * config.head_dim
        mesh = current_mesh(parallel, where="GroupedQKVProjection", required=False)
        kv_kernel_spec, kv_bias_spec = self._kv_specs(mesh)
        layout, eager = Layout.of(parallel), mesh is not None
        init = nnx.initializers.lecun_normal()
        q_key = rngs.params()
        self.q_kernel = nnx.Param(init(q_key, (hidden, q_width), dtype),
                                  out_sharding=tuple(layout.column_kernel), eager_sharding=eager)
        self.kv_kernel = nnx.Param(init(rngs.params(), (hidden, kv_width), dtype),
                                   out_sharding=tuple(kv_kernel_spec), eager_sharding=eager)
        self.q_bias: nnx.Param | None
        self.kv_bias: nnx.Param | None
        if config.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((q_width,), dtype),
                                    out_sharding=tuple(layout.column_bias), eager_sharding=eager)
            self.kv_bias = nnx.Param(jnp.zeros((kv_width,), dtype),
                                     out_sharding=tuple(kv_bias_spec), eager_sharding=eager)
        else:
            self.q_bias = self.kv_bias = None
        # LoRA: one lora_a [hidden, n * r] for the targeted q, k, v (replicated) and
        # lora_b's rows split in the q and kv kernels' column layouts
        self.lora_adapters = () if config.lora is None else tuple(
            t for t in ("q", "k", "v") if t in config.lora.targets)
        self.lora = config.lora if self.lora_adapters else None
        self.lora_a, self.q_lora_b, self.kv_lora_b = self._adapters(
            q_key, hidden, q_width, kv_width, kv_kernel_spec, layout, eager)
        if self.lora is not None and self.lora.base_dtype is not None:  # QLoRA
            self.q_kernel = quantized_base(self.q_kernel[...], layout.column_kernel,
                                           self.lora.base_dtype, mesh)
            self.kv_kernel = quantized_base(self.kv_kernel[...], kv_kernel_spec,
                                            self.lora.base_dtype, mesh)
        # one GEMM (and amax history) for q, k and v; its state at the layer's path
        self.gemm = layer_gemm("GroupedQKVProjection", config.fp8,
                               None if self.lora is None else LoRAGemm(scale=self.lora.scale),
                               parallel, eager=eager)
        self.fp8_history = self.gemm.state

    def _adapters(self, q_key, hidden: int, q_width: int, kv_width: int, kv_kernel_spec: P,
                  layout: Layout, eager: bool) -> tuple:
        """``(lora_a, q_lora_b, kv_lora_b)`` (:class:`~sp_jax.layers.lora.LoRAParam`), or
        Nones without targeted q/k/v: one ``lora_a [hidden, n * r]`` for the ``n``
        targeted projections (replicated), ``lora_b``'s rows in the q and kv kernels'
        column layouts (split as those kernels are)."""
        if self.lora is None:
            return None, None, None
        width, dtype = len(self.lora_adapters) * self.lora.rank, self.config.param_dtype
        a_spec, b_spec = adapter_specs(layout, False)
        return (LoRAParam(initial_a(jax.random.fold_in(q_key, LORA_SALT), (hidden, width),
                                    dtype),
                          out_sharding=tuple(a_spec), eager_sharding=eager),
                LoRAParam(initial_b(jax.random.fold_in(q_key, LORA_SALT + 1), (width, q_width),
                                    dtype, self.lora, LoRAParts(("q",)), self.lora_adapters),
                          out_sharding=tuple(b_spec), eager_sharding=eager),
                LoRAParam(initial_b(jax.random.fold_in(q_key, LORA_SALT + 2),
                                    (width, kv_width), dtype, self.lora,
                                    LoRAParts(("k", "v"), self.config.head_dim),
                                    self.lora_adapters),
                          out_sharding=(None, kv_kernel_spec[1]), eager_sharding=eager))

    def _replicated(self, mesh: Mesh | None) -> bool:
        """Whether the key/value heads are replicated over the tensor axis."""
        if mesh is None:
            return False
        return kv_heads_replicated(self.config.num_kv_heads,
                                   axis_size(mesh, self.parallel.tensor_axis),
                                   "GroupedQKVProjection")

    def _kv_specs(self, mesh: Mesh | None, layout: Layout | None = None):
        layout = Layout.of(self.parallel) if layout is None else layout
        if self._replicated(mesh):
            return layout.spec("embed", None), P(None)
        return layout.column_kernel, layout.column_bias

    def param_specs(self, layout: Layout, mesh: Mesh | None = None) -> dict[str, P]:
        """The spec of each parameter by name in ``layout`` (training's, or
        :func:`~sp_jax.layers.linear.decode_layout`) on ``mesh`` (whose tensor size says
        whether the key/value heads are split or replicated; None: split)."""
        kv_kernel, kv_bias = self._kv_specs(mesh, layout)
        specs = {"q_kernel": layout.column_kernel, "kv_kernel": kv_kernel,
                 "q_bias": layout.column_bias, "kv_bias": kv_bias}
        if self.lora_a is not None:
            specs |= {"lora_a": P(None, None), "q_lora_b": P(None, layout.column_kernel[1]),
                      "kv_lora_b": P(None, kv_kernel[1])}
        return specs

    def lora_b_masked(self) -> tuple[jax.Array, jax.Array]:
        """``(q_lora_b, kv_lora_b)`` with each adapter's rows zeroed outside its part's
        columns (``q_kernel``'s are q's; ``kv_kernel``'s ``(kv_head, {k, v},
        head_dim)``)."""
        lora, names = self.lora, self.lora_adapters
        return (masked_b(self.q_lora_b[...], LoRAParts(("q",)), lora, names),
                masked_b(self.kv_lora_b[...], LoRAParts(("k", "v"), self.config.head_dim),
                         lora, names))

    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        """``x``: ``[batch, seq, hidden]`` in the SP layout -> the per-shard blocks above.

        With ``decode``, the single-token mode (generation): ``x`` ``[batch, 1, hidden]``
        whole over the tensor axis (``P(data, None, None)``), each shard multiplying its
        own ``[hidden, width]`` block (no collective); parameters without the fsdp split
        (:func:`~sp_jax.layers.linear.decode_layout`); compute dtype, forward only."""
        par, cfg = self.parallel, self.config
        mesh = current_mesh(par, where="GroupedQKVProjection")
        x = jnp.asarray(x)
        check_activations("GroupedQKVProjection", x, cfg.hidden, "hidden")
        if not decode:
            warn_if_recompute_may_be_merged(par)
        check_divisible("GroupedQKVProjection", "num_heads", cfg.num_heads, mesh,
                        par.tensor_axis, "choose a head count that is a multiple of the "
                        "tensor-parallel size")
        replicated = self._replicated(mesh)
        layout = decode_layout(par) if decode else Layout.of(par)
        specs = self.param_specs(layout, mesh)
        q_kernel = base_value(self.q_kernel)
        dtype = cfg.dtype if cfg.dtype is not None else jnp.result_type(
            x.dtype, kernel_dtype(q_kernel))
        params = tuple((None if v is None else base_value(v),
                        None if v is None else base_spec(base_value(v), specs[name]))
                       for name, v in (("q_kernel", self.q_kernel),
                                       ("kv_kernel", self.kv_kernel),
                                       ("q_bias", self.q_bias), ("kv_bias", self.kv_bias)))
        if self.lora_a is not None:
            q_b, kv_b = self.lora_b_masked()
            params += ((self.lora_a[...], specs["lora_a"]), (q_b, specs["q_lora_b"]),
                       (kv_b, specs["kv_lora_b"]))

        def local(x, q_kernel, kv_kernel, q_bias, kv_bias, *adapters, **gemm):
            kernel, bias = self.local_kernel(q_kernel, kv_kernel, q_bias, kv_bias, replicated)
            kernel = self._with_adapters(kernel, adapters, replicated)
            if decode:
                return ops.decode_matmul(x, kernel, bias, gemm=self._decode_gemm())
            return column_sp_matmul(x, kernel, bias, par, **gemm)

        return shard_linear(local, x.astype(dtype),
                            layout.tensor_replicated if decode else layout.sp, layout.tp,
                            params, parallel=par, gemm=None if decode else self.gemm,
                            taps=None if decode else layer_taps(self),
                            where="GroupedQKVProjection")

    def _with_adapters(self, kernel, adapters, replicated: bool):
        """Per device: ``kernel``, or with adapters ``(lora_a, q_lora_b, kv_lora_b)``
        (their blocks) the :class:`~sp_jax.ops.lora.LoRAKernel` of it and them, the
        ``lora_b`` blocks laid out as the kernel's columns."""
        if not adapters:
            return kernel
        lora_a, q_b, kv_b = adapters
        b, _ = self.local_kernel(q_b, kv_b, None, None, replicated)
        return LoRAKernel(kernel, lora_a, b)

    def _decode_gemm(self):
        return None if self.lora is None else self.gemm.op

    def weight_grad_covers(self) -> tuple[str, ...]:
        """The parameters whose gradients the projection's op can defer (a
        weight-gradient tap, :mod:`sp_jax.layers.taps`)."""
        names = ("q_kernel", "kv_kernel") + (("q_bias", "kv_bias") if self.q_bias is not None
                                             else ())
        return names + (("fp8_history",) if self.fp8_history is not None else ())

    def local_decode(self, x: jax.Array) -> jax.Array:
        """The single-token (decode) mode per device, inside a ``shard_map`` whose copy of
        this projection holds its blocks of the decode layout: this shard's q/k/v columns
        of whole rows ``x`` ``[b, 1, hidden]`` (no collective), compute dtype."""
        kernel, bias = self.local_kernel(
            base_value(self.q_kernel), base_value(self.kv_kernel),
            None if self.q_bias is None else self.q_bias[...],
            None if self.kv_bias is None else self.kv_bias[...],
            kv_heads_replicated(self.config.num_kv_heads,
                                lax.axis_size(self.parallel.tensor_axis),
                                "GroupedQKVProjection"))
        dtype = self.config.dtype
        if dtype is None:
            dtype = jnp.result_type(x.dtype, kernel_dtype(kernel))
        if self.lora_a is not None:  # lora_b's entries outside its parts are zeros
            kernel = self._with_adapters(kernel, (self.lora_a[...], self.q_lora_b[...],
                                                  self.kv_lora_b[...]),
                                         kv_heads_replicated(
                                             self.config.num_kv_heads,
                                             lax.axis_size(self.parallel.tensor_axis),
                                             "GroupedQKVProjection"))
        return ops.decode_matmul(x.astype(dtype), kernel, bias, gemm=self._decode_gemm())

    def local_kernel(self, q_kernel: jax.Array, kv_kernel: jax.Array,
                     q_bias: jax.Array | None, kv_bias: jax.Array | None, replicated: bool
                     ) -> tuple[jax.Array, jax.Array | None]:
        """Per device (inside ``shard_map`` over the tensor axis): this shard's ``[hidden,
        width]`` kernel (and ``[width]`` bias) from its ``q_kernel`` column block and its
        ``kv_kernel`` block, or, when the key/value heads are ``replicated`` over the
        tensor axis (all of them here), the one its query heads read."""
        cfg = self.config
        if replicated:  # this shard's kv head out of all of them
            width = 2 * cfg.head_dim
            group = lax.axis_size(self.parallel.tensor_axis) // cfg.num_kv_heads
            start = lax.axis_index(self.parallel.tensor_axis) // group * width
            kv_kernel = jax.tree.map(  # (every array of a quantized kernel: its columns)
                lambda k: lax.dynamic_slice_in_dim(k, start, width, axis=-1), kv_kernel)
            if kv_bias is not None:
                kv_bias = lax.dynamic_slice_in_dim(kv_bias, start, width, axis=0)
        kernel = jax.tree.map(lambda q, kv: jnp.concatenate([q, kv], axis=-1), q_kernel,
                              kv_kernel)
        bias = None if q_bias is None else jnp.concatenate([q_bias, kv_bias])
        return kernel, bias
