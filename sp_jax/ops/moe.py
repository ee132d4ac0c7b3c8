"""Per-device ops of a mixture-of-experts layer (inside ``shard_map``): top-k routing, the
capacity rule, dispatch to the experts' devices and back by ragged all-to-all, and the
experts' grouped GEMMs (:func:`~sp_jax.ops.grouped.grouped_matmul`: one GEMM per tile of
the routed rows, never XLA's masked dense ``ragged_dot`` over every expert).

Dropless: every (token, choice) pair is computed. A device sorts its pairs by expert, so
each expert's rows are contiguous, sends each peer on the expert axis the rows of the
experts it holds (one ``ragged_all_to_all``: only the rows routed there move), groups what
it receives by its local experts, runs the grouped GEMMs, and sends the results back the
same way. The receive buffer is static: the most rows a device can receive,
``ep * tokens * min(k, experts / ep)`` (every token of every peer routed to its experts),
never a dense ``[tokens, experts, ...]`` one-hot dispatch; the grouped GEMMs loop over the
tiles of the rows actually received (a dynamic count), so it costs memory, not FLOPs.

XLA:CPU has no ``ragged-all-to-all``; there :func:`ragged_all_to_all` runs the same
exchange as an ``all_to_all`` of fixed-size chunks (each padded to the most rows one peer
can be sent), chosen at lowering time (:func:`jax.lax.platform_dependent`), so the CPU
tests run every other step of the GPU program.

The grouped GEMMs are the linear rule :class:`~sp_jax.ops.rules.Grouped` over the GEMM
object given (``gemm=``, with the up and down GEMMs' states). In FP8 (an
:class:`~sp_jax.ops.fp8.Fp8Gemm`), each grouped GEMM is :func:`fp8_grouped_gemm`: the
dense layers' recipe (e4m3 rows and expert weights, e5m2 output gradients, one
whole-tensor scale each, fp32 accumulation) around :func:`jax.lax.ragged_dot_general`
forward, dgrad and wgrad (the grouped weight gradient, ragged contracting dimension),
each of which XLA:GPU (jax 0.10.2) runs as one cuBLASLt FP8 GEMM of the masked dense
product (``benchmarks/fp8_ragged_dot.py``) where a device holds one expert; with several
experts per device the masked product would cost ``groups`` times the routed FLOPs, so
there the three run as the routed rows' tile loops on the dequantised FP8 values (not
yet a per-tile FP8 GEMM).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sp_jax.ops.deferred import apply_deferred
from sp_jax.ops.fp8 import Fp8Gemm, Fp8Spec
from sp_jax.ops.fsdp import Fsdp
from sp_jax.ops.gemm import ComputeGemm, Gemm
from sp_jax.ops.grouped import grouped_matmul
from sp_jax.ops.primitives import AxisName, fresh_zeros, vary, vma
from sp_jax.ops.rules import Grouped, linear_op, varying

__all__ = ["SCORINGS", "capacity_keep", "expert_mixture", "fp8_grouped_gemm", "grouped_ffn",
           "grouped_matmul", "load_tap", "ragged_all_to_all", "route", "router_scores",
           "router_stats", "routing_weights", "select_experts"]


SCORINGS = ("softmax", "sigmoid")
"""How a router turns its logits into expert scores: ``"softmax"`` over the experts
(Mixtral, Qwen3-MoE) or an independent ``"sigmoid"`` per expert (DeepSeek-V3, GLM-4.5)."""


def router_scores(x: jax.Array, router: jax.Array, scoring: str = "softmax"
                  ) -> tuple[jax.Array, jax.Array]:
    """``(logits, scores)`` ``[..., experts]`` fp32 of tokens ``x`` ``[..., hidden]`` (any
    float dtype) under the ``router`` kernel ``[hidden, experts]``: the scores are the
    logits' softmax over the experts or their sigmoid (:data:`SCORINGS`)."""
    logits = jnp.einsum("...h,he->...e", x.astype(jnp.float32), router.astype(jnp.float32))
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else \
        jax.nn.sigmoid(logits)
    return logits, scores


