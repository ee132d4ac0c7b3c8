"""FP8 arithmetic, per device: per-tensor scales from whole-tensor amaxes, quantisation to
``float8_e4m3fn`` / ``float8_e5m2``, FP8 GEMMs accumulated in fp32, and the amax history
of delayed scaling.

Conventions (Flax's ``fp8_ops``, the form XLA:GPU rewrites into cuBLASLt FP8 GEMMs):

* ``scale`` is the *dequantisation* factor, an fp32 scalar: ``x ~ q * scale``.
  ``scale = amax * 2**margin / fp8_max`` (1 where ``amax`` is 0 or not finite).
* ``quantize(x, dtype, scale) = clip(float32(x) / scale, -fp8_max, fp8_max)`` cast to
  ``dtype`` (round to nearest even): values beyond the format saturate at its largest
  value instead of becoming NaN.
* An FP8 GEMM ``a @ b`` is ``dot(float32(qa) * sa, float32(qb) * sb)`` accumulated in
  fp32 (``preferred_element_type``) and cast to the output dtype; XLA:GPU runs it as one
  ``__cublas$lt$matmul$f8`` custom call with the two scales as its scale operands
  (with ``xla_gpu_enable_triton_gemm=false``; see :mod:`sp_jax.xla_flags`).

The amax of a tensor is the amax of the *whole* tensor: :func:`whole_amax` takes the
maximum over the mesh axes its shards span, so a sharded layer quantises exactly as the
unsharded one does.

Roles: every FP8 linear op quantises three tensors, in this order of the rows of its
amax history: its input (e4m3), its kernel (e4m3) and the gradient of its output (e5m2).

:class:`Fp8Gemm` is the GEMM object of the linear rules in FP8 (the methods of
:class:`sp_jax.ops.gemm.ComputeGemm`): inputs and weights in e4m3, output gradients in
e5m2, fp32 accumulation. The rules' transports then move FP8 where they gather: the
column sequence-parallel op quantises its shard and all-gathers e4m3 bytes (the ring
moves e4m3 chunks), and keeps the e4m3 shard (``recompute``, gathered again in e4m3) or
the gathered e4m3 input; the row op keeps the e4m3 input (with an activation, its input,
quantised again in the backward) and all-gathers ``dy`` as e5m2. Reductions (the
reduce-scatter of ``y`` and of ``dx``, the all-reduce of ``dx``) stay in the compute
dtype. The kernel is kept as given and quantised again in the backward pass with the
forward's scale (the same bytes; no FP8 copy of every weight stays alive). The op's
state is the amax history ``[3, n]`` of delayed scaling (``None`` with current
scaling), whose cotangent is this step's amaxes (:func:`history_amax_cotangent`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.config import Fp8Recipe
from sp_jax.ops.gemm import Gemm
from sp_jax.ops.grouped import grouped_matmul, grouped_wgrad
from sp_jax.ops.primitives import AxisName, vma

__all__ = ["E4M3", "E5M2", "FORMATS", "GRAD", "INPUT", "KERNEL", "Fp8Context", "Fp8Gemm",
           "Fp8Spec", "dequantize",
           "fp8_max", "gemm", "history_amax_cotangent", "local_amax", "over_shards",
           "quantize", "roll_history", "scale_from_amax", "whole_amax"]

E4M3 = jnp.float8_e4m3fn
"""The format of inputs and weights (max 448)."""
E5M2 = jnp.float8_e5m2
"""The format of output gradients (max 57344: range over precision)."""

INPUT, KERNEL, GRAD = 0, 1, 2
"""The rows of an amax history ``[3, amax_history_len]``."""
FORMATS = (E4M3, E4M3, E5M2)
"""The format of each role (``FORMATS[INPUT]`` ...)."""


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
    """What an FP8 linear op needs to know beyond its operands (hashable: a static
    argument of the op).

    Attributes:
      recipe: the :class:`~sp_jax.Fp8Recipe`.
      amax_axes: the mesh axes a tensor's shards may span (data, context and tensor
        axes): a tensor's amax is the maximum over those of them it varies over.
      manual_axes: axes of ``amax_axes`` that an enclosing ``shard_map`` made manual
        without tracking which values vary over them (the data axes inside a
        pipeline, ``ParallelConfig.manual_data_axes``): the maximum is always taken
        over them (a scalar ``pmax``, a no-op on the values that do not vary).
    """

    recipe: Fp8Recipe
    amax_axes: tuple[AxisName, ...]
    manual_axes: tuple[AxisName, ...] = ()


def fp8_max(dtype) -> float:
    """The largest finite value of the FP8 ``dtype`` (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def local_amax(x: jax.Array) -> jax.Array:
    """``max |x|`` over this device's block, fp32."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def over_shards(amax: jax.Array, axes: Sequence[AxisName],
                manual: Sequence[AxisName] = ()) -> jax.Array:
    """The maximum of the per-device ``amax`` over those of ``axes`` it varies over (a
    tensor's shards; axes it is replicated over hold the same values and need no
    collective), and over the ``manual`` axes always (:class:`Fp8Spec`)."""
    over = tuple(dict.fromkeys((*(a for a in axes if a in vma(amax)), *manual)))
    return lax.pmax(amax, over) if over else amax


def whole_amax(x: jax.Array, axes: Sequence[AxisName],
               manual: Sequence[AxisName] = ()) -> jax.Array:
    """``max |x|`` over the whole tensor, fp32: :func:`local_amax`, then
    :func:`over_shards`."""
    return over_shards(local_amax(x), axes, manual)


def scale_from_amax(amax: jax.Array, dtype, margin: int = 0) -> jax.Array:
    """The dequantisation scale ``amax * 2**margin / fp8_max(dtype)`` (fp32); 1 where
    ``amax`` is 0 or not finite (nothing to scale, or a blow-up the step will reject)."""
    amax = jnp.asarray(amax, jnp.float32)
    scale = amax * jnp.float32(2.0 ** margin / fp8_max(dtype))
    return jnp.where((amax > 0) & jnp.isfinite(amax), scale, jnp.float32(1.0))


def quantize(x: jax.Array, dtype, scale: jax.Array) -> jax.Array:
    """``x / scale`` in fp32, saturated at ``±fp8_max(dtype)``, cast to ``dtype``."""
    m = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -m, m).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``float32(q) * scale``."""
    return q.astype(jnp.float32) * scale


def gemm(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array,
         contracting: tuple[Sequence[int], Sequence[int]], out_dtype) -> jax.Array:
    """The FP8 GEMM ``dot_general(a * a_scale, b * b_scale)`` over the ``contracting``
    dimensions (no batch dimensions), accumulated in fp32, in ``out_dtype``.

    Args:
      a, b: FP8 operands (e4m3 or e5m2; not both e5m2, which cuBLASLt lacks).
      a_scale, b_scale: their fp32 dequantisation scales.
    """
    dims = ((tuple(contracting[0]), tuple(contracting[1])), ((), ()))
    out = lax.dot_general(dequantize(a, a_scale), dequantize(b, b_scale), dims,
                          preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def roll_history(history: jax.Array, amax: jax.Array) -> jax.Array:
    """The amax history after one step: every entry moves one place back along the last
    axis (the oldest drops out) and ``amax`` becomes entry 0.

    Args:
      history: ``[..., n]`` (e.g. ``[3, amax_history_len]``, or stacked over layers).
      amax: ``[...]``, this step's amaxes.
    """
    return jnp.roll(history, 1, axis=-1).at[..., 0].set(amax.astype(history.dtype))


def history_amax_cotangent(history: jax.Array, amaxes: Sequence[jax.Array]) -> jax.Array:
    """The cotangent an FP8 op returns for its amax ``history`` ``[3, n]``: this step's
    amax of each role in column 0, zeros elsewhere (the training step combines those of
    its micro-batches by maximum and rolls them in with :func:`roll_history`)."""
    return jnp.zeros_like(history).at[:, 0].set(jnp.stack(amaxes).astype(history.dtype))


# (lhs contracting, rhs contracting, lhs ragged, rhs group) of the three grouped GEMMs
_FORWARD = ((1,), (1,), (0,), (0,))  # [rows, h] x [G, h, F] -> [rows, F]
_DGRAD = ((1,), (2,), (0,), (0,))    # [rows, F] x [G, h, F] -> [rows, h]
_WGRAD = ((0,), (0,), (0,), ())      # [rows, h] x [rows, F] -> [G, h, F]


def _scaled_ragged(a, a_scale, b, b_scale, group_sizes, dims, out_dtype):
    """The FP8 grouped GEMM of :func:`gemm`'s form: dequantised operands, fp32
    accumulation, in ``out_dtype``. One group (an expert per device): one
    :func:`jax.lax.ragged_dot_general`, which XLA:GPU runs as one cuBLASLt FP8 GEMM (the
    scales folded into cuBLASLt's). Several groups: the masked lowering would compute
    ``groups`` times the routed FLOPs, so the routed rows' tile loops
    (:func:`~sp_jax.ops.grouped.grouped_matmul`, :func:`~sp_jax.ops.grouped.grouped_wgrad`)
    on the FP8 values in bf16 (e4m3 and e5m2 values are exact in bf16; bf16 tensor-core
    GEMMs of exact products, fp32 accumulation) times the two whole-tensor scales."""
    if group_sizes.ndim == 2 and group_sizes.shape[1] == 1:
        group_sizes = jnp.sum(group_sizes, axis=0)  # blocks of one group: one group
    if group_sizes.ndim == 2 or group_sizes.shape[0] > 1:
        a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        if dims == _WGRAD:
            out = grouped_wgrad(a16, b16, group_sizes)
        else:
            out = grouped_matmul(a16, b16 if dims == _FORWARD else jnp.swapaxes(b16, 1, 2),
                                 group_sizes, preferred_element_type=jnp.float32)
        return (out * (a_scale * b_scale)).astype(out_dtype)
    a, b = dequantize(a, a_scale), dequantize(b, b_scale)
    lhs_c, rhs_c, ragged, group = dims
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=((lhs_c, rhs_c), ((), ())), lhs_ragged_dimensions=ragged,
        rhs_group_dimensions=group)
    out = lax.ragged_dot_general(a, b, group_sizes, numbers,
                                 preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _grouped_rows(x, group_sizes):
    """``x`` with its rows past ``sum(group_sizes)`` (in no group) zeroed: they enter
    neither a product nor an amax."""
    valid = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], x, jnp.zeros((), x.dtype))


