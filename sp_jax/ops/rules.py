"""The linear rules: one forward and one backward per linear op, with the GEMM and the
transport passed in (the way ``flax.nnx.Linear(dot_general=...)`` injects its product).

A rule is a frozen dataclass (hashable: the static argument of the op) holding its
statics: a GEMM object (:class:`~sp_jax.ops.gemm.ComputeGemm`, or
:class:`~sp_jax.ops.fp8.Fp8Gemm`), for the sequence-parallel rules a transport
(:class:`~sp_jax.ops.transport.Collectives` or :class:`~sp_jax.ops.transport.Ring`),
and its options. Its methods:

* ``fwd(x, kernel, aux) -> (y, (a, kernel, (bias, ctx)))`` where ``aux = (bias,
  state)``: ``state`` is the GEMM's (the FP8 amax history of delayed scaling, else
  ``None``); the residuals hold the GEMM operand ``a`` (input or its gathered form, as
  the GEMM takes it), the kernel as given, the bias and the GEMM's context;
* ``bwd(res, g) -> (dx, dkernel, (dbias, dstate))``, the fused backward: the
  composition of its two parts below with the barriers that tie them
  (:func:`release`);
* ``bwd_input(res, g) -> (dx, wres)``: the input gradient alone (no weight-gradient
  GEMM); ``wres`` a :class:`WeightGradInputs`, what the weight gradient needs;
* ``bwd_weight(wres) -> (dkernel, (dbias, dstate))``: the weight-gradient part, which
  a pipeline may run at a later tick than ``bwd_input`` (zero-bubble schedules;
  :mod:`sp_jax.ops.deferred`, which also uses ``pack`` / ``unpack``: ``wres`` as the
  arrays a deferred op keeps).

The rules: :class:`Matmul` (local), :class:`Row` (a local product summed over the tensor
axis, then the bias: the row layer), :class:`Column`, :class:`ColumnSequence`,
:class:`RowSequence`, :class:`Grouped` (the experts' grouped GEMMs, ``aux = (sizes,
state)``), :class:`Decode` (the single-token product, forward only); wrappers
(:class:`RuleWrapper`): :class:`Offloaded`, :class:`Varying`, FSDP's
:class:`~sp_jax.ops.fsdp.Fsdp`.
:func:`linear_op` makes the custom-VJP op of a rule; the FSDP form is
:func:`sp_jax.ops.fsdp.fsdp_linear_op`, over any rule. A new precision is one GEMM
class, never a fork of a rule.

Optimization barriers, each placed where a measured XLA behaviour needs it: the GEMM's
``cotangent`` / ``tie_input`` / ``kernel_for`` tie residuals and the kernel's cast to
the incoming cotangent (no CSE with the forward pass); :func:`release` lets ``dx`` leave
with the weight and bias gradients (and the recorded amaxes); a GEMM that records
values in its forward ties them to the output (:func:`tied_output`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax

from sp_jax.ops.gemm import bgrad
from sp_jax.ops.primitives import AxisName, residuals_to_device, residuals_to_host, typed, vary, vma

__all__ = ["Column", "ColumnSequence", "Decode", "Grouped", "Matmul", "Offloaded", "Row",
           "RowSequence", "RuleWrapper", "Varying", "WeightGradInputs", "linear_op",
           "release", "tied_output", "varying"]


def _plus_bias(y, bias):
    return y if bias is None else y + bias.astype(y.dtype)


class WeightGradInputs(NamedTuple):
    """What a rule's weight-gradient part (``bwd_weight``) needs, handed out by its
    input-gradient part (``bwd_input``): per device, inside ``shard_map``.

    Attributes:
      a: the GEMM operand as the weight-gradient GEMM takes it (the gathered input of a
        column sequence-parallel op, e4m3 in FP8; the input of a row op, the
        activation's output recomputed).
      g: the output gradient as the GEMM takes it (all-gathered for a row op; e5m2 in
        FP8).
      bias_g: the cotangent the bias gradient sums (None without a bias).
      bias: the bias (its dtype is the gradient's), or None.
      ctx: the GEMM's context (FP8: scales and the recorded amaxes).
      sizes: the rows of each group of a grouped GEMM (:class:`Grouped`), else None.
    """

    a: Any
    g: Any
    bias_g: Any
    bias: Any
    ctx: Any
    sizes: Any = None


def _bias_cotangent(gemm, bias, gq, g):
    return None if bias is None else gemm.bias_cotangent(gq, g)


def _bias_grad(gemm, w: WeightGradInputs):
    return None if w.bias is None else bgrad(w.bias_g, gemm.wgrad_dtype, w.bias.dtype)


class _Rule:
    """The parts shared by the rules: the weight-gradient part from the GEMM (or the
    transport's ``*_wgrad``) and the fused backward, ``bwd_input`` then the weight
    gradients, released with dx (:func:`release`, tied when ``_tie``)."""

    def _wgrad(self, w: WeightGradInputs):
        return self.gemm.wgrad(w.a, w.g, w.ctx)

    def bwd_weight(self, w: WeightGradInputs):
        """``(dkernel, (dbias, dstate))`` from ``bwd_input``'s :class:`WeightGradInputs`."""
        return self._wgrad(w), (_bias_grad(self.gemm, w), self.gemm.state_cotangent(w.ctx))

    def pack(self, w: WeightGradInputs):
        """``w`` as the arrays a deferred op keeps (:mod:`sp_jax.ops.deferred`): ``(a, g,
        bias_g, values)``, ``bias_g`` None where it is ``g`` itself (or there is no
        bias), ``values`` the GEMM context's (scales, recorded amaxes); the bias and the
        GEMM's state are the op's own inputs again (:meth:`unpack`)."""
        bias_g = None if w.bias is None or w.bias_g is w.g else w.bias_g
        return w.a, w.g, bias_g, self.gemm.wgrad_values(w.ctx)

    def weight_aux(self, aux):
        """What of the op's ``aux`` a deferred weight-gradient part reads again
        (:meth:`unpack`): all of it (the bias and the GEMM's state, inputs of the op)."""
        return aux

    def unpack(self, arrays, aux) -> WeightGradInputs:
        """The :class:`WeightGradInputs` of :meth:`pack`'s ``arrays`` and the op's ``aux
        = (bias, state)``."""
        a, g, bias_g, values = arrays
        bias, state = aux
        if bias is not None and bias_g is None:
            bias_g = g
        return WeightGradInputs(a, g, bias_g, bias, self.gemm.wgrad_context(state, values))

    def _tie(self) -> bool:
        return True

    def bwd(self, res, g):
        dx, w = self.bwd_input(res, g)
        return release(self.gemm, dx, self._wgrad(w), _bias_grad(self.gemm, w), w.ctx,
                       tie=self._tie())


def tied_output(gemm, y, ctx):
    """``(y, ctx)``, the values ``gemm`` recorded in the forward (delayed scaling's
    amaxes) computed with ``y`` (an optimization barrier; none when nothing was
    recorded)."""
    values = gemm.recorded(ctx)
    if not jax.tree.leaves(values):
        return y, ctx
    y, values = lax.optimization_barrier((y, values))
    return y, gemm.with_recorded(ctx, values)


def release(gemm, dx, dkernel, dbias, ctx, tie: bool):
    """``(dx, dkernel, (dbias, dstate))``. With ``tie``, dx is released together with dW
    and db (and the recorded amaxes): Megatron's async dx collective, waited for after
    the dW GEMM; the scheduler then runs dx's collective while dW is computed instead of
    serialising it on the critical path, and neither the gathered input nor dy waits for
    a weight-gradient GEMM or bias sum scheduled at the end of the backward pass."""
    values = gemm.recorded(ctx)
    if tie:
        dx, dkernel, dbias, values = lax.optimization_barrier((dx, dkernel, dbias, values))
    return dx, dkernel, (dbias, gemm.state_cotangent(gemm.with_recorded(ctx, values)))


@dataclasses.dataclass(frozen=True)
class Matmul(_Rule):
    """Local ``x @ kernel`` (no collective, no bias)."""

    gemm: Any

    def fwd(self, x, kernel, aux):
        bias, state = aux
        a, w, ctx = self.gemm.operands(x, kernel, state)
        y, ctx = tied_output(self.gemm, self.gemm.forward(a, w, ctx, x.dtype), ctx)
        return y, (a, kernel, (bias, ctx))

    def bwd_input(self, res, g):
        gemm, (a, kernel, (_, ctx)) = self.gemm, res
        a, kernel, gq, ctx = gemm.cotangent(a, kernel, ctx, g, False)
        dx = gemm.backward(gq, gemm.kernel_for(kernel, gq, ctx, tie=False), ctx, g.dtype)
        return dx, WeightGradInputs(a, gq, None, None, ctx)

    def _tie(self) -> bool:
        return self.gemm.ties_local_release


@dataclasses.dataclass(frozen=True)
class Column(_Rule):
    """``x @ kernel + bias`` entering the tensor region over ``axis_name``: the backward
    all-reduces dx while dW is computed."""

    gemm: Any
    axis_name: AxisName

    def fwd(self, x, kernel, aux):
        bias, state = aux
        a, w, ctx = self.gemm.operands(vary(x, (self.axis_name,)), kernel, state)
        y = _plus_bias(self.gemm.forward(a, w, ctx, x.dtype), bias)
        y, ctx = tied_output(self.gemm, y, ctx)
        return y, (a, kernel, (bias, ctx))

    def bwd_input(self, res, g):
        gemm, (a, kernel, (bias, ctx)) = self.gemm, res
        a, kernel, gq, ctx = gemm.cotangent(a, kernel, ctx, g, False)
        dx = gemm.backward(gq, gemm.kernel_for(kernel, gq, ctx), ctx, g.dtype)
        # dW and db after dx (Megatron's order: dgrad, then wgrad while dx is all-reduced)
        a, gq, _, values = lax.optimization_barrier(
            (vary(a, (self.axis_name,)), gq, dx, gemm.recorded(ctx)))
        with jax.named_scope("tp_dx_all_reduce"):  # names show in HLO and profiles
            dx = lax.psum(dx, self.axis_name)
        return dx, WeightGradInputs(a, gq, _bias_cotangent(gemm, bias, gq, g), bias,
                                    gemm.with_recorded(ctx, values))

    def _tie(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class Row(_Rule):
    """``psum(rule(x, kernel), axis_name) + bias``: a row-parallel layer's local product
    (``rule``: :class:`Matmul`, or its offloaded or FSDP form) summed over the tensor axis
    by one all-reduce, the bias added once after the sum. The backward takes the sum's
    cotangent as it is (identity: Megatron's ``reduce_from``), sums the bias gradient
    from it, and is then ``rule``'s."""

    rule: Any
    axis_name: AxisName

    @property
    def gemm(self):
        return self.rule.gemm

    def fwd(self, x, kernel, aux):
        bias, state = aux
        y, (a, kernel, (_, ctx)) = self.rule.fwd(x, kernel, (None, state))
        y = lax.psum(vary(y, (self.axis_name,)), self.axis_name)
        if bias is not None:  # once, after the sum, varying as the sum does
            y = y + vary(bias, vma(y)).astype(y.dtype)
        return y, (a, kernel, (bias, ctx))

    def _inner(self, res, g):
        """The local product's residuals and cotangent (varying over the tensor axis)."""
        a, kernel, (_, ctx) = res
        return (a, kernel, (None, ctx)), vary(g, (self.axis_name,))

    def bwd_input(self, res, g):
        dx, w = self.rule.bwd_input(*self._inner(res, g))
        bias = res[2][0]
        return dx, w._replace(bias_g=None if bias is None else g, bias=bias)

    def _bias_grad(self, w):
        """The bias gradient, summed over the mesh axes the sum's cotangent varies over
        and the bias does not (the transpose of its cast to vary)."""
        db = _bias_grad(self.gemm, w)
        extra = () if db is None else tuple(
            a for a in sorted(vma(w.bias_g)) if a not in vma(w.bias))
        return lax.psum(db, extra) if extra else db

    def bwd_weight(self, w):
        dkernel, (_, dstate) = self.rule.bwd_weight(w)
        return dkernel, (self._bias_grad(w), dstate)

    def bwd(self, res, g):
        bias = res[2][0]
        db = None if bias is None else self._bias_grad(WeightGradInputs(
            None, None, g, bias, None))
        dx, dkernel, (_, dstate) = self.rule.bwd(*self._inner(res, g))
        return dx, dkernel, (db, dstate)


@dataclasses.dataclass(frozen=True)
class Decode:
    """The single-token (decode) product, forward only: ``x @ kernel`` (the GEMM's
    forward), summed over ``axis_name`` by one all-reduce when given, then ``+ bias``.
    ``fwd`` as the other rules' (no residuals: decoding has no backward)."""

    gemm: Any
    axis_name: AxisName | None = None

    def fwd(self, x, kernel, aux):
        bias, state = aux
        a, w, ctx = self.gemm.operands(x, kernel, state)
        y = self.gemm.forward(a, w, ctx, x.dtype)
        if self.axis_name is not None:
            y = lax.psum(y, self.axis_name)
        return (y if bias is None else y + bias.astype(y.dtype)), None


@dataclasses.dataclass(frozen=True)
class ColumnSequence(_Rule):
    """``all_gather(x, seq) @ kernel + bias``; the backward reduce-scatters dx. The
    residual is the GEMM operand's shard (``recompute``, gathered again in the
    backward) or its gathered form."""

    gemm: Any
    transport: Any
    recompute: bool

    def fwd(self, x, kernel, aux):
        bias, state = aux
        a, w, ctx = self.gemm.operands(x, kernel, state)
        y, a_full = self.transport.column_forward(self.gemm, a, w, ctx, x, not self.recompute)
        y, ctx = tied_output(self.gemm, _plus_bias(y, bias), ctx)
        # kernel and bias are the caller's own arrays: keeping them costs no extra memory
        return y, (a if self.recompute else a_full, kernel, (bias, ctx))

    def bwd_input(self, res, dy):
        gemm, (a, kernel, (bias, ctx)) = self.gemm, res
        dx, a, gq, ctx = self.transport.column_backward(gemm, a, kernel, ctx, dy,
                                                        self.recompute)
        return dx, WeightGradInputs(a, gq, _bias_cotangent(gemm, bias, gq, dy), bias, ctx)

    def _wgrad(self, w):
        return self.transport.column_wgrad(self.gemm, w.a, w.g, w.ctx)


@dataclasses.dataclass(frozen=True)
class RowSequence(_Rule):
    """``reduce_scatter(activation(x) @ kernel, seq) + bias``; the backward all-gathers
    dy once for dx and dW. With an ``activation`` the residual is its input, not its
    output, and the backward computes the output again (an elementwise op) for the
    weight gradient and differentiates it: without this an MLP keeps its hidden layer
    twice (the activation's input for the activation's backward and its output for the
    down projection's weight gradient)."""

    gemm: Any
    transport: Any
    activation: Callable | None = None

    def fwd(self, x, kernel, aux):
        bias, state = aux
        h = x if self.activation is None else self.activation(x)
        a, w, ctx = self.gemm.operands(h, kernel, state)
        y = self.transport.row_forward(self.gemm, a, w, ctx, x.dtype)
        y, ctx = tied_output(self.gemm, _plus_bias(y, bias), ctx)
        return y, (a if self.activation is None else x, kernel, (bias, ctx))

    def _input(self, res, g):
        """``(dh, activation_vjp, wres)``: the GEMM's input gradient ``dh`` (before the
        activation's backward, ``activation_vjp``, None without an activation)."""
        gemm, (a, kernel, (bias, ctx)) = self.gemm, res
        activation_vjp = None
        if self.activation is not None:
            # Tied to the cotangent: the recomputed activation can be neither hoisted into
            # the forward pass nor merged (CSE) with the forward one, which would keep the
            # activation's output alive until here and undo the saving.
            a, g = gemm.tie_input(a, g)
        a, kernel, gq, ctx = gemm.cotangent(a, kernel, ctx, g, False)
        if self.activation is not None:
            h, activation_vjp = jax.vjp(self.activation, a)
            a = gemm.requantize(h, ctx)
        dh, gq_full = self.transport.row_backward(gemm, a, kernel, ctx, gq, g)
        return dh, activation_vjp, WeightGradInputs(
            a, gq_full, _bias_cotangent(gemm, bias, gq, g), bias, ctx)

    def bwd_input(self, res, g):
        dh, activation_vjp, w = self._input(res, g)
        return dh if activation_vjp is None else activation_vjp(dh)[0], w

    def _wgrad(self, w):
        return self.transport.row_wgrad(self.gemm, w.a, w.g, w.ctx)

    def bwd(self, res, g):
        gemm = self.gemm
        dx, activation_vjp, w = self._input(res, g)
        # dW (and db) are computed together with dx: the gathered dy then dies in this
        # layer's backward instead of waiting for a dW GEMM XLA would otherwise put at the
        # end of the backward pass (one gathered dy per row layer alive at once).
        dkernel, dbias = self._wgrad(w), _bias_grad(gemm, w)
        # The activation's backward (elementwise) before or after the release, as the
        # GEMM releases (gemm.releases_input_grad).
        early = activation_vjp is not None and gemm.releases_input_grad
        if early:
            dx = activation_vjp(dx)[0]
        dx, dkernel, daux = release(gemm, dx, dkernel, dbias, w.ctx, tie=True)
        if activation_vjp is not None and not early:
            dx = activation_vjp(dx)[0]
        return dx, dkernel, daux


@dataclasses.dataclass(frozen=True)
class Grouped(_Rule):
    """The grouped GEMM ``x_g @ w[g]`` of rows sorted by group, ``aux = (sizes,
    state)`` with ``sizes`` the rows of each group (int32 ``[groups]``; rows past their
    sum in no group): the experts' GEMMs, local (no collective). The arithmetic is the
    GEMM's ``grouped_*`` methods (the compute dtype's tile loops, or FP8); ``tile``
    rows per GEMM of the loops (None: the platform's), ``out_dtype`` the output's."""

    gemm: Any
    tile: int | None
    out_dtype: Any

    def fwd(self, x, w, aux):
        sizes, state = aux
        a, wq, ctx = self.gemm.grouped_operands(x, w, sizes, state)
        y = self.gemm.grouped_forward(a, wq, sizes, ctx, self.out_dtype, self.tile)
        y, ctx = tied_output(self.gemm, y, ctx)
        return y, (a, w, (sizes, ctx))

    def _entry(self, res, g):
        a, w, (sizes, ctx) = res
        a, w, gq, ctx = self.gemm.grouped_cotangent(a, w, sizes, ctx, g)
        return a, w, gq, sizes, ctx

    def bwd_input(self, res, g):
        a, w, gq, sizes, ctx = self._entry(res, g)
        dx = self.gemm.grouped_dgrad(a, gq, w, sizes, ctx, g.dtype, self.tile)
        return dx, WeightGradInputs(a, gq, None, None, ctx, sizes)

    def bwd_weight(self, w: WeightGradInputs):
        return (self.gemm.grouped_wgrad(w.a, w.g, w.sizes, w.ctx, self.tile),
                (None, self.gemm.state_cotangent(w.ctx)))

    def bwd(self, res, g):
        a, w, gq, sizes, ctx = self._entry(res, g)
        dx, dw = self.gemm.grouped_backward(a, gq, w, sizes, ctx, g.dtype, self.tile)
        return dx, dw, (None, self.gemm.state_cotangent(ctx))

    def pack(self, w: WeightGradInputs):
        return w.a, w.g, w.sizes, self.gemm.wgrad_values(w.ctx)

    def weight_aux(self, aux):
        return None, aux[1]  # the group sizes are the B pass's, kept with wres

    def unpack(self, arrays, aux) -> WeightGradInputs:
        a, g, sizes, values = arrays
        return WeightGradInputs(a, g, None, None, self.gemm.wgrad_context(aux[1], values),
                                sizes)


class RuleWrapper:
    """A rule around another (``self.rule``, e.g. :class:`Offloaded`, FSDP's
    :class:`~sp_jax.ops.fsdp.Fsdp`): its GEMM, weight-gradient part and the packing of
    its deferred weight gradient are the inner rule's unless it says otherwise."""

    rule: Any

    @property
    def gemm(self):
        return self.rule.gemm

    def bwd_weight(self, w):
        return self.rule.bwd_weight(w)

    def pack(self, w):
        return self.rule.pack(w)

    def weight_aux(self, aux):
        return self.rule.weight_aux(aux)

    def unpack(self, arrays, aux):
        return self.rule.unpack(arrays, aux)


@dataclasses.dataclass(frozen=True)
class Offloaded(RuleWrapper):
    """``rule`` with its GEMM operand residual ``a`` (the local sequence shard of a
    recomputing column rule, else the gathered input; a row rule's input) kept in host
    memory between the forward and the backward pass
    (``ParallelConfig.offload_activations``): moved there at the end of ``fwd`` and
    back at the start of ``bwd``. The kernel and bias stay (they are the caller's
    parameters); so does the GEMM's context (scales: scalars)."""

    rule: Any

    def fwd(self, x, kernel, aux):
        y, (a, kernel, rest) = self.rule.fwd(x, kernel, aux)
        a, y = residuals_to_host(a, y)
        return y, (a, kernel, rest)

    def _back(self, res, g):
        a, kernel, rest = res
        a, g = residuals_to_device(a, g)
        return (a, kernel, rest), g

    def bwd(self, res, g):
        return self.rule.bwd(*self._back(res, g))

    def bwd_input(self, res, g):
        return self.rule.bwd_input(*self._back(res, g))


@dataclasses.dataclass(frozen=True)
class Varying(RuleWrapper):
    """``rule`` with its kernel cast to vary over the mesh ``axes`` inside the op (those
    the input varies over and the kernel does not: the data and context axes of a
    batch- or sequence-split input), and the kernel's gradient summed over them in the
    backward (the transpose of that cast). The residual is the kernel as the caller
    holds it: a kernel cast before the op is a new value, which a layer scan stacks as a
    residual of the backward pass (measured, deviceless 8 x H100, ``data_axis="data"``:
    a copy of every layer's fp32 kernels, 96 MiB per layer at h=4096, t=8)."""

    rule: Any
    axes: tuple[AxisName, ...]
    leaf_axes: tuple | None = None
    """Of a pytree kernel (:class:`~sp_jax.ops.lora.LoRAKernel`), the axes each leaf is
    cast over (those of ``axes`` it does not vary over itself)."""

    def fwd(self, x, kernel, aux):
        y, (a, _, rest) = self.rule.fwd(x, vary(kernel, self.axes), aux)
        return y, (a, kernel, rest)

    def _back(self, res):
        a, kernel, rest = res
        return a, vary(kernel, self.axes), rest

    def _sum(self, dkernel):
        if isinstance(dkernel, tuple):  # an adapted kernel: each gradient over the axes
            return type(dkernel)(*(  # its own leaf was cast to vary over
                None if d is None else lax.psum(d, axes) if axes else d
                for d, axes in zip(dkernel, self.leaf_axes, strict=True)))
        return lax.psum(dkernel, self.axes)

    def bwd(self, res, g):
        dx, dkernel, daux = self.rule.bwd(self._back(res), g)
        return dx, self._sum(dkernel), daux

    def bwd_input(self, res, g):
        return self.rule.bwd_input(self._back(res), g)

    def bwd_weight(self, w):
        dkernel, daux = self.rule.bwd_weight(w)
        return self._sum(dkernel), daux


def varying(rule: Any, kernel: jax.Array, axes) -> Any:
    """``rule`` run with ``kernel`` varying over the mesh ``axes`` (:class:`Varying`
    where it does not already: ``rule`` itself otherwise, and without VMA typing, where
    the cast and its transpose, the ``psum``, are no-ops: :func:`typed`)."""
    if isinstance(kernel, tuple):  # per leaf: an adapter may vary where the base does not
        leaf_axes = tuple(tuple(sorted(set(axes) - vma(k), key=str)) for k in kernel)
        missing = tuple(sorted(set().union(*leaf_axes), key=str))
        return Varying(rule, missing, leaf_axes) if missing and typed(missing) else rule
    missing = tuple(sorted(set(axes) - vma(kernel), key=str))
    return Varying(rule, missing) if missing and typed(missing) else rule


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def linear_op(x: jax.Array, kernel: jax.Array, aux: tuple, rule: Any) -> jax.Array:
    """The custom-VJP op of ``rule`` (its ``fwd`` and ``bwd``): ``aux = (bias, state)``."""
    return rule.fwd(x, kernel, aux)[0]


linear_op.defvjp(lambda x, kernel, aux, rule: rule.fwd(x, kernel, aux),
                 lambda rule, res, g: rule.bwd(res, g))
