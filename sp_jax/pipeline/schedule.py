"""Pipeline schedules as tables: which micro-batch and layer chunk each stage runs at each
tick, forward and backward, computed once in NumPy.

Every stage runs the same program (one SPMD program); the tables, indexed by the tick
and the stage's index, say what that program does there. A micro-batch ``m`` passes
``V = stages * repeats`` *virtual stages* ``v = r * stages + s`` (chunk ``r`` of the
layers held by stage ``s``), moving from stage ``s`` to ``s + 1`` (and from the last
stage back to the first for the next chunk) with one ``ppermute`` per tick.

Items. Forward work is numbered ``k(m, r) = (m // P) * P * R + r * P + m % P`` (``P``
stages, ``R`` repeats): micro-batches go through the chunks in groups of ``P`` (Megatron's
interleaved order), so the output of the last stage for ``(m, r)`` is exactly what the
first stage needs at the next tick for ``(m, r + 1)``, and no micro-batch waits in a
buffer. Stage ``s`` forwards item ``k`` at tick ``k + s``: ``R M + P - 1`` ticks in all.

GPipe (and circular GPipe for ``R > 1``) runs these forward ticks; its backward is the
autodiff of that loop (the same ticks in reverse). 1F1B runs, at every tick, one forward
and one backward on every stage: stage ``s`` backwards item ``j`` (the same numbering
with the chunks in reverse) at tick ``j + (V - 1) + (P - 1 - s)``, so the last virtual
stage starts a micro-batch's backward in the tick of its forward (after its loss) and
each earlier one follows a tick later. ``R M + V + P - 2`` ticks; stage ``s`` keeps its
inputs from forward to backward, at most ``2 V - 1`` of them whatever ``M``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sp_jax.config import PIPELINE_SCHEDULES

__all__ = ["PipelineSchedule", "bubble_formula", "pipeline_schedule"]


def bubble_formula(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle fraction of a GPipe / circular pipeline, ``(P - 1) / (R M + P - 1)``."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineSchedule:
    """The tables of one schedule (:func:`pipeline_schedule`).

    Tables are int32 ``[num_ticks, stages]``; ``-1`` marks an idle slot.

    Attributes:
      kind: ``"gpipe"`` or ``"1f1b"``.
      stages / microbatches / repeats: ``P``, ``M``, ``R``.
      fwd_micro / fwd_repeat: the micro-batch and the layer chunk each stage forwards.
      bwd_micro / bwd_repeat: the same for the backward (1F1B; all ``-1`` for GPipe).
      fwd_slot / bwd_slot: the slot of the stage-input buffer the forward writes and the
        backward reads (1F1B).
      num_slots: slots of the stage-input buffer (1F1B; 0 for GPipe).
    """

    kind: str
    stages: int
    microbatches: int
    repeats: int
    fwd_micro: np.ndarray
    fwd_repeat: np.ndarray
    bwd_micro: np.ndarray
    bwd_repeat: np.ndarray
    fwd_slot: np.ndarray
    bwd_slot: np.ndarray
    num_slots: int

    @property
    def num_ticks(self) -> int:
        """Iterations of the schedule's loop."""
        return int(self.fwd_micro.shape[0])

    @property
    def virtual_stages(self) -> int:
        """``V = stages * repeats``."""
        return self.stages * self.repeats

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-slots over all stage-slots, counted from the tables: forward slots
        for GPipe (its backward mirrors them), forward and backward slots for 1F1B."""
        busy = (self.fwd_micro >= 0).sum()
        slots = self.fwd_micro.size
        if self.kind == "1f1b":
            busy += (self.bwd_micro >= 0).sum()
            slots *= 2
        return float(1.0 - busy / slots)

    @property
    def max_live_inputs(self) -> int:
        """The most stage inputs one stage keeps between a forward and its backward
        (1F1B; for GPipe every micro-batch's activations stay until the backward)."""
        if self.kind != "1f1b":
            return self.microbatches * self.repeats
        most = 0
        for s in range(self.stages):
            live = 0
            for t in range(self.num_ticks):
                live += int(self.fwd_micro[t, s] >= 0)
                most = max(most, live)
                live -= int(self.bwd_micro[t, s] >= 0)
        return most


def _item(k: np.ndarray, stages: int, repeats: int) -> tuple[np.ndarray, np.ndarray]:
    """(micro-batch, chunk) of forward items ``k`` (``k(m, r)`` of the module doc)."""
    group, rest = np.divmod(k, stages * repeats)
    r, i = np.divmod(rest, stages)
    return group * stages + i, r


def pipeline_schedule(kind: str, stages: int, microbatches: int, repeats: int = 1
                      ) -> PipelineSchedule:
    """The tables of a ``kind`` schedule (``"gpipe"`` or ``"1f1b"``) for ``stages``
    stages, ``microbatches`` micro-batches and ``repeats`` layer chunks per stage.

    Raises:
      ValueError: an unknown kind, a non-positive count, or ``repeats > 1`` with
        ``microbatches`` not a multiple of ``stages``.
    """
    if kind not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_schedule: kind={kind!r} is not one of "
                         f"{PIPELINE_SCHEDULES}.")
    for name, value in (("stages", stages), ("microbatches", microbatches),
                        ("repeats", repeats)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"pipeline_schedule: {name}={value!r} must be a positive int.")
    p, m, r = int(stages), int(microbatches), int(repeats)
    if r > 1 and m % p:
        raise ValueError(
            f"pipeline_schedule: pipeline_microbatches={m} must be a multiple of the "
            f"{p} stages with pipeline_repeats={r} (the circular schedule sends micro-"
            f"batches through the chunks in groups of {p}); use {p * max(1, m // p)} or "
            f"{p * (m // p + 1)} micro-batches.")
    v = p * r
    items = m * r
    ticks = items + p - 1 if kind == "gpipe" else items + v + p - 2
    t = np.arange(ticks)[:, None]
    s = np.arange(p)[None, :]

    def table(k, reverse):
        valid = (k >= 0) & (k < items)
        micro, chunk = _item(np.where(valid, k, 0), p, r)
        if reverse:
            chunk = r - 1 - chunk
        return (np.where(valid, micro, -1).astype(np.int32),
                np.where(valid, chunk, -1).astype(np.int32))

    fwd_micro, fwd_repeat = table(t - s, False)
    idle = np.full_like(fwd_micro, -1)
    if kind == "gpipe":
        return PipelineSchedule(kind, p, m, r, fwd_micro, fwd_repeat, idle, idle, idle,
                                idle, 0)
    bwd_micro, bwd_repeat = table(t - (v - 1) - (p - 1 - s), True)
    # The stage input of (m, r) is written at its forward tick and read at its backward
    # tick; a ring of 2V - 1 slots indexed by the forward tick never overwrites a live one.
    slots = 2 * v - 1
    fwd_slot = np.where(fwd_micro >= 0, t % slots, -1).astype(np.int32)
    forward_tick = {}
    for tick in range(ticks):
        for stage in range(p):
            if fwd_micro[tick, stage] >= 0:
                forward_tick[stage, fwd_micro[tick, stage], fwd_repeat[tick, stage]] = tick
    bwd_slot = np.full_like(fwd_micro, -1)
    for tick in range(ticks):
        for stage in range(p):
            if bwd_micro[tick, stage] >= 0:
                f = forward_tick[stage, bwd_micro[tick, stage], bwd_repeat[tick, stage]]
                if not 0 <= tick - f < slots:
                    raise AssertionError("pipeline_schedule: a backward before its forward "
                                         "or after its slot was reused")
                bwd_slot[tick, stage] = f % slots
    return PipelineSchedule(kind, p, m, r, fwd_micro, fwd_repeat, bwd_micro, bwd_repeat,
                            fwd_slot, bwd_slot, slots)

