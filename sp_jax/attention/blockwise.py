"""Causal blockwise (flash) attention on one device's arrays: the whole sequence local,
no ``s x s`` array forward or backward; or cuDNN's fused kernel on GPUs."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sp_jax.attention.dropout import AttentionDropout, drop_arguments
from sp_jax.attention.kernels import (
    ScoreRule,
    backward_blocks,
    block_size,
    check_qkv,
    forward_blocks,
    kernel_segments,
    q_from_kernel,
    q_to_kernel,
    row_delta,
    same_vma,
    score_rule,
    to_bhsd,
    to_bshd,
)
from sp_jax.compat import check
from sp_jax.ops.primitives import fresh_zeros, residuals_to_device, residuals_to_host

__all__ = ["CUDNN_DTYPES", "IMPLEMENTATIONS", "blockwise_attention", "check_cudnn_inputs",
           "check_segments", "check_window", "cudnn_takes"]

IMPLEMENTATIONS = ("xla", "cudnn")
"""Kernels of :func:`blockwise_attention`: sp_jax's (every backend) or cuDNN's (GPU)."""

CUDNN_DTYPES = ("float16", "bfloat16")
"""The q/k/v dtypes cuDNN's fused attention takes (``jax.nn.dot_product_attention``'s
cuDNN path; its FP8 inputs are another API). fp32 is not among them: JAX raises a
NotImplementedError at trace time on a GPU ("Q must be fp16/bf16/..."), and only there."""
_F32 = jnp.float32


def _pair(seg):
    """Kernel document ids ``[b, s]`` (or None) as the kernels' ``(q_seg, k_seg)``."""
    return None if seg is None else (seg, seg)


def _blockwise_forward(q, k, v, drop, seg, bq, bk, window=None, rule=ScoreRule()):
    """``q [b, s, h, d]``, ``k [b, s, hk, d]``, ``v [b, s, hk, d_v]`` -> (out ``[b, s, h,
    d_v]`` in q's dtype,
    lse, count); ``drop``: None or ``(AttentionDropout, positions)``; ``seg``: None or
    the kernel document ids ``[b, s]``; ``window``: None or the sliding window;
    ``rule``: the scores' :class:`~sp_jax.attention.kernels.ScoreRule`."""
    o, lse, count = forward_blocks(q_to_kernel(q, k.shape[2]), to_bhsd(k), to_bhsd(v),
                                    causal=True, bq=bq, bk=bk, drop=_kernel_drop(drop),
                                    segments=_pair(seg), window=window, rule=rule)
    return q_from_kernel(o).astype(q.dtype), lse, count


def _kernel_drop(drop):
    """``(AttentionDropout, positions)`` -> the kernels' ``(dropout, qpos, kpos)``."""
    return None if drop is None else (drop[0], drop[1], drop[1])


def _blockwise_backward(res, d_out, drop, seg, bq, bk, window=None, rule=ScoreRule()):
    # Tie the residuals to the incoming cotangent: otherwise XLA's CSE may merge the
    # recomputed scores with the forward ones and keep those alive until backward.
    res, d_out = lax.optimization_barrier((res, d_out))
    q, k, v, out, lse = res
    hk = k.shape[2]
    qh, kh, vh, doh = q_to_kernel(q, hk), to_bhsd(k), to_bhsd(v), q_to_kernel(d_out, hk)
    dq, dk, dv, count = backward_blocks(
        qh, kh, vh, doh, lse, row_delta(doh, q_to_kernel(out, hk)),
        fresh_zeros(qh.shape, _F32, qh), causal=True, bq=bq, bk=bk, drop=_kernel_drop(drop),
        segments=_pair(seg), window=window, rule=rule)
    grads = (q_from_kernel(dq).astype(q.dtype), to_bshd(dk).astype(k.dtype),
             to_bshd(dv).astype(v.dtype))
    return grads, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _blockwise(q, k, v, drop, seg, bq, bk, window, rule, offload=False):
    return _blockwise_forward(q, k, v, drop, seg, bq, bk, window, rule)[0]


def _blockwise_fwd(q, k, v, drop, seg, bq, bk, window, rule, offload):
    out, lse, _ = _blockwise_forward(q, k, v, drop, seg, bq, bk, window, rule)
    res, out = residuals_to_host((q, k, v, out, lse), out, offload)
    return out, (res, drop, seg)


def _blockwise_bwd(bq, bk, window, rule, offload, res, d_out):
    res, drop, seg = res
    res, d_out = residuals_to_device(res, d_out, offload)
    return (*_blockwise_backward(res, d_out, drop, seg, bq, bk, window, rule)[0], None, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 8, 9))
def _blockwise_traced(q, k, v, drop, seg, bq, bk, window, rule, offload=False):
    """:func:`_blockwise` with the window an int32 array (data: e.g. a scanned layer's)."""
    return _blockwise_forward(q, k, v, drop, seg, bq, bk, window, rule)[0]