def select_experts(scores: jax.Array, k: int, *, bias: jax.Array | None = None,
                   groups: int = 1, topk_groups: int = 1) -> jax.Array:
    """The ``k`` experts ``[..., k]`` (int32) each token is sent to, from its ``scores``
    ``[..., E]`` (no gradient flows through the choice).

    With ``bias`` ``[E]`` (aux-loss-free balancing, Hugging Face's
    ``e_score_correction_bias``) the choice ranks ``scores + bias``; the weights never
    see the bias (:func:`routing_weights`). With ``groups > 1`` (DeepSeek-V3's ``n_group``)
    the experts form ``groups`` consecutive groups, each ranked by the sum of its two
    highest (biased) scores; only the experts of the best ``topk_groups`` take part in
    the top-``k``, the others masked to ``-inf`` (DeepSeek-V3's reference, vLLM and
    transformers 5.x). Ties: the lower index first, as :func:`jax.lax.top_k`; the choices in
    descending (biased) score."""
    choice = lax.stop_gradient(scores)
    if bias is not None:
        choice = choice + bias.astype(choice.dtype)
    if groups > 1 and topk_groups < groups:
        e = choice.shape[-1]
        grouped = choice.reshape(*choice.shape[:-1], groups, e // groups)
        group_scores = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)  # [..., groups]
        _, chosen = lax.top_k(group_scores, topk_groups)
        keep = jnp.any(chosen[..., :, None] == jnp.arange(groups), axis=-2)  # [..., groups]
        choice = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)
    return lax.top_k(choice, k)[1].astype(jnp.int32)


def routing_weights(scores: jax.Array, experts: jax.Array, normalize: bool,
                    scale: float = 1.0, scoring: str = "softmax") -> jax.Array:
    """The weights ``[..., k]`` (fp32) of the chosen ``experts`` ``[..., k]``: their
    ``scores`` (``[..., E]``, without any selection bias), renormalised to sum to 1 with
    ``normalize`` (``norm_topk_prob``; a sigmoid's sum gets transformers' ``+ 1e-20``), times
    ``scale`` (DeepSeek-V3's ``routed_scaling_factor``)."""
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        total = jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights / (total + 1e-20 if scoring == "sigmoid" else total)
    return weights * scale if scale != 1.0 else weights


