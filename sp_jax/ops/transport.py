"""The transports of the sequence-parallel linear rules: how the sequence shards meet the
GEMM. :class:`Collectives` all-gathers and reduce-scatters whole arrays; :class:`Ring`
decomposes each collective into a bidirectional ring of ``t - 1`` collective-permutes,
each overlapped with the GEMM of one sequence chunk, forward and backward (collective
matmul: Megatron's ``tp_comm_overlap``; Wang et al. 2023; the schedules are
:mod:`sp_jax.ring`'s).

A transport is a frozen dataclass (a static argument of the ops) with six methods, each
given the rule's GEMM object (:mod:`sp_jax.ops.gemm`), whose operands it moves as they
are (compute dtype, or FP8 bytes); the backward methods compute the input gradient, and
the ``*_wgrad`` ones the weight gradient from what those hand out (the rules' input- and
weight-gradient parts, :mod:`sp_jax.ops.rules`):

==========================================  ==========================================
method                                      what it does
==========================================  ==========================================
``column_forward(gemm, a, w, ctx, x, keep)``  ``gemm(all_gather(a), w)``, and the gathered
                                            ``a`` when ``keep``
``column_backward(gemm, a, kernel, ctx,``   the column rule's ``dx`` (reduce-scattered),
``dy, recompute)``                          the gathered ``a``, the GEMM cotangent and
                                            context; ``recompute``: ``a`` is the shard,
                                            gathered again
``column_wgrad(gemm, a, gq, ctx)``          the column rule's weight gradient
``row_forward(gemm, a, w, ctx, dtype)``     ``reduce_scatter(gemm(a, w))``
``row_backward(gemm, a, kernel, ctx, gq,``  the row rule's ``dh`` and the all-gathered
``g)``                                      GEMM cotangent ``gq``
``row_wgrad(gemm, a, gq_full, ctx)``        the row rule's weight gradient
==========================================  ==========================================

HLO scope names (``sp_regather``, ``sp_cm_column_bwd``, ...) carry the GEMM's tag
(``sp_fp8_regather``, ``sp_cm_column_fp8_bwd``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
from jax import lax

from sp_jax.ops.primitives import AxisName, all_gather, fresh_zeros, reduce_scatter
from sp_jax.ring import ring_gather, ring_reduce_scatter

__all__ = ["Collectives", "Ring"]


def _scope(name: str | None):
    return contextlib.nullcontext() if name is None else jax.named_scope(name)


def _sp(gemm, what: str) -> str:
    """``sp_<what>``, or ``sp_<tag>_<what>`` for a tagged GEMM."""
    return f"sp_{gemm.tag}_{what}" if gemm.tag else f"sp_{what}"


def _chunk(x: jax.Array, position, size: int, dim: int) -> jax.Array:
    """Chunk ``position`` (traced) of ``x`` along ``dim``, ``size`` long."""
    return lax.dynamic_slice_in_dim(x, position * size, size, axis=dim)


def _put(buf: jax.Array, value: jax.Array, position, dim: int) -> jax.Array:
    """``buf`` with chunk ``position`` along ``dim`` replaced by ``value``."""
    return lax.dynamic_update_slice_in_dim(buf, value, position * value.shape[dim], axis=dim)


@dataclasses.dataclass(frozen=True)
class Collectives:
    """All-gathers and reduce-scatters of whole arrays over ``axis_name`` along
    ``seq_dim``."""

    axis_name: AxisName
    seq_dim: int

    def column_forward(self, gemm, a, w, ctx, x, keep: bool):
        with _scope(_sp(gemm, "all_gather") if gemm.tag else None):
            a_full = all_gather(a, self.axis_name, self.seq_dim)
        return gemm.forward(a_full, w, ctx, x.dtype), a_full if keep else None

    def column_backward(self, gemm, a, kernel, ctx, dy, recompute: bool):
        a, kernel, gq, ctx = gemm.cotangent(a, kernel, ctx, dy, recompute)
        if recompute:
            with jax.named_scope(_sp(gemm, "regather")):
                a = all_gather(a, self.axis_name, self.seq_dim)
        # dx does not depend on the re-gather and the reduce-scatter does not depend on
        # the dW matmul, so XLA may overlap gather || dx-matmul and reduce-scatter ||
        # dW-matmul.
        dx = gemm.backward(gq, gemm.kernel_for(kernel, gq, ctx), ctx, dy.dtype)
        with jax.named_scope("sp_dx_reduce_scatter"):  # names show in HLO and profiles
            dx = reduce_scatter(dx, self.axis_name, self.seq_dim)
        return dx, a, gq, ctx

    def column_wgrad(self, gemm, a, gq, ctx):
        return gemm.wgrad(a, gq, ctx)

    def row_forward(self, gemm, a, w, ctx, dtype):
        return reduce_scatter(gemm.forward(a, w, ctx, dtype), self.axis_name, self.seq_dim)

    def row_backward(self, gemm, a, kernel, ctx, gq, g):
        with jax.named_scope(_sp(gemm, "dy_all_gather")):
            gq_full = all_gather(gq, self.axis_name, self.seq_dim)
        dh = gemm.backward(gq_full, gemm.kernel_for(kernel, gq_full, ctx), ctx, g.dtype)
        return dh, gq_full

    row_wgrad = column_wgrad


@dataclasses.dataclass(frozen=True)
class Ring:
    """The collectives of :class:`Collectives` as bidirectional rings of
    collective-permutes over ``axis_name``, each transfer overlapped with the GEMM of one
    chunk along ``seq_dim``.

    Buffers that chunks are assembled in come from :func:`fresh_zeros`: a ``jnp.zeros``
    constant is shared by every layer and kept alive across them, a fixed ``[b, s, h]``
    and ``[b, s, mlp_hidden / t]`` on top of the plain path (measured: +80 MiB at 4
    layers, s=8192; a barrier with the buffer's source did not prevent the sharing)."""

    axis_name: AxisName
    seq_dim: int

    def _ring_scope(self, gemm, rule: str, backward: bool = False) -> str:
        tag = f"_{gemm.tag}" if gemm.tag else ""
        return f"sp_cm_{rule}{tag}{'_bwd' if backward else ''}"

    def column_forward(self, gemm, a, w, ctx, x, keep: bool):
        dim = self.seq_dim
        full = list(a.shape)
        full[dim] *= lax.axis_size(self.axis_name)
        out = [*full[:-1], w.shape[1]]

        def fn(acc, position, chunk):
            y, a_full = acc
            y = _put(y, gemm.forward(chunk, w, ctx, x.dtype), position, dim)
            if a_full is not None:  # save mode keeps the gathered input for backward
                a_full = _put(a_full, chunk, position, dim)
            return y, a_full

        with jax.named_scope(self._ring_scope(gemm, "column")):
            init = (fresh_zeros(out, x.dtype, x),
                    fresh_zeros(full, a.dtype, x) if keep else None)
            return ring_gather(a, self.axis_name, fn, init)

    def column_backward(self, gemm, a, kernel, ctx, dy, recompute: bool):
        a, kernel, gq, ctx = gemm.cotangent(a, kernel, ctx, dy, False)
        w = gemm.kernel_for(kernel, gq, ctx)
        t, dim = lax.axis_size(self.axis_name), self.seq_dim
        n = dy.shape[dim] // t

        def partial_dx(g, position):
            return gemm.backward(_chunk(g, position, n, dim), w, ctx, dy.dtype)

        with jax.named_scope(self._ring_scope(gemm, "column", backward=True)):
            if recompute:
                # The input's chunks travel the ring again, in lockstep with the dx ring,
                # so that each transfer runs during a dx GEMM; tied to dy, so that CSE
                # cannot reuse the forward ring's transfers (which would keep every
                # received chunk alive from forward to backward).
                a, _ = gemm.tie_input(a, dy)
                full = list(a.shape)
                full[dim] *= t
                # the buffer from the tied input, or from dy where the input is FP8
                seed = a if a.dtype == dy.dtype else dy
                dx, a = ring_reduce_scatter(
                    gq, self.axis_name, partial_dx,
                    gather=(a, lambda buf, position, chunk: _put(buf, chunk, position, dim),
                            fresh_zeros(full, a.dtype, seed)))
            else:
                dx = ring_reduce_scatter(gq, self.axis_name, partial_dx)
            return dx, a, gq, ctx

    def _wgrad(self, gemm, rule: str, a, gq, ctx):
        """The weight gradient, under the ring's backward scope (one GEMM: ``a`` and
        ``gq`` have arrived whole)."""
        with jax.named_scope(self._ring_scope(gemm, rule, backward=True)):
            return gemm.wgrad(a, gq, ctx)

    def column_wgrad(self, gemm, a, gq, ctx):
        return self._wgrad(gemm, "column", a, gq, ctx)

    def row_forward(self, gemm, a, w, ctx, dtype):
        dim = self.seq_dim
        n = a.shape[dim] // lax.axis_size(self.axis_name)
        with jax.named_scope(self._ring_scope(gemm, "row")):
            return ring_reduce_scatter(
                a, self.axis_name,
                lambda a, position: gemm.forward(_chunk(a, position, n, dim), w, ctx, dtype))

    def row_backward(self, gemm, a, kernel, ctx, gq, g):
        w = gemm.kernel_for(kernel, gq, ctx)
        dim = self.seq_dim

        def fn(carry, position, chunk):
            dh, gq_full = carry
            dh = _put(dh, gemm.backward(chunk, w, ctx, g.dtype), position, dim)
            return dh, _put(gq_full, chunk, position, dim)

        with jax.named_scope(self._ring_scope(gemm, "row", backward=True)):
            # dy's chunks arrive one by one, each feeding its dx GEMM; they are also kept
            # in one buffer for the weight gradient, a single GEMM once all have arrived
            # (row_wgrad).
            full = list(gq.shape)
            full[dim] = a.shape[dim]
            return ring_gather(
                gq, self.axis_name, fn,
                (fresh_zeros((*a.shape[:-1], kernel.shape[0]), g.dtype, g),
                 fresh_zeros(full, gq.dtype, g)))

    def row_wgrad(self, gemm, a, gq_full, ctx):
        return self._wgrad(gemm, "row", a, gq_full, ctx)