def _blockwise_traced_fwd(q, k, v, drop, seg, bq, bk, window, rule, offload):
    out, lse, _ = _blockwise_forward(q, k, v, drop, seg, bq, bk, window, rule)
    res, out = residuals_to_host((q, k, v, out, lse), out, offload)
    return out, (res, drop, seg, window)


def _blockwise_traced_bwd(bq, bk, rule, offload, res, d_out):
    res, drop, seg, window = res
    res, d_out = residuals_to_device(res, d_out, offload)
    return (*_blockwise_backward(res, d_out, drop, seg, bq, bk, window, rule)[0], None, None,
            None)


_blockwise_traced.defvjp(_blockwise_traced_fwd, _blockwise_traced_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_q: int = 512,
                        block_k: int = 512, implementation: str = "xla",
                        dropout: AttentionDropout | None = None,
                        positions: jax.Array | None = None,
                        segment_ids: jax.Array | None = None,
                        sliding_window: int | jax.Array | None = None,
                        scale: float | None = None,
                        softcap: float | None = None,
                        offload_residuals: bool = False) -> jax.Array:
    """Causal softmax attention in blocks (flash attention), on one device's arrays.

    Online softmax over key blocks with fp32 running statistics; key blocks above the
    causal diagonal are skipped (loop bounds), the ones crossing it masked. The largest
    array, forward or backward, is one ``[batch, heads, block_q, block_k]`` block. The
    backward pass recomputes each block's probabilities from the saved log-sum-exp
    (residuals ``q, k, v``, the output and the fp32 log-sum-exp ``[batch, heads, seq]``)
    and accumulates ``dq, dk, dv`` in fp32.

    Args:
      q: ``[batch, seq, heads, head_dim]``; k: ``[batch, seq, kv_heads, head_dim]``; v:
        ``[batch, seq, kv_heads, v_head_dim]`` (any float dtypes; the value head size may
        differ from the query/key one, ``"xla"`` only), ``heads`` a multiple of
        ``kv_heads``: grouped-query attention (query head ``j * heads / kv_heads + i``
        uses key/value head ``j``, as in Hugging Face's ``repeat_kv``), computed without
        repeating k and v.
      block_q / block_k: query / key rows per block: the largest divisors of ``seq`` up to
        these.
      implementation: ``"xla"`` (this kernel, every backend) or ``"cudnn"``
        (:func:`jax.nn.dot_product_attention` with ``is_causal=True`` and cuDNN's fused
        kernel: GPU only; JAX raises elsewhere; block sizes unused).
      dropout: dropout on the probabilities (:class:`AttentionDropout`), or None.
      positions: int ``[seq]``: the global positions of the rows, which the dropout mask
        depends on (default ``0 .. seq - 1``; causality uses the row order).
      segment_ids: int ``[batch, seq]`` document ids of packed rows (0 = padding), or
        None: a query attends only to earlier keys of its own document, and block
        products whose rows share no document in any batch row are skipped, not computed
        and masked (exactly so for packed rows, whose ids never decrease; padding counts
        as the last document). ``"xla"`` only.
      sliding_window: None (every earlier key) or a positive int ``w``: query ``i``
        attends keys ``i - w < j <= i`` only (Mistral's, transformers' semantics); key
        blocks wholly before the window are skipped (loop bounds, forward and
        backward), those crossing its edge masked. Composes with ``segment_ids`` and
        dropout; with ``"cudnn"``, cuDNN's ``local_window_size=(w - 1, 0)``. Also an int
        scalar array (traced: a scanned layer's window, ``GPTConfig.layer_windows``; a
        window of the sequence length or more is full causal attention): the same loop
        bounds, computed from the traced value (``fori_loop`` bounds are dynamic), so
        the skipping holds too; ``"xla"`` only.
      scale: the factor of the scores ``q . k`` (None: ``head_dim ** -0.5``; Gemma's
        ``query_pre_attn_scalar ** -0.5``); cuDNN's ``scale`` with ``"cudnn"``.
      softcap: None, or ``c``: the scaled scores ``s`` become ``c * tanh(s / c)`` before
        the mask and the softmax (Gemma 2's ``attn_logit_softcapping``; the backward
        pass through it by ``1 - tanh(s / c) ** 2``). ``"xla"`` only.
      offload_residuals: keep the residuals (``q, k, v``, the output and the
        log-sum-exp) in host memory between the passes
        (``ParallelConfig.offload_activations``); ``"xla"`` only.
    Returns:
      ``[batch, seq, heads, v_head_dim]`` in ``q.dtype``.
    """
    check_qkv("blockwise_attention", q, k, v)
    window = check_window("blockwise_attention", sliding_window)
    drop = drop_arguments(dropout, positions, q.shape[1], implementation)
    seg = check_segments("blockwise_attention", segment_ids, q)
    rule = score_rule("blockwise_attention", scale, softcap)
    if implementation == "cudnn" and v.shape[3] != k.shape[3]:
        raise ValueError(f"blockwise_attention: implementation='cudnn' needs values of the "
                         f"keys' head size (jax.nn.dot_product_attention); got k {k.shape}, "
                         f"v {v.shape}: use implementation='xla' for a value head size of "
                         "its own.")
    if implementation == "cudnn":  # what cuDNN's kernel cannot run: sp_jax.compat
        check(("train", "eval"), {f: name for f, name, used in (
            ("attention_softcap", f"softcap={rule.softcap}", rule.softcap is not None),
            ("packed_documents", "segment_ids (packed documents)", seg is not None),
            ("layer_windows", "a sliding_window array (a layer's window as data)",
             isinstance(window, jax.Array)),
            ("cudnn_attention", "implementation='cudnn'", True)) if used},
            where="blockwise_attention")
        check_cudnn_inputs("blockwise_attention", q, k, v)
        try:
            return jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn", scale=rule.scale,
                local_window_size=None if window is None else (window - 1, 0))
        except RuntimeError as e:  # JAX: "cuDNN not found." without a GPU
            raise RuntimeError(
                f"blockwise_attention(implementation='cudnn') needs cuDNN on a GPU ({e}); "
                "use implementation='xla' on other backends."
            ) from e
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: use 'xla' or 'cudnn'.")
    s = q.shape[1]
    bq, bk = block_size(s, block_q, "block_q"), block_size(s, block_k, "block_k")
    if isinstance(window, jax.Array):
        return _blockwise_traced(*same_vma(q, k, v), drop, seg, bq, bk, window, rule,
                                 bool(offload_residuals))
    return _blockwise(*same_vma(q, k, v), drop, seg, bq, bk, window, rule,
                      bool(offload_residuals))


