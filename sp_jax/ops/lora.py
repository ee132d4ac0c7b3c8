"""Low-rank adapters inside a linear op: :class:`LoRAKernel`, the kernel of an adapted
layer (the frozen base ``w`` and its adapters ``a``, ``b``), and :class:`LoRAGemm`, the
GEMM object (:mod:`sp_jax.ops.gemm`) that multiplies with it.

``y = x @ w + scale * (x @ a) @ b``, one GEMM object of the linear rules
(:mod:`sp_jax.ops.rules`): every rule, transport and wrapper runs it as it runs the
plain GEMM, so the adapter shares the base's collectives. A column rule's gathered input
(or each ring chunk of it, with collective matmul) feeds the base and ``a`` once; a row
rule's adapter product joins the base's partial sums before the one reduce-scatter
(all-reduce); the backward's input gradient ``g @ w.T + scale * (g @ b.T) @ a.T`` is
reduce-scattered (all-reduced) once with the base's. The base is frozen: the weight
gradient is the adapters' only (``dw`` is None, a zero cotangent: no weight-gradient
GEMM of the base kernel exists in the program).

The adapters are split as the base layer's kind says (torchtitan's ``lora.py`` rule): a
column layer's ``a [in, r]`` is replicated over the tensor axis and its ``b [r, out]``
split by columns like the base; a row layer's ``a`` is split by rows like the base and
its ``b`` replicated. The sums their gradients need (a column layer's ``da`` over the
tensor axis, a row layer's ``db`` over it, both over the data and context axes) are the
transposes of casting each adapter to vary where the input does
(:class:`~sp_jax.ops.rules.Varying`, per leaf of the kernel); under FSDP only ``w`` is
sharded over the data axes and gathered in the op (:class:`~sp_jax.ops.fsdp.Fsdp`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
from jax import lax

from sp_jax.ops.gemm import ComputeGemm, bwd_cast, dot_nt, wgrad
from sp_jax.ops.quant import QuantizedKernel, kernel_shape

__all__ = ["LoRAGemm", "LoRAKernel", "is_lora"]


class LoRAKernel(NamedTuple):
    """The kernel of an adapted linear op: the frozen base ``w [in, out]`` and the
    adapters ``a [in, r]``, ``b [r, out]`` (per device: this device's blocks). A pytree;
    ``shape`` / ``ndim`` are the base's (what shape checks read), ``dtype`` the
    adapters' (the dtype of the op's weight gradient)."""

    w: Any  # an array, or a QuantizedKernel (QLoRA: dequantised in the op)
    a: Any
    b: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return kernel_shape(self.w)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.a.dtype


def is_lora(kernel: Any) -> bool:
    """Whether ``kernel`` is an adapted layer's :class:`LoRAKernel`."""
    return isinstance(kernel, LoRAKernel)


def _mm(x, w):
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


@dataclasses.dataclass(frozen=True)
class LoRAGemm(ComputeGemm):
    """The GEMM of an adapted linear layer, in the compute dtype: ``x @ w + scale * (x @
    a) @ b`` with the kernel a :class:`LoRAKernel`; the weight gradient is the
    adapters' (``da``, ``db`` accumulated in ``wgrad_dtype``, in the adapters' dtype),
    the frozen base's None. What it does not override (no recorded values, no state,
    the bias's cotangent, ``tie_input``) is :class:`~sp_jax.ops.gemm.ComputeGemm`'s.

    Attributes:
      scale: the adapter's factor (``alpha / rank``).
      wgrad_dtype / param_dtype: as :class:`~sp_jax.ops.gemm.ComputeGemm`'s
        (``param_dtype``: the adapters').
    """

    scale: float = 1.0

    def operands(self, x, kernel, state):
        """``(x, kernel in x's dtype, ctx)``: ``ctx`` the adapters in the compute dtype,
        which the weight gradient multiplies with."""
        if not is_lora(kernel):
            raise TypeError(f"LoRAGemm: the kernel must be a LoRAKernel(w, a, b), got "
                            f"{type(kernel).__name__}.")
        if isinstance(kernel.w, QuantizedKernel):
            # Tied to the input, as the backward's dequantisation is tied to its cotangent
            # (kernel_for): it runs where its GEMM runs, in each layer of a scanned stack,
            # and cannot be hoisted or merged with another layer's or the backward's.
            base, x = lax.optimization_barrier((kernel.w, x))
            kernel = kernel._replace(w=base)
        w = LoRAKernel(*(k.astype(x.dtype) for k in kernel))
        return x, w, (w.a, w.b)

    def forward(self, a, w, ctx, dtype):
        base = _mm(a, w.w)
        return base + (_mm(_mm(a, w.a), w.b) * self.scale).astype(base.dtype)

    def cotangent(self, a, kernel, ctx, g, tie_input: bool):
        """As :meth:`ComputeGemm.cotangent <sp_jax.ops.gemm.ComputeGemm.cotangent>`: with
        ``tie_input`` the input tied to ``g`` (a re-gather cannot be merged with the
        forward's); the kernel is cast by :meth:`kernel_for`."""
        if tie_input:
            a, g = lax.optimization_barrier((a, g))
        return a, kernel, g, ctx

    def kernel_for(self, kernel, g, ctx, tie: bool = True):
        """The kernel in the dtype of ``g``, cast (a quantized base: dequantised) behind
        a barrier with ``g`` (:func:`~sp_jax.ops.gemm.bwd_cast`: not merged with the
        forward's cast, which would keep it alive from forward to backward)."""
        def cast(k):
            if isinstance(k, QuantizedKernel):
                if tie:
                    k, _ = lax.optimization_barrier((k, g))
                return k.astype(g.dtype)
            return bwd_cast(k, g) if tie else k.astype(g.dtype)
        return LoRAKernel(*(cast(k) for k in kernel))

    def backward(self, g, w, ctx, dtype):
        dx = dot_nt(g, w.w)
        return dx + (dot_nt(dot_nt(g, w.b), w.a) * self.scale).astype(dx.dtype)

    def wgrad(self, a, g, ctx):
        """``LoRAKernel(None, da, db)``: ``da = scale * a.T (g @ b.T)``, ``db = scale *
        (a @ a_).T g``, the frozen base's gradient None (a zero cotangent)."""
        la, lb = ctx
        g = g * jax.numpy.asarray(self.scale, g.dtype)
        da = wgrad(a, dot_nt(g, lb.astype(g.dtype)), self.wgrad_dtype, self.param_dtype)
        db = wgrad(_mm(a, la.astype(a.dtype)), g, self.wgrad_dtype, self.param_dtype)
        return LoRAKernel(None, da, db)

    def wgrad_values(self, ctx):
        raise NotImplementedError("LoRAGemm: a deferred weight gradient (zero-bubble "
                                  "schedules) of adapted layers is not implemented.")

    def wgrad_context(self, state, values):
        raise NotImplementedError("LoRAGemm: a deferred weight gradient (zero-bubble "
                                  "schedules) of adapted layers is not implemented.")
