"""Per-device collectives for tensor and sequence parallelism, each paired with its VJP.

Every function here works on the *local* (per-device) block of an array and is meant to
be called inside :func:`jax.shard_map` over a mesh that has ``axis_name``. They follow
Megatron's ``mappings.py``: a forward collective and its conjugate backward collective,
written as one small :func:`jax.custom_vjp` each.

=======================  ===========================  ==============================
function                 forward                      backward
=======================  ===========================  ==============================
scatter_to_sequence      keep the local chunk         all-gather
gather_from_sequence     all-gather                   keep the local chunk
all_gather_sequence      all-gather                   reduce-scatter
reduce_scatter_sequence  reduce-scatter               all-gather
copy_to_tensor_region    identity                     all-reduce (psum)
reduce_from_tensor_region  all-reduce (psum)          identity
=======================  ===========================  ==============================

``scatter_to_sequence`` / ``gather_from_sequence`` take any dimension, so they double as
Megatron's ``scatter_to/gather_from_tensor_model_parallel_region`` with ``seq_dim=-1``.

The matmul ops (:func:`matmul`, :func:`add_bias`, :func:`column_sequence_parallel_matmul`)
compute weight gradients in ``wgrad_dtype`` straight from the low-precision operands
(``preferred_element_type``), the analog of ``mp_fused_linear_param_grad_add``.

Typing (``check_vma=True``, the :func:`jax.shard_map` default): a custom VJP must return
cotangents with exactly the varying-manual-axes (VMA) type of its primal inputs. The
public wrappers below therefore settle the types *before* the custom VJP is entered:
replicated parameters are cast to vary like the activations (``lax.pcast(...,
to="varying")``), whose transpose is the ``psum`` that sums the data-parallel weight
gradients. The ops are equally correct with ``check_vma=False``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.ring import ring_gather, ring_reduce_scatter

try:  # public from the jax release that exports it; the primitive has existed since 0.6
    _all_gather_invariant = lax.all_gather_invariant  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - depends on the installed jax
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant

__all__ = [
    "scatter_to_sequence",
    "gather_from_sequence",
    "all_gather_sequence",
    "reduce_scatter_sequence",
    "copy_to_tensor_region",
    "reduce_from_tensor_region",
    "matmul",
    "add_bias",
    "column_parallel_matmul",
    "column_sequence_parallel_matmul",
    "row_sequence_parallel_matmul",
    "fsdp_gather",
]

AxisName = Hashable


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------


def _vma(x: jax.Array) -> frozenset:
    """The mesh axes ``x`` varies over (empty outside ``check_vma`` shard_maps)."""
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def _vary(x, axes) -> jax.Array:
    """Casts ``x`` to vary over ``axes`` (no-op for axes it already varies over)."""
    if x is None:
        return None
    missing = tuple(sorted(set(axes) - _vma(x), key=str))
    return lax.pcast(x, missing, to="varying") if missing else x


def _canonical_dim(dim: int, ndim: int, name: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for an array of rank {ndim}.")
    return dim % ndim


def _check_divisible(x: jax.Array, dim: int, axis_name: AxisName, what: str) -> None:
    size = lax.axis_size(axis_name)
    if x.shape[dim] % size:
        raise ValueError(
            f"{what}: dimension {dim} of the local array {x.shape} has size {x.shape[dim]}, "
            f"which is not divisible by the size {size} of mesh axis {axis_name!r}."
        )


def _split(x: jax.Array, axis_name: AxisName, dim: int) -> jax.Array:
    """This device's chunk of ``x`` along ``dim`` (chunk ``axis_index`` of ``axis_size``)."""
    chunk = x.shape[dim] // lax.axis_size(axis_name)
    start = lax.axis_index(axis_name) * chunk
    return lax.dynamic_slice_in_dim(x, start, chunk, axis=dim)


def _all_gather(x: jax.Array, axis_name: AxisName, dim: int) -> jax.Array:
    return lax.all_gather(x, axis_name, axis=dim, tiled=True)


def _reduce_scatter(x: jax.Array, axis_name: AxisName, dim: int) -> jax.Array:
    return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)


# --------------------------------------------------------------------------------------
# Sequence <-> tensor region mappings (Megatron's mappings.py)
# --------------------------------------------------------------------------------------