def cudnn_takes(dtype: Any) -> bool:
    """Whether cuDNN's fused attention takes q/k/v of ``dtype`` (:data:`CUDNN_DTYPES`)."""
    return jnp.dtype(dtype).name in CUDNN_DTYPES


def check_cudnn_inputs(name: str, q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """A ValueError naming ``name`` unless q, k and v share one dtype cuDNN's fused
    attention takes (:data:`CUDNN_DTYPES`): on every backend, before JAX's own
    NotImplementedError, which a GPU alone raises."""
    dtypes = {jnp.dtype(x.dtype).name for x in (q, k, v)}
    if len(dtypes) > 1 or not cudnn_takes(q.dtype):
        raise ValueError(
            f"{name}: implementation='cudnn' takes float16 or bfloat16 q, k and v (cuDNN's "
            f"fused attention), got {q.dtype.name}, {k.dtype.name}, {v.dtype.name}: compute "
            "in bfloat16 (GPTConfig(dtype=jnp.bfloat16); here, q, k and v cast with "
            ".astype(jnp.bfloat16)) or use implementation='xla'.")


def check_window(name: str, sliding_window: int | jax.Array | None) -> int | jax.Array | None:
    """``sliding_window`` as an int, an int32 scalar array (kept: a traced per-layer
    window), or None; a ValueError naming ``name`` unless it is a positive int (or None)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, jax.Array):
        if sliding_window.ndim or not jnp.issubdtype(sliding_window.dtype, jnp.integer):
            raise ValueError(f"{name}: a sliding_window array must be an int scalar, got "
                             f"{sliding_window.dtype}{list(sliding_window.shape)}.")
        return sliding_window.astype(jnp.int32)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int | np.integer) \
            or sliding_window <= 0:
        raise ValueError(f"{name}: sliding_window={sliding_window!r} must be a positive int "
                         "(the keys each query sees, itself included) or None.")
    return int(sliding_window)


def check_segments(name: str, segment_ids: jax.Array | None, q: jax.Array,
                   length: int | None = None) -> jax.Array | None:
    """``segment_ids`` ``[batch, length]`` (default ``q``'s sequence) as kernel ids, or
    None; a TypeError / ValueError naming ``name`` for other shapes or dtypes."""
    if segment_ids is None:
        return None
    segment_ids = jnp.asarray(segment_ids)
    want = (q.shape[0], q.shape[1] if length is None else length)
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"{name}: segment_ids must be integer document ids, got dtype "
                        f"{segment_ids.dtype}.")
    if tuple(segment_ids.shape) != want:
        raise ValueError(f"{name}: segment_ids of shape {tuple(segment_ids.shape)} must be "
                         f"[batch, seq] = {want}, one document id per row of q {q.shape}.")
    return kernel_segments(segment_ids)

