"""CPU step time (jitted forward+backward of one block) of each variant, interleaved.

All variants are compiled and warmed up first, then timed in rounds; each round times
every variant once (``inner`` steps each, in an order rotated per round), so slow phases
of a noisy machine hit all variants alike. Reported: the median step time per variant
and the median over rounds of its ratio to the GSPMD baseline's time in the same round.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax

from benchmarks.variants import VARIANTS, Shape, make_setup

__all__ = ["REFERENCE", "step_times"]

REFERENCE = "gspmd"  # ratios are to the GSPMD baseline's time


def step_times(shape: Shape, *, rounds: int, inner: int, warmup: int) -> dict[str, Any]:
    """Times every variant of :data:`~benchmarks.variants.VARIANTS` at ``shape`` on the
    simulated CPU devices.

    Every variant gets the same weights (copied from the GSPMD baseline's) and input.
    """
    variants, reference = VARIANTS, REFERENCE
    ref_setup = make_setup(reference, shape, abstract=False)
    with ref_setup.context():
        ref_model = _merge(ref_setup)
    runs = {}
    for v in variants:
        setup = ref_setup if v == reference else make_setup(v, shape, abstract=False,
                                                             weights_from=ref_model)
        with setup.context():
            fn = jax.jit(setup.grad_fn())
            t0 = time.perf_counter()
            jax.block_until_ready(fn(setup.params, setup.x))
            compile_s = time.perf_counter() - t0
            for _ in range(warmup):
                jax.block_until_ready(fn(setup.params, setup.x))
        runs[v] = (setup, fn, compile_s)
    samples: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants)
    for r in range(rounds):
        this_round = {}
        for v in order[r % len(order):] + order[: r % len(order)]:
            setup, fn, _ = runs[v]
            with setup.context():
                t0 = time.perf_counter()
                for _ in range(inner):
                    out = fn(setup.params, setup.x)
                jax.block_until_ready(out)
                this_round[v] = (time.perf_counter() - t0) / inner
        for v in variants:
            samples[v].append(this_round[v])
            ratios[v].append(this_round[v] / this_round[reference])
    return {
        "shape": shape.as_dict(),
        "rounds": rounds, "inner": inner, "warmup": warmup, "reference": reference,
        "median_s": {v: statistics.median(samples[v]) for v in variants},
        "ratio_to_reference": {v: statistics.median(ratios[v]) for v in variants},
        "ratio_quartiles": {v: _quartiles(ratios[v]) for v in variants},
        "samples_s": samples,
        "compile_s": {v: runs[v][2] for v in variants},
    }


def _quartiles(xs: list[float]) -> list[float]:
    """25th and 75th percentiles."""
    if len(xs) < 2:
        return [xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


def _merge(setup):
    from flax import nnx

    return nnx.merge(setup.graphdef, setup.params)