class Fp8Context(NamedTuple):
    """What an FP8 op keeps from its forward for its backward besides the operands: the
    amax ``history`` (``None`` with current scaling), the dequantisation scales of its
    input, kernel and (in the backward) output gradient, and the amaxes it recorded, one
    per quantised role (delayed scaling; ``None`` each with current scaling)."""

    history: Any
    input_scale: Any
    kernel_scale: Any
    grad_scale: Any
    amaxes: tuple


@dataclasses.dataclass(frozen=True)
class Fp8Gemm(Gemm):
    """The GEMM of the linear rules in FP8 (the methods of
    :class:`sp_jax.ops.gemm.ComputeGemm`). Its state (``gemm_state``) is the amax history
    ``[3, amax_history_len]`` with delayed scaling, None with current scaling.

    Attributes:
      spec: the :class:`Fp8Spec`.
      wgrad_dtype: the weight gradient is accumulated in fp32, or a wider
        ``wgrad_dtype``.
      param_dtype: the kernel's own dtype, that of its gradient (None until an op binds
        it).
    """

    spec: Fp8Spec
    wgrad_dtype: Any = None
    param_dtype: Any = None
    tag = "fp8"
    ties_local_release = True
    """A local matmul's gradients leave together (with the recorded amaxes)."""
    releases_input_grad = True
    """A row op's release barrier holds the op's dx, after a fused activation's
    backward."""

    def init_state(self):
        """A zero amax history with delayed scaling (the first step then scales by 1: no
        amax is known yet), None with current scaling."""
        if not self.spec.recipe.delayed:
            return None
        return jnp.zeros((3, self.spec.recipe.amax_history_len), jnp.float32)

    def check_state(self, where: str, fp8_history) -> None:
        """ValueErrors naming ``where`` unless ``fp8_history`` (the state) is an amax
        history of the recipe's length exactly when it scales with delayed scaling."""
        if not self.spec.recipe.delayed:
            if fp8_history is not None:
                raise ValueError(f"{where}: fp8_history (gemm_state) is only for delayed "
                                 "scaling; current scaling (Fp8Recipe('current')) takes "
                                 "none.")
            return
        expected = (3, self.spec.recipe.amax_history_len)
        if fp8_history is None or fp8_history.shape != expected:
            got = None if fp8_history is None else fp8_history.shape
            raise ValueError(f"{where}: delayed scaling needs fp8_history of shape "
                             f"{expected} as gemm_state (input, kernel and output-gradient "
                             f"amaxes), got {got}.")

    def grouped_kernel(self, w, dtype):
        """The experts' kernel as given (quantised inside the op)."""
        return w

    def quantized(self, x, role: int, history):
        """``(q, scale, amax)`` of ``x`` in role ``role``. Current scaling (``history``
        None): ``scale`` from the whole tensor's amax, ``amax`` None. Delayed: ``scale``
        from the largest amax of ``history``'s row ``role``, and ``amax`` this device's
        block's amax, to be recorded: the op ties it to its outputs (an optimization
        barrier, so the reduction over ``x`` runs while ``x`` is alive instead of keeping
        it until the end of the step, where the scalars' all-reduces are combined) and
        reduces it over the shards after that (:meth:`state_cotangent`)."""
        if history is None:
            amax, recorded = whole_amax(x, self.spec.amax_axes, self.spec.manual_axes), None
        else:
            amax, recorded = jnp.max(history[role]), local_amax(x)
        scale = scale_from_amax(amax, FORMATS[role], self.spec.recipe.margin)
        return quantize(x, FORMATS[role], scale), scale, recorded

    def operands(self, x, kernel, history):
        qx, sx, ax = self.quantized(x, INPUT, history)
        qw, sw, aw = self.quantized(kernel, KERNEL, history)
        return qx, qw, Fp8Context(history, sx, sw, None, (ax, aw))

    def forward(self, a, w, ctx, dtype):
        return gemm(a, ctx.input_scale, w, ctx.kernel_scale, ((a.ndim - 1,), (0,)), dtype)

    def requantize(self, h, ctx):
        return quantize(h, E4M3, ctx.input_scale)

    def recorded(self, ctx):
        return ctx.amaxes

    def with_recorded(self, ctx, values):
        return ctx._replace(amaxes=values)

    def cotangent(self, a, kernel, ctx, g, tie_input: bool):
        """``g`` quantised to e5m2, tied with the saved input ``a`` and the kernel (so the
        kernel's quantisation, with the forward's scale, and any re-gather of ``a`` can be
        neither hoisted into the forward pass nor merged with it), whatever
        ``tie_input``."""
        qg, sg, ag = self.quantized(g, GRAD, ctx.history)
        a, kernel, qg = lax.optimization_barrier((a, kernel, qg))
        return a, kernel, qg, ctx._replace(grad_scale=sg, amaxes=(*ctx.amaxes, ag))

    def tie_input(self, a, g):
        return a, g  # tied by cotangent's barrier

    def kernel_for(self, kernel, g, ctx, tie: bool = True):
        return quantize(kernel, E4M3, ctx.kernel_scale)

    def backward(self, g, w, ctx, dtype):
        return gemm(g, ctx.grad_scale, w, ctx.kernel_scale, ((g.ndim - 1,), (1,)), dtype)

    def wgrad(self, a, g, ctx):
        """``sum over leading dims of a^T g`` of two FP8 tensors, accumulated in fp32 (or
        a wider ``wgrad_dtype``), in ``param_dtype``."""
        lead = tuple(range(a.ndim - 1))
        acc = jnp.promote_types(jnp.float32, self.wgrad_dtype or jnp.float32)
        return gemm(a, ctx.input_scale, g, ctx.grad_scale, (lead, lead),
                    acc).astype(self.param_dtype)

    def bias_cotangent(self, gq, g):
        return g  # gq is e5m2

    def state_cotangent(self, ctx):
        """The history's cotangent, this step's amaxes, reduced over the shards (after
        the barrier that released them: it types its outputs as varying; the amaxes are
        the same on every device once reduced)."""
        if ctx.history is None:
            return None
        return history_amax_cotangent(
            ctx.history, [over_shards(a, self.spec.amax_axes, self.spec.manual_axes)
                          for a in ctx.amaxes])

    def wgrad_values(self, ctx):
        """The scales of the input and the output gradient, and the recorded amaxes."""
        return ctx.input_scale, ctx.grad_scale, ctx.amaxes

    def wgrad_context(self, history, values):
        input_scale, grad_scale, amaxes = values
        return Fp8Context(history, input_scale, None, grad_scale, amaxes)

    # The grouped GEMMs (the experts'): the rows past the groups count as zero; one
    # cuBLASLt FP8 GEMM each with one group, the routed rows' tile loops with several
    # (_scaled_ragged).

    def grouped_operands(self, x, w, sizes, history):
        qx, sx, ax = self.quantized(_grouped_rows(x, sizes), INPUT, history)
        qw, sw, aw = self.quantized(w, KERNEL, history)
        return qx, qw, Fp8Context(history, sx, sw, None, (ax, aw))

    def grouped_forward(self, a, w, sizes, ctx, dtype, tile):
        return _scaled_ragged(a, ctx.input_scale, w, ctx.kernel_scale, sizes, _FORWARD,
                              dtype)

    def grouped_cotangent(self, a, w, sizes, ctx, g):
        # dy in e5m2, tied with the saved rows and the weights (their quantisation with
        # the forward's scale is neither hoisted into the forward nor merged with it)
        return self.cotangent(a, w, ctx, _grouped_rows(g, sizes), True)

    def grouped_dgrad(self, a, g, w, sizes, ctx, dtype, tile):
        return _scaled_ragged(g, ctx.grad_scale, self.kernel_for(w, g, ctx),
                              ctx.kernel_scale, sizes, _DGRAD, dtype)

    def grouped_wgrad(self, a, g, sizes, ctx, tile):
        return _scaled_ragged(a, ctx.input_scale, g, ctx.grad_scale, sizes, _WGRAD,
                              jnp.float32).astype(self.param_dtype)

    def grouped_backward(self, a, g, w, sizes, ctx, dtype, tile):
        return (self.grouped_dgrad(a, g, w, sizes, ctx, dtype, tile),
                self.grouped_wgrad(a, g, sizes, ctx, tile))
