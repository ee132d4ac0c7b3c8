"""Pipeline schedules as action tables: what each stage does at each tick (forward,
backward-input and backward-weight of a micro-batch's layer chunk; what it receives and
keeps), computed once in NumPy and run by one interpreter
(:func:`~sp_jax.pipeline.interpreter.run_schedule`).

Every stage runs the same program (one SPMD program); the tables, indexed by the tick
and the stage's index, say what that program does there. A micro-batch ``m`` passes
``V = stages * repeats`` *virtual stages* ``v = r * stages + s`` (chunk ``r`` of the
layers held by stage ``s``), moving from stage ``s`` to ``s + 1`` (and from the last
stage back to the first for the next chunk). The transfers are part of every tick: what
a stage forwards at tick ``t`` leaves for the next stage at the end of the tick, what it
back-propagates for the previous one (one ``ppermute`` each way), and arrives at tick
``t + 1``, where the receiver uses it at once or keeps it in a receive slot until the
tick that uses it (:attr:`PipelineSchedule.fwd_keep` / ``fwd_from``; the same for the
gradients). A new schedule is a new table: :meth:`PipelineSchedule.from_actions` takes
the actions and derives the slots and transfers, checking every dependency.

Actions per tick and stage (``-1``: none):

* **F** ``(m, r)``: chunk ``r``'s forward of micro-batch ``m`` (on stage 0's chunk 0 from
  the embedding; the last virtual stage also runs the head and the loss, whose gradient
  starts the micro-batch's backward in the same tick). It keeps its input in slot
  ``fwd_slot`` until the backward.
* **B** ``(m, r)``: the backward of that forward, recomputed from the kept input: the
  input gradient (sent to the previous stage) and, when the table has no W actions, the
  weight gradients with it (fused). With W actions it keeps what the weight gradients
  need in slot ``bwd_wslot``.
* **W** ``(m, r)``: the weight gradients of that backward, from slot ``wgt_slot``, at a
  tick of its own (zero-bubble schedules defer them into the bubbles).

A table with F actions only (GPipe) runs its forward loop and is differentiated by
autodiff: the backward is the same ticks in reverse, every micro-batch's residuals kept
(its memory behaviour and results).

Forward work of the built-in schedules is numbered ``k(m, r) = (m // P) * P * R + r * P +
m % P`` (``P`` stages, ``R`` repeats): micro-batches go through the chunks in groups of
``P`` (Megatron's interleaved order), so the output of the last stage for ``(m, r)`` is
exactly what the first stage needs at the next tick for ``(m, r + 1)``. Stage ``s``
forwards item ``k`` at tick ``k + s``: ``R M + P - 1`` ticks in all (GPipe and circular
GPipe). 1F1B runs, at every tick, one forward and one backward on every stage: stage
``s`` backwards item ``j`` (the same numbering with the chunks in reverse) at tick ``j +
(V - 1) + (P - 1 - s)``, so the last virtual stage starts a micro-batch's backward in
the tick of its forward (after its loss) and each earlier one follows a tick later.
``R M + V + P - 2`` ticks; stage ``s`` keeps its inputs from forward to backward, at
most ``2 V - 1`` of them whatever ``M``. :func:`defer_weights` turns a table's fused
backwards into B and W actions ``d`` ticks apart.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sp_jax.config import PIPELINE_SCHEDULES

__all__ = ["PipelineSchedule", "bubble_formula", "defer_weights", "pipeline_schedule"]


def bubble_formula(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle fraction of a GPipe / circular pipeline, ``(P - 1) / (R M + P - 1)``."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


_ACTIONS = ("fwd", "bwd", "wgt")


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineSchedule:
    """The action tables of one schedule (:func:`pipeline_schedule`, or any table:
    :meth:`from_actions`); ``str(schedule)`` draws it (:meth:`render`).

    Tables are int32 ``[num_ticks, stages]``; ``-1`` marks an idle slot.

    Attributes:
      kind: the schedule's name (``"gpipe"``, ``"1f1b"``, or a table's own).
      stages / microbatches / repeats: ``P``, ``M``, ``R``.
      fwd_micro / fwd_repeat: the micro-batch and the layer chunk each stage forwards.
      bwd_micro / bwd_repeat: the same for the backward (input gradients; all ``-1``
        for a table differentiated by autodiff, GPipe).
      wgt_micro / wgt_repeat: the same for the deferred weight gradients (all ``-1``
        when every backward computes its weight gradients, fused).
      fwd_slot / bwd_slot: the slot of the stage-input buffer the forward writes and the
        backward reads.
      num_slots: slots of the stage-input buffer (0 without backward actions).
      bwd_wslot / wgt_slot: the slot of the weight-gradient buffer the backward writes
        and the W action reads; num_wslots: its slots (0 without W actions).
      fwd_keep / fwd_from: the receive slot the activation arriving at a tick is kept
        in (``-1``: not kept), and the one the forward reads its input from (``-1``: the
        activation arriving at this tick, or the embedding); num_fwd_recv: receive
        slots (0: every forward takes what arrives).
      bwd_keep / bwd_from / num_bwd_recv: the same for the gradients the backwards
        receive (``bwd_from`` ``-1``: the gradient arriving at this tick, or the loss's).
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
    wgt_micro: np.ndarray
    wgt_repeat: np.ndarray
    bwd_wslot: np.ndarray
    wgt_slot: np.ndarray
    num_wslots: int
    fwd_keep: np.ndarray
    fwd_from: np.ndarray
    num_fwd_recv: int
    bwd_keep: np.ndarray
    bwd_from: np.ndarray
    num_bwd_recv: int

    @property
    def num_ticks(self) -> int:
        """Iterations of the schedule's loop."""
        return int(self.fwd_micro.shape[0])

    @property
    def virtual_stages(self) -> int:
        """``V = stages * repeats``."""
        return self.stages * self.repeats

    @property
    def driven(self) -> bool:
        """Whether the table holds backward actions (the interpreter then drives the
        backward itself); False: a forward table differentiated by autodiff."""
        return bool((self.bwd_micro >= 0).any())

    @property
    def deferred(self) -> bool:
        """Whether the weight gradients are W actions of their own."""
        return bool((self.wgt_micro >= 0).any())

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-slots over all stage-slots, counted from the tables: forward slots
        for a table differentiated by autodiff (its backward mirrors them), forward and
        backward slots for a driven one (and W slots when it has W actions)."""
        tables = [self.fwd_micro]
        if self.driven:
            tables.append(self.bwd_micro)
        if self.deferred:
            tables.append(self.wgt_micro)
        busy = sum(int((t >= 0).sum()) for t in tables)
        return float(1.0 - busy / (self.fwd_micro.size * len(tables)))

    @property
    def max_live_inputs(self) -> int:
        """The most stage inputs one stage keeps between a forward and its backward
        (autodiff: every micro-batch's activations stay until the backward)."""
        if not self.driven:
            return self.microbatches * self.repeats
        most = 0
        for s in range(self.stages):
            live = 0
            for t in range(self.num_ticks):
                live += int(self.fwd_micro[t, s] >= 0)
                most = max(most, live)
                live -= int(self.bwd_micro[t, s] >= 0)
        return most

    def render(self) -> str:
        """The table drawn as text: a row per tick, a column per stage, each cell its
        actions (``F``, ``B``, ``W`` with the micro-batch, and ``.chunk`` when there are
        several; ``.`` idle)."""
        def cell(t: int, s: int) -> str:
            parts = []
            for letter, name in zip("FBW", _ACTIONS, strict=True):
                m, r = getattr(self, f"{name}_micro")[t, s], getattr(self, f"{name}_repeat")[t, s]
                if m >= 0:
                    parts.append(f"{letter}{m}" + (f".{r}" if self.repeats > 1 else ""))
            return " ".join(parts) or "."

        cells = [[cell(t, s) for s in range(self.stages)] for t in range(self.num_ticks)]
        width = max(7, *(len(c) for row in cells for c in row))
        tick = len(str(self.num_ticks - 1))
        head = " " * tick + " | " + " | ".join(f"stage {s}".ljust(width)
                                                for s in range(self.stages))
        lines = [f"{self.kind}: {self.stages} stages, {self.microbatches} micro-batches, "
                 f"{self.repeats} chunk(s) per stage; {self.num_ticks} ticks, bubble "
                 f"{self.bubble_fraction:.3f}", head]
        lines += [str(t).rjust(tick) + " | " + " | ".join(c.ljust(width) for c in row)
                  for t, row in enumerate(cells)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    # -- building a table ------------------------------------------------------------------

    @classmethod
    def from_actions(cls, kind: str, stages: int, microbatches: int, repeats: int,
                     fwd: tuple[np.ndarray, np.ndarray],
                     bwd: tuple[np.ndarray, np.ndarray] | None = None,
                     wgt: tuple[np.ndarray, np.ndarray] | None = None, *,
                     num_slots: int | None = None) -> PipelineSchedule:
        """A table from its actions: ``fwd`` / ``bwd`` / ``wgt`` each ``(micro, chunk)``
        int arrays ``[ticks, stages]`` (``-1``: none; ``bwd`` None: a forward table,
        differentiated by autodiff; ``wgt`` None: weight gradients fused with the
        backwards). The slots (stage inputs, weight-gradient inputs, receive slots) are
        derived: each buffer is a ring indexed by the tick its value is written at, of
        the longest lifetime's size (``num_slots``: a larger stage-input ring).

        Raises:
          ValueError: an action twice or missing, or one before what it needs (a
            forward before the previous virtual stage's, a backward before the next one's
            or its forward, a W before its backward), naming it.
        """
        p, m_count, r_count = int(stages), int(microbatches), int(repeats)
        v_count = p * r_count
        fm, fr = (np.asarray(a, np.int32) for a in fwd)
        ticks = fm.shape[0]
        idle = np.full((ticks, p), -1, np.int32)
        bm, br = (idle, idle) if bwd is None else (np.asarray(a, np.int32) for a in bwd)
        wm, wr = (idle, idle) if wgt is None else (np.asarray(a, np.int32) for a in wgt)
        for name, a in (("fwd", fm), ("fwd", fr), ("bwd", bm), ("bwd", br), ("wgt", wm),
                        ("wgt", wr)):
            if a.shape != (ticks, p):
                raise ValueError(f"PipelineSchedule.from_actions: the {name} table has "
                                 f"shape {a.shape}; every table is [ticks, stages] = "
                                 f"{(ticks, p)}.")
        when = {name: _ticks(name, micro, chunk, p, m_count, r_count)
                for name, micro, chunk in (("fwd", fm, fr), ("bwd", bm, br),
                                           ("wgt", wm, wr))}
        items = {(m, v) for m in range(m_count) for v in range(v_count)}
        for name in _ACTIONS:
            if when[name] and set(when[name]) != items:
                raise ValueError(f"PipelineSchedule.from_actions: the {name} table misses "
                                 f"(micro-batch, virtual stage) "
                                 f"{sorted(items - set(when[name]))[:4]}.")
        if not when["fwd"]:
            raise ValueError("PipelineSchedule.from_actions: no forward action.")
        if when["wgt"] and not when["bwd"]:
            raise ValueError("PipelineSchedule.from_actions: W actions need B actions.")
        fwd_t, bwd_t, wgt_t = when["fwd"], when["bwd"], when["wgt"]
        for (m, v), t in fwd_t.items():
            if v and t <= fwd_t[m, v - 1]:
                raise ValueError(f"PipelineSchedule.from_actions: micro-batch {m}'s forward "
                                 f"of virtual stage {v} at tick {t} is not after that of "
                                 f"{v - 1} (tick {fwd_t[m, v - 1]}).")
        for (m, v), t in bwd_t.items():
            after = fwd_t[m, v] if v == v_count - 1 else bwd_t[m, v + 1] + 1
            if t < max(after, fwd_t[m, v]):
                raise ValueError(f"PipelineSchedule.from_actions: micro-batch {m}'s backward "
                                 f"of virtual stage {v} at tick {t} comes before its forward "
                                 "or the next virtual stage's backward.")
        for key, t in wgt_t.items():
            if t < bwd_t[key]:
                raise ValueError(f"PipelineSchedule.from_actions: the W action of {key} at "
                                 f"tick {t} comes before its backward (tick {bwd_t[key]}).")
        # stage inputs: written at the forward, read at the backward
        fwd_slot = bwd_slot = idle
        slots = 0
        if bwd_t:
            life = {key: (fwd_t[key], bwd_t[key]) for key in items}
            slots = max(_ring_size(life), num_slots or 0)
            fwd_slot, bwd_slot = _ring(life, slots, p, ticks)
        wslots = 0
        bwd_wslot = wgt_slot = idle
        if wgt_t:
            life = {key: (bwd_t[key], wgt_t[key]) for key in items}
            wslots = _ring_size(life)
            bwd_wslot, wgt_slot = _ring(life, wslots, p, ticks)
        # what arrives at tick t was sent at t - 1; kept when used later
        life = {(m, v): (fwd_t[m, v - 1] + 1, t) for (m, v), t in fwd_t.items() if v}
        fwd_keep, fwd_from, fwd_recv = _receive(life, p, ticks)
        life = {(m, v): (bwd_t[m, v + 1] + 1, t) for (m, v), t in bwd_t.items()
                if v < v_count - 1}
        bwd_keep, bwd_from, bwd_recv = _receive(life, p, ticks)
        return cls(kind, p, m_count, r_count, fm, fr, bm, br, fwd_slot, bwd_slot, slots,
                   wm, wr, bwd_wslot, wgt_slot, wslots, fwd_keep, fwd_from, fwd_recv,
                   bwd_keep, bwd_from, bwd_recv)


def _ticks(name: str, micro: np.ndarray, chunk: np.ndarray, p: int, m_count: int,
           r_count: int) -> dict[tuple[int, int], int]:
    """{(micro-batch, virtual stage): tick} of one action table (a ValueError for an
    action out of range or twice)."""
    out: dict[tuple[int, int], int] = {}
    for t, s in zip(*np.nonzero(micro >= 0), strict=True):
        m, r = int(micro[t, s]), int(chunk[t, s])
        if not (0 <= m < m_count and 0 <= r < r_count):
            raise ValueError(f"PipelineSchedule.from_actions: {name} action (micro-batch "
                             f"{m}, chunk {r}) at tick {t}, stage {s} is out of range "
                             f"({m_count} micro-batches, {r_count} chunks).")
        key = (m, r * p + int(s))
        if key in out:
            raise ValueError(f"PipelineSchedule.from_actions: {name} action of (micro-batch, "
                             f"virtual stage) {key} twice, at ticks {out[key]} and {t}.")
        out[key] = int(t)
    return out


def _ring_size(life: dict[tuple[int, int], tuple[int, int]]) -> int:
    """The size of a ring of slots indexed by the tick a value is written at that
    never overwrites a live one: the longest lifetime plus one."""
    return max(end - begin for begin, end in life.values()) + 1


def _ring(life: dict[tuple[int, int], tuple[int, int]], slots: int, p: int, ticks: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """(write slot, read slot) tables of values kept from ``begin`` to ``end`` (ticks)
    on the stage of their virtual stage, in a ring of ``slots`` indexed by ``begin``."""
    write = np.full((ticks, p), -1, np.int32)
    read = np.full((ticks, p), -1, np.int32)
    for (_, v), (begin, end) in life.items():
        write[begin, v % p] = begin % slots
        read[end, v % p] = begin % slots
    return write, read


def _receive(life: dict[tuple[int, int], tuple[int, int]], p: int, ticks: int
             ) -> tuple[np.ndarray, np.ndarray, int]:
    """(keep, from, slots) of the values arriving at a virtual stage's stage at
    ``begin`` and used at ``end``: kept in a receive ring when ``end > begin``."""
    kept = {key: span for key, span in life.items() if span[1] > span[0]}
    if not kept:
        idle = np.full((ticks, p), -1, np.int32)
        return idle, idle, 0
    slots = _ring_size(kept)
    keep, use = _ring(kept, slots, p, ticks)
    return keep, use, slots


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

    fwd = table(t - s, False)
    if kind == "gpipe":
        return PipelineSchedule.from_actions(kind, p, m, r, fwd)
    # a ring of 2V - 1 stage-input slots indexed by the forward tick
    return PipelineSchedule.from_actions(kind, p, m, r, fwd,
                                         table(t - (v - 1) - (p - 1 - s), True),
                                         num_slots=2 * v - 1)


def defer_weights(schedule: PipelineSchedule, ticks: int = 1, *,
                  kind: str | None = None) -> PipelineSchedule:
    """``schedule`` with the weight gradients of each backward as a W action of its own,
    ``ticks`` after the backward (0: in the same tick) or, when that tick's W is taken
    on the stage, at the first free tick after it (the table grows at the end as
    needed). ``kind``: the new table's name (default ``"<kind>+w<ticks>"``)."""
    if not schedule.driven or schedule.deferred:
        raise ValueError(f"defer_weights: the {schedule.kind!r} table needs fused backward "
                         "actions (a driven table without W actions).")
    if isinstance(ticks, bool) or not isinstance(ticks, (int, np.integer)) or ticks < 0:
        raise ValueError(f"defer_weights: ticks={ticks!r} must be an int >= 0.")
    n, p = schedule.num_ticks, schedule.stages
    taken: dict[tuple[int, int], tuple[int, int]] = {}
    for t, s in sorted(zip(*np.nonzero(schedule.bwd_micro >= 0), strict=True)):
        at = int(t) + int(ticks)
        while (at, int(s)) in taken:
            at += 1
        taken[at, int(s)] = (int(schedule.bwd_micro[t, s]), int(schedule.bwd_repeat[t, s]))
    total = max(n, max(t for t, _ in taken) + 1)

    def grown(a):
        return np.concatenate([a, np.full((total - n, p), -1, np.int32)])

    wm, wr = np.full((total, p), -1, np.int32), np.full((total, p), -1, np.int32)
    for (t, s), (m, r) in taken.items():
        wm[t, s], wr[t, s] = m, r
    return PipelineSchedule.from_actions(
        kind or f"{schedule.kind}+w{ticks}", p, schedule.microbatches, schedule.repeats,
        (grown(schedule.fwd_micro), grown(schedule.fwd_repeat)),
        (grown(schedule.bwd_micro), grown(schedule.bwd_repeat)), (wm, wr),
        num_slots=schedule.num_slots)
