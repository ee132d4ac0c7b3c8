"""Linear ops across the tensor axis: matmuls whose collectives and weight gradients are
one custom VJP each (``decode_matmul``, decoding's single-token product, is forward
only), and the one dispatch to their plain, collective-matmul, FP8, FSDP and deferred
forms.

=====================================  ==============================  ===========================
op                                     forward                         backward
=====================================  ==============================  ===========================
``matmul``                             local ``x @ kernel``            dx and dW (``wgrad_dtype``)
``add_bias``                           ``y + bias``                    db in ``wgrad_dtype``
``column_parallel_matmul``             identity into the TP region,    all-reduce of dx while dW
                                       matmul                          is computed
``row_parallel_matmul``                matmul, all-reduce, ``+ bias``  identity, db, dx and dW
``column_sequence_parallel_matmul``    all-gather of the sequence,     reduce-scatter of dx (and
                                       matmul                          re-gather of x)
``row_sequence_parallel_matmul``       matmul, reduce-scatter of the   one all-gather of dy
                                       sequence                        feeding dx and dW
``decode_matmul``                      local matmul of one token; a    (forward only: decoding)
                                       row layer's all-reduce
=====================================  ==============================  ===========================

Every op is ONE rule (:mod:`sp_jax.ops.rules`: ``Matmul``, ``Row``, ``Column``,
``ColumnSequence``, ``RowSequence``, ``Decode``), a frozen dataclass holding what
varies: the GEMM object given as ``gemm=`` with its state as ``gemm_state=``
(:class:`~sp_jax.ops.gemm.ComputeGemm`, the default, in the compute dtype with weight
gradients in ``wgrad_dtype``, or :class:`~sp_jax.ops.fp8.Fp8Gemm` with its amax
history; the op binds its dtypes to it), the transport of the sequence-parallel ops
(:class:`~sp_jax.ops.transport.Collectives`, or :class:`~sp_jax.ops.transport.Ring`,
``collective_matmul=``) and the op's options. The rule becomes a custom-VJP op
(:func:`~sp_jax.ops.rules.linear_op`), in its FSDP form (:class:`~sp_jax.ops.fsdp.Fsdp`)
with the kernel sharded over the data axes (``fsdp_axes``); with a
weight-gradient ``tap``, the op in the tap's mode (:mod:`sp_jax.ops.deferred`).
:func:`_apply` is the one place that chooses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from sp_jax.ops.deferred import apply_deferred
from sp_jax.ops.fsdp import Fsdp, full_kernel
from sp_jax.ops.gemm import ComputeGemm, Gemm, bgrad, check_linear_shapes
from sp_jax.ops.primitives import (
    AxisName,
    canonical_dim,
    check_divisible,
    vary,
    vma,
)
from sp_jax.ops.rules import (
    Column,
    ColumnSequence,
    Decode,
    Matmul,
    Offloaded,
    Row,
    RowSequence,
    linear_op,
    varying,
)
from sp_jax.ops.transport import Collectives, Ring

__all__ = ["add_bias", "column_parallel_matmul", "column_sequence_parallel_matmul",
           "decode_matmul", "matmul", "row_parallel_matmul", "row_sequence_parallel_matmul"]


def _gemm(name: str, kernel, wgrad_dtype, gemm: Gemm | None, state) -> Gemm:
    """The GEMM object of an op (``gemm``, None: the compute dtype's) with the op's
    dtypes bound (the weight gradient in the kernel's own dtype), its state checked."""
    if gemm is None:
        gemm = ComputeGemm()
    if not isinstance(gemm, Gemm):
        raise TypeError(f"{name}: gemm={gemm!r} must be a GEMM object "
                        "(sp_jax.ops.gemm.ComputeGemm(), sp_jax.ops.fp8.Fp8Gemm(spec)) or "
                        "None.")
    gemm.check_state(name, state)
    return gemm.bound(wgrad_dtype, kernel.dtype)


def _transport(axis_name, seq_dim: int, collective_matmul: bool):
    """The ring with ``collective_matmul`` (over more than one device), else whole
    collectives."""
    if collective_matmul and lax.axis_size(axis_name) > 1:
        return Ring(axis_name, seq_dim)
    return Collectives(axis_name, seq_dim)


def _apply(rule, x, kernel, bias, state, fsdp_axes: tuple, fsdp_dim: int,
           offload: bool = False, tap=None, outer=None, kernel_axes=()) -> jax.Array:
    """Runs ``rule`` as one custom-VJP op: with ``kernel`` this device's shard over the
    data axes ``fsdp_axes`` along ``fsdp_dim`` (gathered inside the op,
    :class:`~sp_jax.ops.fsdp.Fsdp`); with ``offload`` its input residual lives in host
    memory (:class:`Offloaded`); with ``outer`` (a rule around the local product: the
    row op's sum and bias, :class:`~sp_jax.ops.rules.Row`) inside it; the kernel cast
    to vary over ``kernel_axes`` inside the op (:class:`~sp_jax.ops.rules.Varying`: its
    residual stays the caller's kernel); with a weight-gradient ``tap``, in the tap's
    mode (:func:`~sp_jax.ops.deferred.apply_deferred`: the weight gradient deferred, or
    computed alone)."""
    if offload:
        rule = Offloaded(rule)
    if fsdp_axes:
        rule = Fsdp(rule, fsdp_axes, fsdp_dim)
    if outer is not None:
        rule = outer(rule)
    rule, aux = varying(rule, kernel, kernel_axes), (bias, state)
    return apply_deferred(rule, x, kernel, aux, tap, lambda: linear_op(x, kernel, aux, rule))


def _vary_all(x, bias, kernel, axes) -> tuple:
    """``x`` and ``bias`` cast to vary over the union of their and ``kernel``'s mesh axes
    and ``axes`` (see :mod:`sp_jax.ops.primitives`), and that union: the axes the op
    casts the kernel to vary over (``_apply``'s ``kernel_axes``)."""
    union = vma(x) | vma(kernel) | set(axes) | (vma(bias) if bias is not None else set())
    return vary(x, union), vary(bias, union), union


# --------------------------------------------------------------------------------------
# The public ops
# --------------------------------------------------------------------------------------

def matmul(x: jax.Array, kernel: jax.Array, *, wgrad_dtype=None,
           fsdp_axes: tuple[AxisName, ...] = (), fsdp_dim: int = 1,
           gemm: Gemm | None = None, gemm_state: Any = None,
           offload_activations: bool = False, tap=None) -> jax.Array:
    """Local ``x @ kernel`` in the dtype of ``x``, with the weight gradient in ``wgrad_dtype``.

    Args:
      x: ``[..., in]`` activations in the compute dtype.
      kernel: ``[in, out]`` parameter in its own (master) dtype; cast to ``x.dtype``.
      wgrad_dtype: accumulation dtype of ``d kernel`` (``None``: as plain autodiff).
      fsdp_axes: data mesh axes the kernel is sharded over besides the tensor axis
        (``ParallelConfig(fsdp=True)``; ``kernel`` is then this device's shard along
        dimension ``fsdp_dim``): gathered just before the matmul, gathered again in the
        backward pass instead of kept, and the weight gradient reduce-scattered over them.
      fsdp_dim: the kernel dimension ``fsdp_axes`` shard (row layers: 1).
      gemm: the GEMM object the op multiplies with (:mod:`sp_jax.ops.gemm`):
        ``None`` (the default) or :class:`~sp_jax.ops.gemm.ComputeGemm` (the compute
        dtype), :class:`~sp_jax.ops.fp8.Fp8Gemm` (FP8); the op binds its dtypes.
      gemm_state: the GEMM's state: FP8 delayed scaling's ``[3, amax_history_len]`` fp32
        amax history (invariant over the mesh axes; its cotangent is this step's amaxes
        in column 0), else None.
      offload_activations: keep the residual this op's backward needs (its GEMM
        operand) in host memory between the passes (``ParallelConfig.offload_activations``,
        :class:`~sp_jax.ops.rules.Offloaded`); the same results.
      tap: a weight-gradient tap (:mod:`sp_jax.ops.deferred`: ``Taps.site(i)`` of a
        layer's taps, inside its ``shard_map``), or None: the weight gradient computed
        with the input gradient.
    Returns:
      ``[..., out]`` in ``x.dtype``.
    """
    fsdp_axes = tuple(fsdp_axes)
    check_linear_shapes("matmul", x, full_kernel(kernel, fsdp_axes, fsdp_dim))
    gemm = _gemm("matmul", kernel, wgrad_dtype, gemm, gemm_state)
    x, _, union = _vary_all(x, None, kernel, fsdp_axes)
    return _apply(Matmul(gemm), x, kernel, None, gemm_state, fsdp_axes, fsdp_dim,
                  offload_activations, tap, kernel_axes=union)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add_bias(y, bias, wgrad_dtype):
    return y + bias.astype(y.dtype)


def _add_bias_fwd(y, bias, wgrad_dtype):
    return _add_bias(y, bias, wgrad_dtype), bias


def _add_bias_bwd(wgrad_dtype, bias, g):
    return g, bgrad(g, wgrad_dtype, bias.dtype)


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def add_bias(y: jax.Array, bias: jax.Array | None, *, wgrad_dtype=None) -> jax.Array:
    """``y + bias`` in the dtype of ``y``; ``d bias`` is summed in ``wgrad_dtype``."""
    if bias is None:
        return y
    if bias.shape != y.shape[-1:]:
        raise ValueError(f"add_bias: bias shape {bias.shape} does not match y {y.shape}.")
    return _add_bias(y, vary(bias, vma(y)), wgrad_dtype)


def column_parallel_matmul(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis_name: AxisName,
    wgrad_dtype=None,
    fsdp_axes: tuple[AxisName, ...] = (),
    gemm: Gemm | None = None,
    gemm_state: Any = None,
    offload_activations: bool = False,
    tap=None,
) -> jax.Array:
    """``x @ kernel + bias`` entering a tensor-parallel region from replicated activations
    (``identity_with_all_reduce_grad`` and the matmul as one op, Megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication``).

    The forward is a local matmul (no collective). The backward all-reduces ``dx = g @
    kernel.T`` over ``axis_name`` while the weight-gradient GEMM runs, and releases both
    together.

    Args:
      x: ``[..., in]`` replicated over ``axis_name``, compute dtype.
      kernel: local column block ``[in, out / t]``.
      bias: local ``[out / t]`` or ``None``.
      axis_name: the tensor mesh axis.
      wgrad_dtype: accumulation dtype of the weight and bias gradients.
      fsdp_axes: as :func:`matmul`, the kernel sharded along dimension 0.
      gemm, gemm_state, offload_activations, tap: as :func:`matmul`.
    Returns:
      ``[..., out / t]`` in ``x.dtype``, varying over ``axis_name``.
    """
    fsdp_axes = tuple(fsdp_axes)
    gemm = _gemm("column_parallel_matmul", kernel, wgrad_dtype, gemm, gemm_state)
    check_linear_shapes("column_parallel_matmul", x, full_kernel(kernel, fsdp_axes, 0), bias)
    if axis_name in vma(x):
        raise TypeError(
            f"column_parallel_matmul expects an input replicated over {axis_name!r}, but it "
            f"already varies over that axis (type {jax.typeof(x)}); use "
            "column_sequence_parallel_matmul to enter the region from sharded activations."
        )
    union = vma(x) | vma(kernel) | {axis_name} | set(fsdp_axes)
    if bias is not None:
        union |= vma(bias)
    return _apply(Column(gemm, axis_name), vary(x, union - {axis_name}), kernel,
                  vary(bias, union), gemm_state, fsdp_axes, 0, offload_activations, tap,
                  kernel_axes=union)


def row_parallel_matmul(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                        axis_name: AxisName, wgrad_dtype=None,
                        fsdp_axes: tuple[AxisName, ...] = (), gemm: Gemm | None = None,
                        gemm_state: Any = None, offload_activations: bool = False,
                        tap=None) -> jax.Array:
    """``psum(x @ kernel, axis_name) + bias``: the exit from a tensor-parallel region into
    replicated activations (the matmul, ``all_reduce_with_identity_grad`` and the bias as
    one op, :class:`~sp_jax.ops.rules.Row`).

    Args:
      x: ``[..., in / t]`` this device's features, compute dtype.
      kernel: local row block ``[in / t, out]``; bias: ``[out]`` (replicated over
        ``axis_name``) or None, added once after the sum.
      axis_name: the tensor mesh axis.
      wgrad_dtype: accumulation dtype of the weight and bias gradients.
      fsdp_axes: as :func:`matmul`, the kernel sharded along dimension 1.
      gemm, gemm_state, offload_activations, tap: as :func:`matmul`.
    Returns:
      ``[..., out]`` in ``x.dtype``, invariant over ``axis_name``.
    """
    fsdp_axes = tuple(fsdp_axes)
    name = "row_parallel_matmul"
    check_linear_shapes(name, x, full_kernel(kernel, fsdp_axes, 1), bias)
    gemm = _gemm(name, kernel, wgrad_dtype, gemm, gemm_state)
    x, _, union = _vary_all(x, None, kernel, fsdp_axes)
    return _apply(Matmul(gemm), x, kernel, bias, gemm_state, fsdp_axes, 1,
                  offload_activations, tap, functools.partial(Row, axis_name=axis_name),
                  kernel_axes=union)


def decode_matmul(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                  axis_name: AxisName | None = None, gemm: Gemm | None = None) -> jax.Array:
    """The single-token (decode) mode of the linear ops, forward only: ``x @ kernel``
    in the dtype of ``x`` (the kernel cast to it), summed over ``axis_name`` by one
    all-reduce when given, then ``+ bias``.

    Generation holds one token per sequence, whole on every tensor shard: a column layer
    multiplies its own column block ``[in, out / t]`` (no collective; ``axis_name``
    None; the output varies over the tensor axis), a row layer its row block ``[in / t,
    out]`` of this device's features, and all-reduces the partial products (in place of
    the training path's reduce-scatter).

    Args:
      x: ``[..., in]`` (column) or ``[..., in / t]`` (row), compute dtype.
      kernel: this device's block; bias: ``[out]`` / ``[out / t]`` or ``None``.
      axis_name: the tensor axis for a row layer, ``None`` for a column layer.
      gemm: the GEMM object (None: :class:`~sp_jax.ops.gemm.ComputeGemm`; an adapted
        layer's :class:`~sp_jax.ops.lora.LoRAGemm` with its ``LoRAKernel``).
    """
    check_linear_shapes("decode_matmul", x, kernel, bias)
    return Decode(gemm or ComputeGemm(), axis_name).fwd(x, kernel, (bias, None))[0]


def _sequence_checks(name: str, x, kernel, bias, seq_dim: int, fsdp_axes: tuple,
                     fsdp_dim: int) -> int:
    """Shape checks of the sequence-parallel ops; returns the canonical ``seq_dim``."""
    check_linear_shapes(name, x, full_kernel(kernel, fsdp_axes, fsdp_dim), bias)
    seq_dim = canonical_dim(seq_dim, x.ndim, "seq_dim")
    if seq_dim == x.ndim - 1:
        raise ValueError(
            f"{name}: seq_dim must not be the feature (last) dimension of x {x.shape}."
        )
    return seq_dim


def row_sequence_parallel_matmul(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis_name: AxisName,
    seq_dim: int = 1,
    wgrad_dtype=None,
    collective_matmul: bool = False,
    fsdp_axes: tuple[AxisName, ...] = (),
    activation: Callable[[jax.Array], jax.Array] | None = None,
    gemm: Gemm | None = None,
    gemm_state: Any = None,
    offload_activations: bool = False,
    tap=None,
) -> jax.Array:
    """``reduce_scatter(x @ kernel, seq_dim) + bias``: the exit from a tensor-parallel region
    into a sequence-parallel one, as one op.

    The forward multiplies this device's feature block by its row block of the weight and
    reduce-scatters the partial sums along the sequence; the bias is added once, after the
    reduction. The backward all-gathers ``dy`` once and computes ``dx = dy_full @
    kernel.T`` and ``d kernel = x^T dy_full`` (in ``wgrad_dtype``) from it together, so the
    gathered ``dy`` lives only during this op's backward.

    Args:
      x: local ``[b, s, in / t]`` (full sequence, this device's features), compute dtype.
      kernel: local row block ``[in / t, out]`` (any float dtype; cast to ``x.dtype``).
      bias: ``[out]`` (replicated over ``axis_name``) or ``None``.
      axis_name: the tensor mesh axis (size ``t``).
      seq_dim: the sequence dimension of ``x``; not the last (feature) dimension; its
        size divisible by ``t``.
      wgrad_dtype: accumulation dtype of the weight and bias gradients (``None``: the
        compute dtype, as plain autodiff).
      collective_matmul: decompose the reduce-scatter into ``t - 1`` collective-permutes
        of partial sums, each overlapped with the GEMM of the next sequence chunk
        (:func:`sp_jax.ring.ring_reduce_scatter`); the backward's all-gather of ``dy`` is
        decomposed likewise, its chunks feeding the dx and dW GEMMs as they arrive. No-op
        when ``t = 1``.
      fsdp_axes: as :func:`matmul`, the kernel sharded along dimension 1.
      activation: ``None``, or a function of this device's ``x`` applied before the matmul
        (an MLP's activation: ``x`` is then the up projection's output, ``[b, s, w]``,
        and ``activation(x)`` the ``[b, s, in / t]`` the kernel multiplies). It must be
        hashable (a module-level function or a frozen dataclass) and elementwise along
        the sequence. Only ``x`` is kept for the backward pass, which computes the
        activation again (one elementwise op) for the weight gradient and
        differentiates it: the hidden layer is kept once, not as the activation's
        input and output both.
      gemm, gemm_state, offload_activations, tap: as :func:`matmul` (the residual
        ``x``).
    Returns:
      ``[b, s / t, out]`` in ``x.dtype``: the sum over ``axis_name``, this device's chunk.
    """
    fsdp_axes = tuple(fsdp_axes)
    name = "row_sequence_parallel_matmul"
    gemm = _gemm(name, kernel, wgrad_dtype, gemm, gemm_state)
    h = x if activation is None else jax.eval_shape(activation, x)
    seq_dim = _sequence_checks(name, h, kernel, bias, seq_dim, fsdp_axes, 1)
    check_divisible(x, seq_dim, axis_name, name)
    if activation is not None and h.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"{name}: activation must keep every dimension of x {x.shape} but "
                         f"the last (features); it gave {h.shape}.")
    rule = RowSequence(gemm, _transport(axis_name, seq_dim, collective_matmul), activation)
    x, bias, union = _vary_all(x, bias, kernel, {axis_name, *fsdp_axes})
    return _apply(rule, x, kernel, bias, gemm_state, fsdp_axes, 1, offload_activations, tap,
                  kernel_axes=union)


def column_sequence_parallel_matmul(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis_name: AxisName,
    seq_dim: int = 1,
    recompute_allgather: bool = False,
    wgrad_dtype=None,
    collective_matmul: bool = False,
    fsdp_axes: tuple[AxisName, ...] = (),
    gemm: Gemm | None = None,
    gemm_state: Any = None,
    offload_activations: bool = False,
    tap=None,
) -> jax.Array:
    """``all_gather(x, seq_dim) @ kernel + bias`` with a choice of what backward keeps.

    The forward all-gathers the sequence shards and multiplies by this device's column
    block of the weight. The backward computes ``dx = reduce_scatter(dy @ kernel.T)`` and
    ``d kernel = x_full^T dy`` (in ``wgrad_dtype``).

    Args:
      x: local sequence shard, e.g. ``[b, s / t, in]``, in the compute dtype.
      kernel: local column block ``[in, out / t]`` (any float dtype; cast to ``x.dtype``).
      bias: local ``[out / t]`` or ``None``.
      axis_name: the tensor mesh axis (size ``t``).
      seq_dim: the sequence dimension of ``x``; not the last (feature) dimension.
      recompute_allgather: ``False`` keeps the gathered ``[b, s, in]`` input as the
        residual; ``True`` keeps only the ``[b, s / t, in]`` shard and all-gathers it again
        in the backward pass (guarded against CSE by an optimization barrier that also
        holds the incoming cotangent; on XLA:CPU also run with
        ``--xla_disable_hlo_passes=cse_barrier_expander``).
      wgrad_dtype: accumulation dtype of the weight and bias gradients (``None``: the
        compute dtype, as plain autodiff).
      collective_matmul: decompose the all-gather into ``t - 1`` collective-permutes, each
        overlapped with the GEMM of the chunk that arrived before
        (:func:`sp_jax.ring.ring_gather`); the backward's reduce-scatter of ``dx`` and,
        with ``recompute_allgather``, its re-gather of ``x`` are decomposed likewise. No-op
        when ``t = 1``.
      fsdp_axes: as :func:`matmul`, the kernel sharded along dimension 0.
      gemm, gemm_state: as :func:`matmul`; in FP8 the shard is quantised before the
        all-gather (e4m3 bytes move, in the ring too) and the residual is the e4m3 shard
        (``recompute_allgather``) or the gathered e4m3 input.
      offload_activations: as :func:`matmul`: the residual (the shard with
        ``recompute_allgather``, else the gathered input) waits in host memory.
      tap: as :func:`matmul`.
    Returns:
      ``[b, s, out / t]`` in ``x.dtype``, varying over ``axis_name``.
    """
    fsdp_axes = tuple(fsdp_axes)
    gemm = _gemm("column_sequence_parallel_matmul", kernel, wgrad_dtype, gemm, gemm_state)
    seq_dim = _sequence_checks("column_sequence_parallel_matmul", x, kernel, bias, seq_dim,
                               fsdp_axes, 0)
    rule = ColumnSequence(gemm, _transport(axis_name, seq_dim, collective_matmul),
                          bool(recompute_allgather))
    x, bias, union = _vary_all(x, bias, kernel, {axis_name, *fsdp_axes})
    return _apply(rule, x, kernel, bias, gemm_state, fsdp_axes, 0, offload_activations, tap,
                  kernel_axes=union)
