"""Linear ops across the tensor axis: matmuls whose collectives and weight gradients are
one custom VJP each, and the one dispatch to their plain, collective-matmul and FSDP forms.

=====================================  ==============================  ===========================
op                                     forward                         backward
=====================================  ==============================  ===========================
``matmul``                             local ``x @ kernel``            dx and dW (``wgrad_dtype``)
``add_bias``                           ``y + bias``                    db in ``wgrad_dtype``
``column_parallel_matmul``             identity into the TP region,    all-reduce of dx while dW
                                       matmul                          is computed
``column_sequence_parallel_matmul``    all-gather of the sequence,     reduce-scatter of dx (and
                                       matmul                          re-gather of x)
``row_sequence_parallel_matmul``       matmul, reduce-scatter of the   one all-gather of dy
                                       sequence                        feeding dx and dW
=====================================  ==============================  ===========================

Every op is built from a *rule*, a pair ``fwd(x, kernel, bias, *static) -> (y,
residuals)`` / ``bwd(*static, residuals, g) -> (dx, dkernel, dbias)``; ``static`` ends with
``wgrad_dtype, param_dtype`` (``dkernel``'s dtype: the parameter's, which the kernel
handed to the rule need not have). :data:`_OPS`
turns each rule into a custom-VJP op in each form: plain, as a ring of
collective-permutes overlapped with chunk GEMMs (``collective_matmul``;
:mod:`sp_jax.ops.collective_matmul`), and with the kernel sharded over the data axes
(``fsdp_axes``; :mod:`sp_jax.ops.fsdp`). :func:`_apply` is the one place that chooses.
Weight gradients are computed from the low-precision operands straight into
``wgrad_dtype`` (:mod:`sp_jax.ops.gemm`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.ops.collective_matmul import (
    column_ring_bwd,
    column_ring_fwd,
    row_ring_bwd,
    row_ring_fwd,
)
from sp_jax.ops.fp8 import Fp8Spec
from sp_jax.ops.fp8_linear import FP8_RULES
from sp_jax.ops.fsdp import fsdp_op, full_kernel
from sp_jax.ops.gemm import bgrad, bwd_cast, check_linear_shapes, dot, dot_nt, dot_t, wgrad
from sp_jax.ops.primitives import (
    AxisName,
    all_gather,
    canonical_dim,
    check_divisible,
    reduce_scatter,
    vary,
    vma,
)

__all__ = ["add_bias", "column_parallel_matmul", "column_sequence_parallel_matmul",
           "matmul", "row_sequence_parallel_matmul"]


# --------------------------------------------------------------------------------------
# The plain rules
# --------------------------------------------------------------------------------------


def _matmul_fwd(x, kernel, bias, wgrad_dtype, param_dtype):
    return dot(x, kernel), (x, kernel, None)


def _matmul_bwd(wgrad_dtype, param_dtype, res, g):
    x, kernel, _ = res
    dx = dot_nt(g, kernel.astype(g.dtype))
    return dx, wgrad(x, g, wgrad_dtype, param_dtype), None


def _cp_matmul_fwd(x, kernel, bias, axis_name, wgrad_dtype, param_dtype):
    y = dot(vary(x, (axis_name,)), kernel)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y, (x, kernel, bias)


def _cp_matmul_bwd(axis_name, wgrad_dtype, param_dtype, res, g):
    x, kernel, bias = res
    dx = dot_t(g, kernel)
    # dW and db after dx (Megatron's order: dgrad, then wgrad while dx is all-reduced)
    x, g_w, _ = lax.optimization_barrier((vary(x, (axis_name,)), g, dx))
    with jax.named_scope("tp_dx_all_reduce"):  # names show in HLO and profiles
        dx = lax.psum(dx, axis_name)
    dkernel = wgrad(x, g_w, wgrad_dtype, param_dtype)
    dbias = None if bias is None else bgrad(g_w, wgrad_dtype, bias.dtype)
    return dx, dkernel, dbias


def _csp_matmul_fwd(x, kernel, bias, axis_name, seq_dim, recompute, wgrad_dtype,
                    param_dtype):
    x_full = all_gather(x, axis_name, seq_dim)
    y = dot(x_full, kernel)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    # Residuals: the local shard (recompute) or the gathered input (save). kernel and
    # bias are the caller's own arrays, so keeping them costs no extra memory.
    return y, (x if recompute else x_full, kernel, bias)


def _csp_matmul_bwd(axis_name, seq_dim, recompute, wgrad_dtype, param_dtype, res, dy):
    x, kernel, bias = res
    if recompute:
        # Tie the shard to the incoming cotangent: the re-gather then cannot be hoisted
        # into the forward pass or merged (CSE) with the forward gather, which would keep
        # the full input alive and silently undo the memory saving. The kernel's cast is
        # tied by the same barrier (see gemm.bwd_cast), so the re-gather and the dx GEMM
        # become ready together and the gather runs during the GEMM. A kernel already in
        # the compute dtype has no cast to tie (bf16 parameters; the FSDP form's kernel,
        # gathered anew in this backward): it is not held back, so the weight gather
        # of the FSDP form runs during the weight-gradient GEMM.
        if kernel.dtype == dy.dtype:
            x, dy = lax.optimization_barrier((x, dy))
        else:
            x, kernel, dy = lax.optimization_barrier((x, kernel, dy))
        with jax.named_scope("sp_regather"):
            x_full = all_gather(x, axis_name, seq_dim)
        kernel_c = kernel.astype(dy.dtype)
    else:
        x_full, kernel_c = x, bwd_cast(kernel, dy)
    # dx does not depend on the re-gather and the reduce-scatter does not depend on the
    # dW matmul, so XLA may overlap gather || dx-matmul and reduce-scatter || dW-matmul.
    dx = dot_nt(dy, kernel_c)
    with jax.named_scope("sp_dx_reduce_scatter"):  # names show in HLO and profiles
        dx = reduce_scatter(dx, axis_name, seq_dim)
    dkernel = wgrad(x_full, dy, wgrad_dtype, param_dtype)
    dbias = None if bias is None else bgrad(dy, wgrad_dtype, bias.dtype)
    # Release dx together with dW and db (Megatron's async dx collective, waited for after
    # the dW GEMM): the scheduler then runs the reduce-scatter while dW is computed instead
    # of serialising it on the critical path, and neither the gathered input nor dy waits
    # for a weight-gradient GEMM or bias sum scheduled at the end of the backward pass.
    return lax.optimization_barrier((dx, dkernel, dbias))


def _rsp_matmul_fwd(x, kernel, bias, axis_name, seq_dim, wgrad_dtype, param_dtype):
    y = reduce_scatter(dot(x, kernel), axis_name, seq_dim)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y, (x, kernel, bias)


def _rsp_matmul_bwd(axis_name, seq_dim, wgrad_dtype, param_dtype, res, dy):
    x, kernel, bias = res
    with jax.named_scope("sp_dy_all_gather"):
        dy_full = all_gather(dy, axis_name, seq_dim)
    dx = dot_t(dy_full, kernel)
    dkernel = wgrad(x, dy_full, wgrad_dtype, param_dtype)
    dbias = None if bias is None else bgrad(dy, wgrad_dtype, bias.dtype)
    # dW (and db) are computed together with dx: the gathered dy [b, s, out] then dies in
    # this layer's backward instead of waiting for a dW GEMM XLA would otherwise put at the
    # end of the backward pass (one gathered dy per row layer alive at once).
    return lax.optimization_barrier((dx, dkernel, dbias))


def _activated(fwd: Callable, bwd: Callable) -> tuple[Callable, Callable]:
    """The rule ``(fwd, bwd)`` applied to ``activation(x)``, keeping ``x`` alone: its
    static arguments gain ``activation`` first; the residual is the activation's input,
    not its output, and the backward computes the output again (an elementwise op) for
    the weight gradient and differentiates it. Without this, an MLP keeps its hidden
    layer twice: the activation's input for the activation's backward and its output
    for the down projection's weight gradient."""

    def a_fwd(x, kernel, bias, activation, *static):
        y, (_, kernel_res, bias_res) = fwd(activation(x), kernel, bias, *static)
        return y, (x, kernel_res, bias_res)

    def a_bwd(activation, *args):
        *static, (x, kernel, bias), g = args
        # Tied to the cotangent: the recomputed activation can be neither hoisted into
        # the forward pass nor merged (CSE) with the forward one, which would keep the
        # activation's output alive until here and undo the saving.
        x, g = lax.optimization_barrier((x, g))
        h, activation_vjp = jax.vjp(activation, x)
        dh, dkernel, dbias = bwd(*static, (h, kernel, bias), g)
        return activation_vjp(dh)[0], dkernel, dbias

    return a_fwd, a_bwd