def route(x: jax.Array, router: jax.Array, k: int, normalize: bool, *,
          scoring: str = "softmax", bias: jax.Array | None = None, groups: int = 1,
          topk_groups: int = 1, scale: float = 1.0
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-``k`` routing in fp32: :func:`router_scores`, :func:`select_experts`,
    :func:`routing_weights`.

    Args:
      x: ``[..., hidden]`` tokens (any float dtype).
      router: ``[hidden, experts]`` router kernel.
      k: experts per token.
      normalize: renormalise the ``k`` chosen scores to sum to 1 (Mixtral,
        Qwen3-MoE's and DeepSeek-V3's ``norm_topk_prob``).
      scoring / bias / groups / topk_groups / scale: DeepSeek-V3's routing (the
        defaults: softmax top-k).
    Returns:
      ``(logits [..., experts], experts [..., k] int32, weights [..., k])``, fp32; the
      choices in descending (biased) score (ties: the lower expert first, as
      :func:`jax.lax.top_k`).
    """
    logits, scores = router_scores(x, router, scoring)
    experts = select_experts(scores, k, bias=bias, groups=groups, topk_groups=topk_groups)
    return logits, experts, routing_weights(scores, experts, normalize, scale, scoring)


@jax.custom_vjp
def load_tap(scores: jax.Array, bias: jax.Array, loads: jax.Array) -> jax.Array:
    """``scores`` unchanged; in the backward pass the cotangent of the selection ``bias``
    ``[E]`` is ``loads`` ``[E]`` (the step's pairs routed to each expert, as the FP8 ops
    return their amaxes as the cotangent of their history): the training step reads the
    loads of every layer from its "gradients" and updates the biases outside the
    optimizer (:func:`sp_jax.layers.update_router_biases`). ``bias`` and ``loads`` alike
    in varying axes (both replicated: ``loads`` summed over the token axes)."""
    return scores


def _load_tap_fwd(scores, bias, loads):
    return scores, loads


def _load_tap_bwd(loads, g):
    return g, loads, jnp.zeros_like(loads)


load_tap.defvjp(_load_tap_fwd, _load_tap_bwd)


def router_stats(logits: jax.Array, experts: jax.Array, scores: jax.Array | None = None,
                 *, sequence_balance: bool = False, sequence_axes: tuple = ()
                 ) -> dict[str, jax.Array]:
    """Sums over the tokens of ``logits`` ``[..., E]`` (fp32) and their chosen ``experts``
    ``[..., k]``: ``expert_tokens`` ``[E]`` (pairs routed to each expert),
    ``router_probs`` ``[E]`` (the scores normalised over the experts: softmax
    probabilities, or a sigmoid's scores over their sum; ``scores`` None: the softmax of
    ``logits``), ``router_z`` (squared log-sum-exp), ``tokens`` and ``dropped`` (0; the
    capacity rule adds its drops), all fp32, for the auxiliary losses
    (:func:`sp_jax.layers.moe_losses`).

    With ``sequence_balance`` (``[batch, seq, ...]`` inputs, each row's tokens spread
    over ``sequence_axes``): also ``seq_balance``, DeepSeek-V3's sequence-wise balance
    term ``sum_i f_i P_i`` of each row summed over the rows (``f_i = E / (k T)`` times
    the row's pairs routed to ``i``, ``P_i`` the mean normalised score of ``i`` over its
    ``T`` tokens) and ``sequences`` (the rows)."""
    e = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1) if scores is None else \
        scores / jnp.sum(scores, axis=-1, keepdims=True)
    stats = {"expert_tokens": jnp.bincount(experts.reshape(-1), length=e).astype(jnp.float32),
             "router_probs": jnp.sum(probs.reshape(-1, e), axis=0),
             "router_z": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
             "tokens": jnp.asarray(np.prod(logits.shape[:-1]), jnp.float32),
             "dropped": jnp.zeros((), jnp.float32)}
    if sequence_balance:
        b, s, k = experts.shape
        counts = jax.vmap(lambda r: jnp.bincount(r, length=e))(experts.reshape(b, s * k))
        counts = lax.psum(counts.astype(jnp.float32), sequence_axes) if sequence_axes \
            else counts.astype(jnp.float32)
        score_sums = jnp.sum(probs, axis=1)  # [b, E]
        if sequence_axes:
            score_sums = lax.psum(score_sums, sequence_axes)
            s = s * lax.psum(1, sequence_axes)  # the whole row's tokens
        balance = jnp.sum(counts * e / (k * s) * (score_sums / s), axis=-1)  # [b]
        stats["seq_balance"] = jnp.sum(balance)
        stats["sequences"] = jnp.asarray(b, jnp.float32)
    return stats


def capacity_keep(experts: jax.Array, positions: np.ndarray | None, capacity: int,
                  num_experts: int) -> jax.Array:
    """Which (token, choice) pairs of whole sequences fit their expert's capacity.

    The rule (GShard's, per sequence): an expert takes at most ``capacity`` pairs of a
    sequence, first every token's first choice in position order, then every second
    choice, and so on; the pairs past its capacity are dropped. It depends on the
    sequence alone, never on how it is sharded.

    Args:
      experts: ``[batch, seq, k]`` chosen experts, the sequence in the order it is held.
      positions: ``[seq]`` the natural position of each held token (the zigzag order of
        ring attention), or None: held in natural order.
      capacity: pairs each expert may take per sequence.
      num_experts: ``E``.
    Returns:
      bool ``[batch, seq, k]``.
    """
    b, s, k = experts.shape
    pos = np.arange(s) if positions is None else np.asarray(positions)
    # a unique priority per pair: expert, then choice rank, then natural position
    order_key = (np.arange(k)[None, :] * s + pos[:, None]).astype(np.int32)  # [s, k]
    key = experts * (k * s) + jnp.asarray(order_key)[None]
    flat = key.reshape(b, s * k)
    rank = jnp.argsort(jnp.argsort(flat, axis=-1), axis=-1)  # place in priority order
    counts = jax.vmap(lambda e: jnp.bincount(e, length=num_experts))(experts.reshape(b, -1))
    starts = jnp.cumsum(counts, axis=-1) - counts  # [b, E]: where each expert's pairs begin
    within = rank - jnp.take_along_axis(starts, experts.reshape(b, -1), axis=-1)
    return (within < capacity).reshape(b, s, k)


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name, chunk):
    """``ragged_all_to_all`` as an ``all_to_all`` of ``chunk``-row blocks (the most rows
    one peer is sent), for backends without the instruction (XLA:CPU)."""
    rows = jnp.arange(chunk, dtype=jnp.int32)
    take = input_offsets[:, None] + rows[None]  # [ep, chunk]
    valid = rows[None] < send_sizes[:, None]
    blocks = jnp.take(operand, jnp.clip(take, 0, operand.shape[0] - 1), axis=0)
    blocks = jnp.where(valid[..., None], blocks, jnp.zeros((), operand.dtype))
    got = lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # [ep (source), chunk, ...]
    where = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # set by each source
    put = where[:, None] + rows[None]
    put = jnp.where(rows[None] < recv_sizes[:, None], put, output.shape[0])  # off the end
    return output.at[put.reshape(-1)].set(got.reshape(-1, *operand.shape[1:]), mode="drop")


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                      send_sizes: jax.Array, output_offsets: jax.Array,
                      recv_sizes: jax.Array, *, axis_name: AxisName, chunk: int
                      ) -> jax.Array:
    """:func:`jax.lax.ragged_all_to_all` (rows ``input_offsets[j] : + send_sizes[j]`` of
    ``operand`` go to peer ``j``, landing at ``output_offsets[j]`` of its ``output``; the
    ``recv_sizes[i]`` rows from peer ``i`` arrive where it said), lowered as the
    instruction on GPU and TPU and as an ``all_to_all`` of ``chunk``-row blocks on CPU
    (``chunk``: the most rows one peer is sent)."""
    def native(*args):
        return lax.ragged_all_to_all(*args, axis_name=axis_name)

    def emulated(*args):
        return _emulated_ragged_all_to_all(*args, axis_name=axis_name, chunk=chunk)

    axes = vma(operand) | vma(output)
    operand, output = vary(operand, axes), vary(output, axes)
    return lax.platform_dependent(operand, output, input_offsets, send_sizes, output_offsets,
                                  recv_sizes, cpu=emulated, default=native)


def fp8_grouped_gemm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, spec: Fp8Spec,
                     history: jax.Array | None = None) -> jax.Array:
    """The grouped GEMM ``x_g @ w[g]`` of rows sorted by group (:func:`jax.lax.ragged_dot`)
    in FP8, per device (inside ``shard_map``): the dense FP8 layers' recipe
    (:class:`~sp_jax.ops.fp8.Fp8Gemm`).

    Forward: the grouped rows (those past ``sum(group_sizes)`` count as zero) and ``w``
    in e4m3, each with one scale from its whole tensor's amax (the maximum over the
    mesh axes of ``spec`` it varies over: every device's rows and every expert shard),
    or from ``history`` (delayed scaling); fp32 accumulation. Backward: ``dy`` in e5m2;
    dgrad ``dy @ w[g]^T`` and the grouped weight gradient ``x_g^T dy_g`` (a ragged
    contracting dimension) as FP8 GEMMs; ``w`` kept as given and quantised again with
    the forward's scale. With one group each is :func:`jax.lax.ragged_dot_general` (one
    cuBLASLt FP8 GEMM on GPUs); with several, whose masked lowering would cost ``groups``
    times the routed FLOPs, each is a tile loop over the routed rows
    (:func:`~sp_jax.ops.grouped.grouped_matmul`, :func:`~sp_jax.ops.grouped.grouped_wgrad`)
    of the FP8 values in bf16 (exact) with fp32 accumulation, times the scales.

    Args:
      x: ``[rows, k]`` in the compute dtype.
      w: ``[groups, k, n]`` (its gradient comes back in its dtype).
      group_sizes: int32 ``[groups]``.
      spec: the :class:`~sp_jax.ops.fp8.Fp8Spec`.
      history: the ``[3, amax_history_len]`` amax history with delayed scaling (its
        cotangent: this step's amaxes of the rows, the weights and ``dy``), else None.
    Returns:
      ``[rows, n]`` in ``x.dtype``; rows past ``sum(group_sizes)`` are zero.
    """
    return _grouped_gemm(x, w, group_sizes, Fp8Gemm(spec).bound(None, w.dtype), history)


def _grouped_gemm(x, w, group_sizes, gemm, state, tap=None, fsdp=None):
    """The grouped GEMM of ``gemm`` as the linear rule :class:`~sp_jax.ops.rules.Grouped`
    (one custom-VJP op; with a weight-gradient ``tap``, in its mode,
    :mod:`sp_jax.ops.deferred`); ``fsdp = (axes, dim)``: ``w`` is this device's shard over
    the data ``axes`` along ``dim``, gathered inside the op (:class:`~sp_jax.ops.fsdp.Fsdp`:
    in ``x``'s dtype, the residual the shard, the weight gradient reduce-scattered in
    ``w``'s)."""
    axes = vma(x) | vma(w) | vma(group_sizes)
    x = vary(x, axes)  # the weights cast inside the op: the residual is the caller's w
    rule = Grouped(gemm, None, jnp.dtype(x.dtype))
    if fsdp:
        rule = Fsdp(rule, tuple(fsdp[0]), fsdp[1])
    rule, aux = varying(rule, w, axes), (group_sizes, state)
    return apply_deferred(rule, x, w, aux, tap, lambda: linear_op(x, w, aux, rule))


def grouped_ffn(x: jax.Array, group_sizes: jax.Array, w_up: jax.Array, w_down: jax.Array,
                activation: Callable[[jax.Array], jax.Array], *, gemm: Gemm | None = None,
                gemm_states: tuple[Any, Any] = (None, None),
                taps: tuple[Any, Any] = (None, None),
                fsdp_axes: tuple[AxisName, ...] = ()) -> jax.Array:
    """Expert FFNs of rows sorted by expert: ``down_g(act(up_g(x)))`` for the
    ``group_sizes[g]`` consecutive rows of group ``g``, as two grouped GEMMs
    (:func:`~sp_jax.ops.grouped.grouped_matmul`: the work of the routed rows).

    Args:
      x: ``[rows, hidden]``; rows past ``sum(group_sizes)`` give zeros.
      group_sizes: int32 ``[groups]``, or ``[blocks, groups]``: blocks of rows each sorted
        by group (:func:`~sp_jax.ops.grouped.grouped_matmul`).
      w_up: ``[groups, hidden, width]``; w_down: ``[groups, width', hidden]`` with
        ``width'`` the activation's output width.
      activation: of ``[rows, width]`` -> ``[rows, width']``.
      gemm: the GEMM object of both GEMMs (:mod:`sp_jax.ops.gemm`): None or
        :class:`~sp_jax.ops.gemm.ComputeGemm` (``x``'s dtype, fp32 accumulation), or
        :class:`~sp_jax.ops.fp8.Fp8Gemm` (:func:`fp8_grouped_gemm`'s recipe; the
        activation in ``x``'s dtype).
      gemm_states: the up and down GEMMs' states (FP8 delayed scaling: their amax
        histories).
      taps: the up and down GEMMs' weight-gradient taps (:mod:`sp_jax.ops.deferred`).
      fsdp_axes: the data axes ``w_up`` (along ``hidden``, dimension 1) and ``w_down``
        (dimension 2) are sharded over (fsdp), gathered inside each GEMM's op
        (:class:`~sp_jax.ops.fsdp.Fsdp`, as the dense layers' kernels): in ``x``'s dtype
        where that is narrower than the weights', the residual the shard (without remat
        no gathered kernel is kept for the backward), the weight gradient reduce-scattered
        in the weights' dtype (fp32 parameters: fp32 sums over the data axes). Without
        them a weight wider than ``x`` is cast to ``x``'s dtype first.
    """
    gemm = ComputeGemm() if gemm is None else gemm
    fsdp_axes = tuple(fsdp_axes)

    def product(h, w, state, tap, dim):
        gemm.check_state("grouped_ffn", state)
        if fsdp_axes:  # gathered in the compute dtype inside the op
            return _grouped_gemm(h, w, group_sizes, gemm.bound(None, w.dtype), state, tap,
                                 (fsdp_axes, dim))
        if jnp.dtype(x.dtype).itemsize < jnp.dtype(w.dtype).itemsize:
            w = w.astype(x.dtype)  # (its gradient cast back by the cast's VJP)
        w = gemm.grouped_kernel(w, x.dtype)
        return _grouped_gemm(h, w, group_sizes, gemm.bound(None, w.dtype), state, tap)

    up = product(x, w_up, gemm_states[0], taps[0], 1)
    # The grouped GEMMs leave the rows past the sum zero (their tile loops write only
    # routed rows; ragged_dot's rows in no group are zero): no mask here, whose select
    # and its transpose were another copy of the expert axis's receive buffer at the
    # expert layer's peak (deviceless H100 compile, BENCHMARKS.md).
    return product(activation(up), w_down, gemm_states[1], taps[1], 2)


def expert_mixture(x: jax.Array, experts: jax.Array, weights: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, activation: Callable[[jax.Array], jax.Array], *,
                   num_experts: int, expert_axis: AxisName | None = None,
                   gemm: Gemm | None = None, gemm_states: tuple[Any, Any] = (None, None),
                   taps: tuple[Any, Any] = (None, None),
                   fsdp_axes: tuple[AxisName, ...] = ()) -> jax.Array:
    """``sum_j weights[:, j] * FFN_{experts[:, j]}(x)`` of one device's tokens, dropless.

    Args:
      x: ``[tokens, hidden]`` in the compute dtype.
      experts: int32 ``[tokens, k]`` chosen experts; ``num_experts`` marks a dropped pair
        (computed nowhere, contributing zero).
      weights: ``[tokens, k]`` combine weights.
      w_up / w_down: this device's experts ``[E_local, hidden, width]`` /
        ``[E_local, width', hidden]``: all ``num_experts`` without ``expert_axis``, else
        the ``E / ep`` consecutive experts of its index on ``expert_axis``.
      activation: as :func:`grouped_ffn`.
      num_experts: ``E``.
      expert_axis: the mesh axis the experts are split over, or None.
      gemm / gemm_states / taps / fsdp_axes: the grouped GEMMs' GEMM object, states,
        weight-gradient taps and the data axes the experts are sharded over
        (:func:`grouped_ffn`).
    Returns:
      ``[tokens, hidden]`` in ``x``'s dtype (partial sums where the experts' width is
      split over a tensor axis).
    """
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs sorted by expert, dropped ones last
    rows = jnp.take(x, order // k, axis=0)
    sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    ep = 1 if expert_axis is None else lax.axis_size(expert_axis)
    ffn = functools.partial(grouped_ffn, activation=activation, gemm=gemm,
                            gemm_states=gemm_states, taps=taps, fsdp_axes=fsdp_axes)
    if ep == 1:
        out = ffn(rows, sizes, w_up, w_down)
    else:
        # a peer is sent at most min(k, E / ep) rows per token (distinct experts)
        out = _across_devices(rows, sizes, w_up, w_down, ffn, expert_axis, ep,
                              chunk=tokens * min(k, num_experts // ep))
    out = jnp.zeros_like(out).at[order].set(out)  # back to (token, choice) order
    out = out.reshape(tokens, k, -1)
    return jnp.einsum("tkh,tk->th", out, weights.astype(out.dtype))


def _across_devices(rows, sizes, w_up, w_down, ffn, axis, ep, chunk):
    """Rows sorted by expert -> their experts' outputs, the experts split over ``axis``
    (``ep`` devices, each sent at most ``chunk`` rows by a peer): ragged all-to-all there,
    the grouped GEMMs ``ffn(rows, group_sizes, w_up, w_down)``, ragged all-to-all
    back."""
    pairs, local = rows.shape[0], sizes.shape[0] // ep
    me = lax.axis_index(axis)
    per_peer = sizes.reshape(ep, local)  # rows for each peer's experts
    send = jnp.sum(per_peer, axis=1)
    send_at = jnp.cumsum(send) - send
    got = lax.all_to_all(per_peer, axis, 0, 0, tiled=True)  # [ep (source), local]
    recv = jnp.sum(got, axis=1)
    table = lax.all_gather(send, axis)  # [source, destination]
    lower = jnp.arange(ep) < me
    land_at = jnp.sum(jnp.where(lower[:, None], table, 0), axis=0)  # in each receiver
    capacity = ep * chunk
    buffer = fresh_zeros((capacity, *rows.shape[1:]), rows.dtype, rows)
    received = ragged_all_to_all(rows, buffer, send_at, send, land_at, recv, axis_name=axis,
                                 chunk=chunk)
    # The received rows are source-major, each source's sorted by local expert: the
    # grouped GEMMs take them as they are (``got``: [source, local expert] segments).
    # Regrouping them by expert first (a gather and its scatter back, with their
    # transposes) held about eight copies of this static buffer at an expert layer's
    # peak on the deviceless H100 compile of DeepSeek-V3 at expert 16 (BENCHMARKS.md).
    out = ffn(received, got, w_up, w_down)
    back_at = jnp.sum(jnp.where(lower[None, :], table, 0), axis=1)  # where I sent from
    return ragged_all_to_all(out, fresh_zeros((pairs, *out.shape[1:]), out.dtype, out),
                             jnp.cumsum(recv) - recv, recv, back_at, send, axis_name=axis,
                             chunk=chunk)