def _conjugate_pair(forward: Callable, backward: Callable) -> Callable:
    """A custom-VJP op ``op(x, axis_name, dim)`` running ``forward`` and, for its VJP,
    ``backward(g, axis_name, dim)``."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def op(x, axis_name, dim):
        return forward(x, axis_name, dim)

    op.defvjp(
        lambda x, axis_name, dim: (forward(x, axis_name, dim), None),
        lambda axis_name, dim, _, g: (backward(g, axis_name, dim),),
    )
    return op


def _gather_invariant(x, axis_name, dim):
    return _all_gather_invariant(x, axis_name, axis=dim, tiled=True)


def _vary_then(f: Callable) -> Callable:
    """``f`` applied after casting its input to vary over ``axis_name``."""
    return lambda g, axis_name, dim: f(_vary(g, (axis_name,)), axis_name, dim)


# name                       forward              backward
_scatter_replicated = _conjugate_pair(_split, _gather_invariant)
_scatter_varying = _conjugate_pair(_split, _all_gather)
_gather = _conjugate_pair(_gather_invariant, _vary_then(_split))
_all_gather_rs = _conjugate_pair(_all_gather, _vary_then(_reduce_scatter))
_reduce_scatter_ag = _conjugate_pair(_reduce_scatter, _vary_then(_all_gather))


def _tp_dx_all_reduce(g, axis_name, _):
    with jax.named_scope("tp_dx_all_reduce"):  # names show in HLO and profiles
        return lax.psum(_vary(g, (axis_name,)), axis_name)


_copy = _conjugate_pair(lambda x, axis_name, _: _vary(x, (axis_name,)), _tp_dx_all_reduce)
_reduce = _conjugate_pair(
    lambda x, axis_name, _: lax.psum(x, axis_name),
    lambda g, axis_name, _: _vary(g, (axis_name,)),
)


def scatter_to_sequence(x: jax.Array, axis_name: AxisName, seq_dim: int = 1) -> jax.Array:
    """Keeps this device's chunk of a replicated ``x`` along ``seq_dim``; VJP: all-gather.

    Args:
      x: local array, the same on every device of ``axis_name``; ``x.shape[seq_dim]``
        divisible by the axis size ``t``.
      axis_name: mesh axis to split over.
      seq_dim: dimension to split (``-1`` gives Megatron's scatter to the tensor region).
    Returns:
      ``x`` with ``shape[seq_dim] // t`` along ``seq_dim``, varying over ``axis_name``.
    """
    seq_dim = _canonical_dim(seq_dim, x.ndim, "seq_dim")
    _check_divisible(x, seq_dim, axis_name, "scatter_to_sequence")
    op = _scatter_varying if axis_name in _vma(x) else _scatter_replicated
    return op(x, axis_name, seq_dim)


def gather_from_sequence(x: jax.Array, axis_name: AxisName, seq_dim: int = 1) -> jax.Array:
    """All-gathers ``x`` along ``seq_dim`` into a replicated array; VJP: keep local chunk.

    Use it where everything after the gather is computed redundantly on every device
    (the cotangent is then the same everywhere and each device keeps its own chunk).

    Args:
      x: local shard ``[..., s / t, ...]`` varying over ``axis_name``.
    Returns:
      ``[..., s, ...]``, invariant over ``axis_name``.
    """
    seq_dim = _canonical_dim(seq_dim, x.ndim, "seq_dim")
    return _gather(_vary(x, (axis_name,)), axis_name, seq_dim)


def all_gather_sequence(x: jax.Array, axis_name: AxisName, seq_dim: int = 1) -> jax.Array:
    """All-gathers ``x`` along ``seq_dim``; VJP: reduce-scatter.

    The entry into a tensor-parallel region from a sequence-parallel one: each device
    then computes with its own weight shard, so the cotangents differ per device and are
    summed and re-split by the reduce-scatter.

    Args:
      x: local shard ``[..., s / t, ...]``.
    Returns:
      ``[..., s, ...]``, varying over ``axis_name``.
    """
    seq_dim = _canonical_dim(seq_dim, x.ndim, "seq_dim")
    return _all_gather_rs(_vary(x, (axis_name,)), axis_name, seq_dim)


def reduce_scatter_sequence(x: jax.Array, axis_name: AxisName, seq_dim: int = 1) -> jax.Array:
    """Sums partial results over ``axis_name`` and keeps this device's sequence chunk.

    The exit from a tensor-parallel region into a sequence-parallel one; VJP: all-gather.

    Args:
      x: local partial sums ``[..., s, ...]``, ``s`` divisible by the axis size ``t``.
    Returns:
      ``[..., s / t, ...]`` (the sum over devices, this device's chunk).
    """
    seq_dim = _canonical_dim(seq_dim, x.ndim, "seq_dim")
    _check_divisible(x, seq_dim, axis_name, "reduce_scatter_sequence")
    return _reduce_scatter_ag(_vary(x, (axis_name,)), axis_name, seq_dim)


def copy_to_tensor_region(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Identity into a tensor-parallel region; VJP: all-reduce (psum) of the cotangents.

    Args:
      x: local array, replicated over ``axis_name`` (invariant).
      axis_name: the tensor-parallel mesh axis.
    Returns:
      ``x`` unchanged (no copy in the HLO), typed as varying over ``axis_name``.
    """
    if axis_name in _vma(x):
        raise TypeError(
            f"copy_to_tensor_region expects an input replicated over {axis_name!r}, but it "
            f"already varies over that axis (type {jax.typeof(x)}). Its VJP would sum "
            "gradients of different values; use all_gather_sequence to enter the region "
            "from sharded activations."
        )
    return _copy(x, axis_name, None)


def reduce_from_tensor_region(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """All-reduce (psum) out of a tensor-parallel region; VJP: identity.

    Args:
      x: local partial sums, varying over ``axis_name``.
      axis_name: the tensor-parallel mesh axis.
    Returns:
      The sum over ``axis_name``, invariant over it.
    """
    return _reduce(_vary(x, (axis_name,)), axis_name, None)


# --------------------------------------------------------------------------------------
# Matmuls with weight gradients in wgrad_dtype
# --------------------------------------------------------------------------------------


def _wgrad(x: jax.Array, g: jax.Array, wgrad_dtype, param_dtype) -> jax.Array:
    """``sum over leading dims of x^T g`` -> ``[in, out]``, accumulated in ``wgrad_dtype``.

    With ``wgrad_dtype=None`` it reproduces plain autodiff: the product is rounded to the
    compute dtype and then cast to the parameter dtype.
    """
    acc = wgrad_dtype if wgrad_dtype is not None else jnp.result_type(x, g)
    lead = tuple(range(x.ndim - 1))
    dw = lax.dot_general(x, g, ((lead, lead), ((), ())), preferred_element_type=acc)
    return dw.astype(param_dtype)


def _bgrad(g: jax.Array, wgrad_dtype, param_dtype) -> jax.Array:
    acc = wgrad_dtype if wgrad_dtype is not None else g.dtype
    return jnp.sum(g, axis=tuple(range(g.ndim - 1)), dtype=acc).astype(param_dtype)


def _dot(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x [..., in] @ kernel [in, out]`` in the dtype of ``x`` (the compute dtype)."""
    return lax.dot_general(x, kernel.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())))


def _bwd_cast(kernel: jax.Array, g: jax.Array) -> jax.Array:
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


def _dot_t(g: jax.Array, kernel: jax.Array) -> jax.Array:
    """``g [..., out] @ kernel.T`` -> ``[..., in]`` in the dtype of ``g`` (backward only;
    the kernel is cast by :func:`_bwd_cast`)."""
    kernel = _bwd_cast(kernel, g)
    return lax.dot_general(g, kernel, (((g.ndim - 1,), (1,)), ((), ())))


def _check_linear_shapes(name: str, x: jax.Array, kernel: jax.Array, bias=None) -> None:
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, kernel, wgrad_dtype):
    return _dot(x, kernel)


def _matmul_fwd(x, kernel, wgrad_dtype):
    return _dot(x, kernel), (x, kernel)


def _matmul_bwd(wgrad_dtype, res, g):
    x, kernel = res
    dx = lax.dot_general(g, kernel.astype(g.dtype), (((g.ndim - 1,), (1,)), ((), ())))
    return dx, _wgrad(x, g, wgrad_dtype, kernel.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x: jax.Array, kernel: jax.Array, *, wgrad_dtype=None,
           fsdp_axes: tuple[AxisName, ...] = (), fsdp_dim: int = 1) -> jax.Array:
    """Local ``x @ kernel`` in the dtype of ``x``, with the weight gradient in ``wgrad_dtype``.

    Args:
      x: ``[..., in]`` activations in the compute dtype.
      kernel: ``[in, out]`` parameter in its own (master) dtype; cast to ``x.dtype``.
      wgrad_dtype: accumulation dtype of ``d kernel`` (``None``: as plain autodiff).
      fsdp_axes: data mesh axes the kernel is sharded over besides the tensor axis
        (``ParallelConfig(fsdp=True)``; ``kernel`` is then this device's shard along
        dimension ``fsdp_dim``): gathered just before the matmul, gathered again in the backward
        pass instead of kept, and the weight gradient reduce-scattered over them.
      fsdp_dim: the kernel dimension ``fsdp_axes`` shard (row layers: 1).
    Returns:
      ``[..., out]`` in ``x.dtype``.
    """
    fsdp_axes = tuple(fsdp_axes)
    _check_linear_shapes("matmul", x, _full_kernel(kernel, fsdp_axes, fsdp_dim))
    vma = _vma(x) | _vma(kernel) | set(fsdp_axes)
    if fsdp_axes:
        return _fsdp_matmul(_vary(x, vma), _vary(kernel, vma), None, fsdp_axes, fsdp_dim,
                            (wgrad_dtype,))
    return _matmul(_vary(x, vma), _vary(kernel, vma), wgrad_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add_bias(y, bias, wgrad_dtype):
    return y + bias.astype(y.dtype)


def _add_bias_fwd(y, bias, wgrad_dtype):
    return _add_bias(y, bias, wgrad_dtype), bias


def _add_bias_bwd(wgrad_dtype, bias, g):
    return g, _bgrad(g, wgrad_dtype, bias.dtype)


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def add_bias(y: jax.Array, bias: jax.Array | None, *, wgrad_dtype=None) -> jax.Array:
    """``y + bias`` in the dtype of ``y``; ``d bias`` is summed in ``wgrad_dtype``."""
    if bias is None:
        return y
    if bias.shape != y.shape[-1:]:
        raise ValueError(f"add_bias: bias shape {bias.shape} does not match y {y.shape}.")
    return _add_bias(y, _vary(bias, _vma(y)), wgrad_dtype)


# --------------------------------------------------------------------------------------
# Column-parallel matmul: identity into the tensor region + matmul; backward all-reduces
# dx while the dW GEMM runs
# --------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _cp_matmul(x, kernel, bias, axis_name, wgrad_dtype):
    return _cp_matmul_fwd(x, kernel, bias, axis_name, wgrad_dtype)[0]


def _cp_matmul_fwd(x, kernel, bias, axis_name, wgrad_dtype):
    y = _dot(_vary(x, (axis_name,)), kernel)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y, (x, kernel, bias)


def _cp_matmul_bwd(axis_name, wgrad_dtype, res, g):
    x, kernel, bias = res
    dx = _dot_t(g, kernel)
    # dW and db after dx (Megatron's order: dgrad, then wgrad while dx is all-reduced)
    x, g_w, _ = lax.optimization_barrier((_vary(x, (axis_name,)), g, dx))
    with jax.named_scope("tp_dx_all_reduce"):  # names show in HLO and profiles
        dx = lax.psum(dx, axis_name)
    dkernel = _wgrad(x, g_w, wgrad_dtype, kernel.dtype)
    dbias = None if bias is None else _bgrad(g_w, wgrad_dtype, bias.dtype)
    return dx, dkernel, dbias


_cp_matmul.defvjp(_cp_matmul_fwd, _cp_matmul_bwd)


def column_parallel_matmul(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis_name: AxisName,
    wgrad_dtype=None,
    fsdp_axes: tuple[AxisName, ...] = (),
) -> jax.Array:
    """``x @ kernel + bias`` entering a tensor-parallel region from replicated activations
    (``copy_to_tensor_region`` and the matmul as one op, Megatron's
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
      fsdp_axes: data mesh axes the kernel is sharded over besides the tensor axis
        (``ParallelConfig(fsdp=True)``; ``kernel`` is then this device's shard along
        dimension 0): gathered just before the matmul, gathered again in the backward
        pass instead of kept, and the weight gradient reduce-scattered over them.
    Returns:
      ``[..., out / t]`` in ``x.dtype``, varying over ``axis_name``.
    """
    fsdp_axes = tuple(fsdp_axes)
    _check_linear_shapes("column_parallel_matmul", x, _full_kernel(kernel, fsdp_axes, 0),
                         bias)
    if axis_name in _vma(x):
        raise TypeError(
            f"column_parallel_matmul expects an input replicated over {axis_name!r}, but it "
            f"already varies over that axis (type {jax.typeof(x)}); use "
            "column_sequence_parallel_matmul to enter the region from sharded activations."
        )
    vma = _vma(x) | _vma(kernel) | {axis_name} | set(fsdp_axes)
    if bias is not None:
        vma |= _vma(bias)
    args = (_vary(x, vma - {axis_name}), _vary(kernel, vma), _vary(bias, vma))
    static = (axis_name, None if wgrad_dtype is None else jnp.dtype(wgrad_dtype))
    if fsdp_axes:
        return _fsdp_cp_matmul(*args, fsdp_axes, 0, static)
    return _cp_matmul(*args, *static)


# --------------------------------------------------------------------------------------
# Collective matmul: the same two ops as rings of collective-permutes, each transfer
# overlapped with the GEMM of one sequence chunk (forward and backward)
# --------------------------------------------------------------------------------------


def _chunk(x: jax.Array, position, size: int, dim: int) -> jax.Array:
    """Chunk ``position`` (traced) of ``x`` along ``dim``, ``size`` long."""
    return lax.dynamic_slice_in_dim(x, position * size, size, axis=dim)


def _put(buf: jax.Array, value: jax.Array, position, dim: int) -> jax.Array:
    """``buf`` with chunk ``position`` along ``dim`` replaced by ``value``."""
    return lax.dynamic_update_slice_in_dim(buf, value, position * value.shape[dim], axis=dim)


def _buffer(shape, dtype, tie: jax.Array) -> jax.Array:
    """A zero buffer to assemble chunks in, created after ``tie``: a plain ``jnp.zeros`` is
    one constant for every layer, which XLA would share and materialise early, keeping a
    ``[b, s, h]`` buffer alive across layers."""
    zeros, _ = lax.optimization_barrier((jnp.zeros(shape, dtype), tie))
    return zeros


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _csp_ring(x, kernel, bias, axis_name, seq_dim, recompute, wgrad_dtype):
    return _csp_ring_fwd(x, kernel, bias, axis_name, seq_dim, recompute, wgrad_dtype)[0]


def _csp_ring_fwd(x, kernel, bias, axis_name, seq_dim, recompute, wgrad_dtype):
    t, n = lax.axis_size(axis_name), x.shape[seq_dim]
    kernel_c = kernel.astype(x.dtype)
    full = list(x.shape)
    full[seq_dim] = n * t
    out = list(full)
    out[-1] = kernel.shape[1]

    def fn(acc, position, x_chunk):
        y, x_full = acc
        y = _put(y, _dot(x_chunk, kernel_c), position, seq_dim)
        if x_full is not None:  # save mode keeps the gathered input for backward
            x_full = _put(x_full, x_chunk, position, seq_dim)
        return y, x_full

    with jax.named_scope("sp_cm_column"):
        init = (_buffer(out, x.dtype, x), None if recompute else _buffer(full, x.dtype, x))
        y, x_full = ring_gather(x, axis_name, fn, init)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y, (x if recompute else x_full, kernel, bias)


def _csp_ring_bwd(axis_name, seq_dim, recompute, wgrad_dtype, res, dy):
    x, kernel, bias = res
    t = lax.axis_size(axis_name)
    n = dy.shape[seq_dim] // t
    kernel_c = _bwd_cast(kernel, dy)

    def partial_dx(dy, position):
        g = _chunk(dy, position, n, seq_dim)
        return lax.dot_general(g, kernel_c, (((g.ndim - 1,), (1,)), ((), ())))

    with jax.named_scope("sp_cm_column_bwd"):
        if recompute:
            # The input's chunks travel the ring again, in lockstep with the dx ring, so
            # that each transfer runs during a dx GEMM; tied to dy, so that CSE cannot
            # reuse the forward ring's transfers (which would keep every received chunk
            # alive from forward to backward).
            x, _ = lax.optimization_barrier((x, dy))
            full = list(x.shape)
            full[seq_dim] *= t
            dx, x = ring_reduce_scatter(
                dy, axis_name, partial_dx,
                gather=(x, lambda buf, position, chunk: _put(buf, chunk, position, seq_dim),
                        _buffer(full, x.dtype, x)))
        else:
            dx = ring_reduce_scatter(dy, axis_name, partial_dx)
        dkernel = _wgrad(x, dy, wgrad_dtype, kernel.dtype)
    dbias = None if bias is None else _bgrad(dy, wgrad_dtype, bias.dtype)
    return lax.optimization_barrier((dx, dkernel, dbias))


_csp_ring.defvjp(_csp_ring_fwd, _csp_ring_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rsp_ring(x, kernel, bias, axis_name, seq_dim, wgrad_dtype):
    return _rsp_ring_fwd(x, kernel, bias, axis_name, seq_dim, wgrad_dtype)[0]


def _rsp_ring_fwd(x, kernel, bias, axis_name, seq_dim, wgrad_dtype):
    n = x.shape[seq_dim] // lax.axis_size(axis_name)
    kernel_c = kernel.astype(x.dtype)
    with jax.named_scope("sp_cm_row"):
        y = ring_reduce_scatter(x, axis_name,
                                lambda x, position: _dot(_chunk(x, position, n, seq_dim),
                                                         kernel_c))
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y, (x, kernel, bias)


def _rsp_ring_bwd(axis_name, seq_dim, wgrad_dtype, res, dy):
    x, kernel, bias = res
    kernel_c = _bwd_cast(kernel, dy)

    def fn(carry, position, g):
        dx, dy_full = carry
        dx = _put(dx, lax.dot_general(g, kernel_c, (((g.ndim - 1,), (1,)), ((), ()))),
                  position, seq_dim)
        return dx, _put(dy_full, g, position, seq_dim)

    with jax.named_scope("sp_cm_row_bwd"):
        # dy's chunks arrive one by one, each feeding its dx GEMM; they are also kept in
        # one buffer for the weight gradient, a single GEMM once all have arrived.
        full = list(dy.shape)
        full[seq_dim] = x.shape[seq_dim]
        dx, dy_full = ring_gather(dy, axis_name, fn, (_buffer(x.shape, dy.dtype, dy),
                                                      _buffer(full, dy.dtype, dy)))
        dkernel = _wgrad(x, dy_full, wgrad_dtype, kernel.dtype)
    dbias = None if bias is None else _bgrad(dy, wgrad_dtype, bias.dtype)
    return lax.optimization_barrier((dx.astype(x.dtype), dkernel, dbias))


_rsp_ring.defvjp(_rsp_ring_fwd, _rsp_ring_bwd)


# --------------------------------------------------------------------------------------
# Row sequence-parallel matmul: matmul + reduce-scatter; backward gathers dy once and
# computes dx and dW from it together
# --------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rsp_matmul(x, kernel, bias, axis_name, seq_dim, wgrad_dtype):
    return _rsp_matmul_fwd(x, kernel, bias, axis_name, seq_dim, wgrad_dtype)[0]


def _rsp_matmul_fwd(x, kernel, bias, axis_name, seq_dim, wgrad_dtype):
    y = _reduce_scatter(_dot(x, kernel), axis_name, seq_dim)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y, (x, kernel, bias)


def _rsp_matmul_bwd(axis_name, seq_dim, wgrad_dtype, res, dy):
    x, kernel, bias = res
    with jax.named_scope("sp_dy_all_gather"):
        dy_full = _all_gather(dy, axis_name, seq_dim)
    dx = _dot_t(dy_full, kernel)
    dkernel = _wgrad(x, dy_full, wgrad_dtype, kernel.dtype)
    dbias = None if bias is None else _bgrad(dy, wgrad_dtype, bias.dtype)
    # dW (and db) are computed together with dx: the gathered dy [b, s, out] then dies in
    # this layer's backward instead of waiting for a dW GEMM XLA would otherwise put at the
    # end of the backward pass (one gathered dy per row layer alive at once).
    return lax.optimization_barrier((dx, dkernel, dbias))


_rsp_matmul.defvjp(_rsp_matmul_fwd, _rsp_matmul_bwd)


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
      fsdp_axes: data mesh axes the kernel is sharded over besides the tensor axis
        (``ParallelConfig(fsdp=True)``; ``kernel`` is then this device's shard along
        dimension 1): gathered just before the matmul, gathered again in the backward
        pass instead of kept, and the weight gradient reduce-scattered over them.
    Returns:
      ``[b, s / t, out]`` in ``x.dtype``: the sum over ``axis_name``, this device's chunk.
    """
    fsdp_axes = tuple(fsdp_axes)
    _check_linear_shapes("row_sequence_parallel_matmul", x,
                         _full_kernel(kernel, fsdp_axes, 1), bias)
    seq_dim = _canonical_dim(seq_dim, x.ndim, "seq_dim")
    if seq_dim == x.ndim - 1:
        raise ValueError(
            "row_sequence_parallel_matmul: seq_dim must not be the feature (last) "
            f"dimension of x {x.shape}."
        )
    _check_divisible(x, seq_dim, axis_name, "row_sequence_parallel_matmul")
    vma = _vma(x) | _vma(kernel) | {axis_name} | set(fsdp_axes)
    if bias is not None:
        vma |= _vma(bias)
    ring = collective_matmul and lax.axis_size(axis_name) > 1
    args = (_vary(x, vma), _vary(kernel, vma), _vary(bias, vma))
    static = (axis_name, seq_dim, None if wgrad_dtype is None else jnp.dtype(wgrad_dtype))
    if fsdp_axes:
        return (_fsdp_rsp_ring if ring else _fsdp_rsp_matmul)(*args, fsdp_axes, 1, static)
    return (_rsp_ring if ring else _rsp_matmul)(*args, *static)


# --------------------------------------------------------------------------------------
# Column sequence-parallel matmul: all-gather + matmul, saving or recomputing the gather
# --------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _csp_matmul(x, kernel, bias, axis_name, seq_dim, recompute, wgrad_dtype):
    y, _ = _csp_matmul_fwd(x, kernel, bias, axis_name, seq_dim, recompute, wgrad_dtype)
    return y


def _csp_matmul_fwd(x, kernel, bias, axis_name, seq_dim, recompute, wgrad_dtype):
    x_full = _all_gather(x, axis_name, seq_dim)
    y = _dot(x_full, kernel)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    # Residuals: the local shard (recompute) or the gathered input (save). kernel and
    # bias are the caller's own arrays, so keeping them costs no extra memory.
    return y, (x if recompute else x_full, kernel, bias)


def _csp_matmul_bwd(axis_name, seq_dim, recompute, wgrad_dtype, res, dy):
    x, kernel, bias = res
    if recompute:
        # Tie the shard to the incoming cotangent: the re-gather then cannot be hoisted
        # into the forward pass or merged (CSE) with the forward gather, which would keep
        # the full input alive and silently undo the memory saving. The kernel's cast is
        # tied by the same barrier (see _bwd_cast), so the re-gather and the dx GEMM
        # become ready together and the gather runs during the GEMM.
        x, kernel, dy = lax.optimization_barrier((x, kernel, dy))
        with jax.named_scope("sp_regather"):
            x_full = _all_gather(x, axis_name, seq_dim)
        kernel_c = kernel.astype(dy.dtype)
    else:
        x_full, kernel_c = x, _bwd_cast(kernel, dy)
    # dx does not depend on the re-gather and the reduce-scatter does not depend on the
    # dW matmul, so XLA may overlap gather || dx-matmul and reduce-scatter || dW-matmul.
    dx = lax.dot_general(dy, kernel_c, (((dy.ndim - 1,), (1,)), ((), ())))
    with jax.named_scope("sp_dx_reduce_scatter"):  # names show in HLO and profiles
        dx = _reduce_scatter(dx, axis_name, seq_dim)
    dkernel = _wgrad(x_full, dy, wgrad_dtype, kernel.dtype)
    dbias = None if bias is None else _bgrad(dy, wgrad_dtype, bias.dtype)
    # Release dx together with dW and db (Megatron's async dx collective, waited for after
    # the dW GEMM): the scheduler then runs the reduce-scatter while dW is computed instead
    # of serialising it on the critical path, and neither the gathered input nor dy waits
    # for a weight-gradient GEMM or bias sum scheduled at the end of the backward pass.
    return lax.optimization_barrier((dx, dkernel, dbias))


_csp_matmul.defvjp(_csp_matmul_fwd, _csp_matmul_bwd)


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
      fsdp_axes: data mesh axes the kernel is sharded over besides the tensor axis
        (``ParallelConfig(fsdp=True)``; ``kernel`` is then this device's shard along
        dimension 0): gathered just before the matmul, gathered again in the backward
        pass instead of kept, and the weight gradient reduce-scattered over them.
    Returns:
      ``[b, s, out / t]`` in ``x.dtype``, varying over ``axis_name``.
    """
    fsdp_axes = tuple(fsdp_axes)
    _check_linear_shapes("column_sequence_parallel_matmul", x,
                         _full_kernel(kernel, fsdp_axes, 0), bias)
    seq_dim = _canonical_dim(seq_dim, x.ndim, "seq_dim")
    if seq_dim == x.ndim - 1:
        raise ValueError(
            "column_sequence_parallel_matmul: seq_dim must not be the feature (last) "
            f"dimension of x {x.shape}."
        )
    vma = _vma(x) | _vma(kernel) | {axis_name} | set(fsdp_axes)
    if bias is not None:
        vma |= _vma(bias)
    ring = collective_matmul and lax.axis_size(axis_name) > 1
    args = (_vary(x, vma), _vary(kernel, vma), _vary(bias, vma))
    static = (axis_name, seq_dim, bool(recompute_allgather),
              None if wgrad_dtype is None else jnp.dtype(wgrad_dtype))
    if fsdp_axes:
        return (_fsdp_csp_ring if ring else _fsdp_csp_matmul)(*args, fsdp_axes, 0, static)
    return (_csp_ring if ring else _csp_matmul)(*args, *static)


# --------------------------------------------------------------------------------------
# Parameters sharded over the data axes (ZeRO-3 / FSDP)
# --------------------------------------------------------------------------------------


def _fsdp_all_gather(w: jax.Array, axes: tuple, dim: int) -> jax.Array:
    with jax.named_scope("fsdp_gather"):
        return lax.all_gather(_vary(w, axes), axes, axis=dim, tiled=True)


def _fsdp_reduce_scatter(g: jax.Array, axes: tuple, dim: int) -> jax.Array:
    with jax.named_scope("fsdp_wgrad_reduce_scatter"):
        return lax.psum_scatter(_vary(g, axes), axes, scatter_dimension=dim, tiled=True)


_fsdp_pair = _conjugate_pair(_fsdp_all_gather, _fsdp_reduce_scatter)


def fsdp_gather(w: jax.Array, axes: tuple[AxisName, ...], dim: int) -> jax.Array:
    """The whole of a parameter sharded over the data ``axes`` along ``dim``, for uses
    whose backward does not need the parameter (an embedding lookup); the matmul ops
    take ``fsdp_axes`` instead and gather inside their own VJP.

    Forward: all-gather over ``axes`` (tiled, in the order of ``axes``, as
    ``P(..., axes, ...)`` lays the shards out). Backward: reduce-scatter of the gradient
    over ``axes``: the per-device partial gradients (each from its own batch shard) are
    summed and every device keeps its own shard, so the gradient comes out sharded like
    the parameter and no full-size all-reduce exists. No-op with empty ``axes``.
    """
    axes = tuple(axes)
    if not axes:
        return w
    return _fsdp_pair(w, axes, _canonical_dim(dim, w.ndim, "dim"))


def _fsdp_op(op_fwd: Callable, op_bwd: Callable) -> Callable:
    """The FSDP form ``op(x, kernel_shard, bias, axes, dim, static)`` of a linear op whose
    rules are ``op_fwd(x, kernel, bias, *static) -> (y, (a, kernel, bias))`` and
    ``op_bwd(*static, res, g) -> (dx, dkernel, dbias)``.

    Forward: the kernel is all-gathered over ``axes`` just before the op and dropped
    after it: the residual is the local shard. Backward: the shard is gathered again
    (behind a barrier with the incoming cotangent, so no CSE merges it with the forward
    gather and it is not issued before the backward reaches this layer), the op's
    backward runs, and the weight gradient is reduce-scattered over ``axes``.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
    def op(x, kernel, bias, axes, dim, static):
        return op_fwd(x, _fsdp_all_gather(kernel, axes, dim), bias, *static)[0]

    def fwd(x, kernel, bias, axes, dim, static):
        y, (a, _, b) = op_fwd(x, _fsdp_all_gather(kernel, axes, dim), bias, *static)
        return y, (a, kernel, b)

    def bwd(axes, dim, static, res, g):
        a, kernel, b = res
        kernel, g = lax.optimization_barrier((kernel, g))
        dx, dkernel, dbias = op_bwd(*static, (a, _fsdp_all_gather(kernel, axes, dim), b), g)
        return dx, _fsdp_reduce_scatter(dkernel, axes, dim), dbias

    op.defvjp(fwd, bwd)
    return op


def _no_bias_fwd(x, kernel, bias, wgrad_dtype):
    y, (x, kernel) = _matmul_fwd(x, kernel, wgrad_dtype)
    return y, (x, kernel, None)


def _no_bias_bwd(wgrad_dtype, res, g):
    dx, dkernel = _matmul_bwd(wgrad_dtype, res[:2], g)
    return dx, dkernel, None


_fsdp_matmul = _fsdp_op(_no_bias_fwd, _no_bias_bwd)
_fsdp_cp_matmul = _fsdp_op(_cp_matmul_fwd, _cp_matmul_bwd)
_fsdp_csp_matmul = _fsdp_op(_csp_matmul_fwd, _csp_matmul_bwd)
_fsdp_csp_ring = _fsdp_op(_csp_ring_fwd, _csp_ring_bwd)
_fsdp_rsp_matmul = _fsdp_op(_rsp_matmul_fwd, _rsp_matmul_bwd)
_fsdp_rsp_ring = _fsdp_op(_rsp_ring_fwd, _rsp_ring_bwd)


def _full_kernel(kernel: jax.Array, axes: tuple, dim: int) -> jax.ShapeDtypeStruct:
    """The shape the kernel has after the FSDP gather (for shape checks)."""
    shape = list(kernel.shape)
    for a in axes:
        shape[dim] *= lax.axis_size(a)
    return jax.ShapeDtypeStruct(tuple(shape), kernel.dtype)
