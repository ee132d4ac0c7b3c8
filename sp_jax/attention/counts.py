"""How many ``(q block, k block)`` products each device of the context axis computes, for
each way of laying attention over it (host-side arithmetic; the kernels count the same
products at run time)."""

from __future__ import annotations

import numpy as np

from sp_jax.attention.kernels import block_size
from sp_jax.attention.sequence_order import zigzag_order

__all__ = ["MODES", "attention_block_counts"]

MODES = ("ring", "ring_contiguous", "ulysses", "local")
"""The ``mode`` s of :func:`attention_block_counts`."""


def _causal_count(length: int, bq: int, bk: int) -> int:
    """Block products of causal attention over ``length`` rows in ``bq x bk`` blocks:
    query block ``i`` needs key blocks ``0 .. ceil((i + 1) bq / bk) - 1``."""
    return sum(-(-(i + 1) * bq // bk) for i in range(length // bq))


def attention_block_counts(seq_len: int, context: int, *, mode: str, block_q: int,
                           block_k: int) -> np.ndarray:
    """How many ``(q block, k block)`` products each device of the context axis computes.

    Args:
      seq_len: the global sequence length ``s``.
      context: the size ``c`` of the context axis.
      mode: ``"ring"`` (:func:`ring_attention` on the zigzag order: blocks divide the
        chunk ``s / (2c)``), ``"ring_contiguous"`` (a ring over contiguous shards of
        ``s / c`` rows without zigzag, for comparison: device ``r`` needs the blocks of
        devices ``0 .. r``), ``"ulysses"`` (:func:`ulysses_attention`: every device runs
        the causal kernel over all ``s`` rows for ``heads / c`` heads) or ``"local"``
        (:func:`blockwise_attention` of the whole sequence; ``context`` must be 1).
      block_q / block_k: the kernels' ``block_q`` / ``block_k``.
    Returns:
      int64 array ``[c]``: device ``r``'s number of block products (forward; the backward
      computes the same products once more).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}.")
    s, c = int(seq_len), int(context)
    if mode == "local":
        if c != 1:
            raise ValueError(f"mode='local' is one device's blockwise_attention: context={c} "
                             "must be 1 (use 'ulysses' or 'ring' for a context axis).")
        bq, bk = block_size(s, block_q, "block_q"), block_size(s, block_k, "block_k")
        return np.array([_causal_count(s, bq, bk)], dtype=np.int64)
    if mode == "ring":
        n = len(zigzag_order(s, c)) // (2 * c)  # validates s
        bq, bk = block_size(n, block_q, "block_q"), block_size(n, block_k, "block_k")
        # step 0: causal over the local 2n rows; each other step: n x 2n rows, unmasked
        per = _causal_count(2 * n, bq, bk) + (c - 1) * 2 * (n // bq) * (n // bk)
        return np.full(c, per, dtype=np.int64)
    if s % c:
        raise ValueError(f"seq_len={s} must be divisible by context={c}.")
    if mode == "ulysses":
        bq, bk = block_size(s, block_q, "block_q"), block_size(s, block_k, "block_k")
        return np.full(c, _causal_count(s, bq, bk), dtype=np.int64)
    m = s // c  # ring_contiguous
    bq, bk = block_size(m, block_q, "block_q"), block_size(m, block_k, "block_k")
    return np.array([_causal_count(m, bq, bk) + r * (m // bq) * (m // bk) for r in range(c)],
                    dtype=np.int64)