# --------------------------------------------------------------------------------------
# The one dispatch: rule x {plain, collective matmul} x {replicated kernel, fsdp}
# --------------------------------------------------------------------------------------


def _custom_vjp(fwd: Callable, bwd: Callable) -> Callable:
    """The op ``op(x, kernel, bias, static)`` of the rule ``(fwd, bwd)`` (``static``: a
    tuple of the rule's hashable static arguments)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def op(x, kernel, bias, static):
        return fwd(x, kernel, bias, *static)[0]

    op.defvjp(lambda x, kernel, bias, static: fwd(x, kernel, bias, *static),
              lambda static, res, g: bwd(*static, res, g))
    return op


_RULES: dict[tuple[str, bool], tuple[Callable, Callable]] = {
    # (op, collective matmul): (forward rule, backward rule)
    ("matmul", False): (_matmul_fwd, _matmul_bwd),
    ("column", False): (_cp_matmul_fwd, _cp_matmul_bwd),
    ("column_sequence", False): (_csp_matmul_fwd, _csp_matmul_bwd),
    ("column_sequence", True): (column_ring_fwd, column_ring_bwd),
    ("row_sequence", False): (_rsp_matmul_fwd, _rsp_matmul_bwd),
    ("row_sequence", True): (row_ring_fwd, row_ring_bwd),
    ("row_sequence_activated", False): _activated(_rsp_matmul_fwd, _rsp_matmul_bwd),
    ("row_sequence_activated", True): _activated(row_ring_fwd, row_ring_bwd),
    **FP8_RULES,  # the same ops in FP8 (sp_jax.ops.fp8_linear)
}
_OPS = {(*key, fsdp): (fsdp_op if fsdp else _custom_vjp)(*rule)
        for key, rule in _RULES.items() for fsdp in (False, True)}


def _apply(name: str, x, kernel, bias, static: tuple, *, ring: bool = False,
           fsdp_axes: tuple = (), fsdp_dim: int = 0, fp8: Fp8Spec | None = None,
           fp8_history: jax.Array | None = None) -> jax.Array:
    """Runs rule ``name`` in the form the options ask for: as a ring of transfers
    overlapped with chunk GEMMs (``ring``), with ``kernel`` this device's shard over
    the data axes ``fsdp_axes`` along ``fsdp_dim`` (gathered inside the op), and in FP8
    (``fp8``: rule ``name + "_fp8"``, whose third operand is ``(bias, fp8_history)`` and
    whose static arguments hold ``fp8`` before ``wgrad_dtype``; a row rule's always
    start with its activation, ``None`` without one). The rule's static arguments end
    with the kernel's own dtype, the dtype of its gradient (the FSDP form hands the rule
    a kernel gathered in the compute dtype)."""
    if fp8 is not None:
        if name == "row_sequence":
            static = (None, *static)
        name, bias = name.removesuffix("_activated") + "_fp8", (bias, fp8_history)
        static = (*static[:-1], fp8, static[-1])
    static = (*static, jnp.dtype(kernel.dtype))
    if fsdp_axes:
        return _OPS[name, ring, True](x, kernel, bias, fsdp_axes, fsdp_dim, static)
    return _OPS[name, ring, False](x, kernel, bias, static)


def _vary_all(x, kernel, bias, axes) -> tuple:
    """``x``, ``kernel`` and ``bias`` cast to vary over the union of their mesh axes and
    ``axes`` (see :mod:`sp_jax.ops.primitives`)."""
    union = vma(x) | vma(kernel) | set(axes) | (vma(bias) if bias is not None else set())
    return vary(x, union), vary(kernel, union), vary(bias, union)


def _check_fp8(name: str, fp8, fp8_history) -> None:
    """TypeErrors / ValueErrors naming ``name`` unless ``fp8`` is None or an
    :class:`~sp_jax.ops.fp8.Fp8Spec` with an amax history exactly when it scales with
    delayed scaling."""
    if fp8 is None:
        if fp8_history is not None:
            raise ValueError(f"{name}: fp8_history is given without fp8; pass "
                             "fp8=Fp8Spec(Fp8Recipe('delayed'), amax_axes) as well.")
        return
    if not isinstance(fp8, Fp8Spec):
        raise TypeError(f"{name}: fp8={fp8!r} must be a sp_jax.ops.fp8.Fp8Spec (an "
                        "Fp8Recipe and the mesh axes a tensor's amax spans) or None.")
    if not fp8.recipe.delayed:
        if fp8_history is not None:
            raise ValueError(f"{name}: fp8_history is only for delayed scaling; current "
                             "scaling (Fp8Recipe('current')) takes none.")
        return
    expected = (3, fp8.recipe.amax_history_len)
    if fp8_history is None or fp8_history.shape != expected:
        got = None if fp8_history is None else fp8_history.shape
        raise ValueError(f"{name}: delayed scaling needs fp8_history of shape {expected} "
                         f"(input, kernel and output-gradient amaxes), got {got}.")


def _static_dtype(wgrad_dtype):
    return None if wgrad_dtype is None else jnp.dtype(wgrad_dtype)


# --------------------------------------------------------------------------------------
# The public ops
# --------------------------------------------------------------------------------------

def matmul(x: jax.Array, kernel: jax.Array, *, wgrad_dtype=None,
           fsdp_axes: tuple[AxisName, ...] = (), fsdp_dim: int = 1,
           fp8: Fp8Spec | None = None, fp8_history: jax.Array | None = None) -> jax.Array:
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
      fp8: compute in FP8 (:mod:`sp_jax.ops.fp8_linear`): an
        :class:`~sp_jax.ops.fp8.Fp8Spec`, or ``None`` (the default: the compute dtype).
      fp8_history: with delayed scaling, the ``[3, amax_history_len]`` fp32 amax history
        (invariant over the mesh axes); its cotangent is this step's amaxes in column 0.
    Returns:
      ``[..., out]`` in ``x.dtype``.
    """
    fsdp_axes = tuple(fsdp_axes)
    check_linear_shapes("matmul", x, full_kernel(kernel, fsdp_axes, fsdp_dim))
    _check_fp8("matmul", fp8, fp8_history)
    x, kernel, _ = _vary_all(x, kernel, None, fsdp_axes)
    return _apply("matmul", x, kernel, None, (wgrad_dtype,), fsdp_axes=fsdp_axes,
                  fsdp_dim=fsdp_dim, fp8=fp8, fp8_history=fp8_history)


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
    fp8: Fp8Spec | None = None,
    fp8_history: jax.Array | None = None,
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
      fp8, fp8_history: as :func:`matmul`.
    Returns:
      ``[..., out / t]`` in ``x.dtype``, varying over ``axis_name``.
    """
    fsdp_axes = tuple(fsdp_axes)
    _check_fp8("column_parallel_matmul", fp8, fp8_history)
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
    args = (vary(x, union - {axis_name}), vary(kernel, union), vary(bias, union))
    return _apply("column", *args, (axis_name, _static_dtype(wgrad_dtype)),
                  fsdp_axes=fsdp_axes, fsdp_dim=0, fp8=fp8, fp8_history=fp8_history)


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
    fp8: Fp8Spec | None = None,
    fp8_history: jax.Array | None = None,
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
    Returns:
      ``[b, s / t, out]`` in ``x.dtype``: the sum over ``axis_name``, this device's chunk.
    """
    fsdp_axes = tuple(fsdp_axes)
    name = "row_sequence_parallel_matmul"
    h = x if activation is None else jax.eval_shape(activation, x)
    seq_dim = _sequence_checks(name, h, kernel, bias, seq_dim, fsdp_axes, 1)
    check_divisible(x, seq_dim, axis_name, name)
    if activation is not None and h.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"{name}: activation must keep every dimension of x {x.shape} but "
                         f"the last (features); it gave {h.shape}.")
    args = _vary_all(x, kernel, bias, {axis_name, *fsdp_axes})
    static = (axis_name, seq_dim, _static_dtype(wgrad_dtype))
    rule = "row_sequence"
    if activation is not None:
        rule, static = "row_sequence_activated", (activation, *static)
    return _apply(rule, *args, static, ring=collective_matmul and lax.axis_size(axis_name) > 1,
                  fsdp_axes=fsdp_axes, fsdp_dim=1, fp8=fp8, fp8_history=fp8_history)


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
    fp8: Fp8Spec | None = None,
    fp8_history: jax.Array | None = None,
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
      fp8, fp8_history: as :func:`matmul`; the shard is quantised before the all-gather
        (e4m3 bytes move, in the ring too) and the residual is the e4m3 shard
        (``recompute_allgather``) or the gathered e4m3 input.
    Returns:
      ``[b, s, out / t]`` in ``x.dtype``, varying over ``axis_name``.
    """
    fsdp_axes = tuple(fsdp_axes)
    _check_fp8("column_sequence_parallel_matmul", fp8, fp8_history)
    seq_dim = _sequence_checks("column_sequence_parallel_matmul", x, kernel, bias, seq_dim,
                               fsdp_axes, 0)
    args = _vary_all(x, kernel, bias, {axis_name, *fsdp_axes})
    static = (axis_name, seq_dim, bool(recompute_allgather), _static_dtype(wgrad_dtype))
    return _apply("column_sequence", *args, static,
                  ring=collective_matmul and lax.axis_size(axis_name) > 1,
                  fsdp_axes=fsdp_axes, fsdp_dim=0, fp8=fp8, fp8_history=fp8_history)
