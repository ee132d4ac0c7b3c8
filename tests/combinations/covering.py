"""The covering array of the combination harness: feature sets such that, in each mode,
every pair of compatible features of ``sp_jax.compat`` runs together in at least one set
(and each feature alone), plus the risky triples issue 50 names.

A *combination* is a set of features (``sp_jax.compat.FEATURES`` names, closed under what
they bring along: a pipeline its scanned layers, ``expert_parallel`` experts,
``layer_windows`` a window; every set holds ``scan_layers`` or ``unrolled_layers``, the
two values of one option) and the modes it runs in. A combination runs only in modes
where each of its features has a meaning and no pair of them is refused (the harness
builds exactly ``features`` in each of ``modes``; it drops nothing). Its mesh is the one
``tests/compat_features.setup`` makes (each feature's axes, the largest size of each):
at most :data:`MAX_DEVICES` devices, the tests' simulated CPU devices.

The array is generated (greedily, deterministic: no randomness) from the table as
``sp_jax.compat`` builds it without coverage: a pair that is refused, exclusive or has no
meaning in a mode is never a target there, and never in a set run there (a refusal that
a third feature lifts, ``Refusal.unless``, is left out too). A changed table or feature
declaration changes the array and its :func:`fingerprint`; the cases that passed are
recorded by ``make test-combinations`` (:mod:`recording`) in ``tests/combinations/
ran.json``, which ``tests/compat_coverage.py`` reads into the table.

Tiers: :func:`combinations` ``"all"`` is the whole array (``make test-combinations``);
``"feature"`` a few of its cases, so that each feature runs at least once in each mode
where it has a meaning (``make test``). :func:`params` gives the cases as pytest
parameters of ``test_combination``, ids ``f"{mode}-{combination.id}"``, each marked
``slow``, those outside the feature tier ``combinations`` too.

cuDNN's attention (``cudnn_attention``) runs on a GPU, and off one in the harness's
stand-in (XLA's attention in cuDNN's place, ``compat_features.Feature.cpu_stand_in``):
its pairs are covered by sets of their own (ids ``cudnn-NN``), every other set leaves it
out (ids ``cNN``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
from collections.abc import Iterable
from types import SimpleNamespace

import compat_features

from sp_jax import compat
from sp_jax.models import GPTConfig

MAX_DEVICES = 8
"""The largest mesh of a set: the tests' simulated CPU devices (three axes of size 2)."""

OPEN: dict[str, str] = {}
"""Cases that fail for a known, not yet fixed reason (case id -> the finding): strict
xfails; their cells stay untested (``?``) in the table until they pass."""

TRIPLES: dict[str, tuple[str, ...]] = {
    "triple-pipeline-experts-fp8": ("tensor_sequence", "pipeline_gpipe", "expert_parallel",
                                    "fp8_current"),
    "triple-context-packed-window": ("tensor_sequence", "context_ring", "packed_documents",
                                     "sliding_window"),
    "triple-fsdp-offload-pipeline": ("tensor_sequence", "fsdp", "offload_activations",
                                     "offload_optimizer", "pipeline_1f1b"),
    "triple-zero1-experts-pipeline": ("zero1", "expert_parallel", "pipeline_gpipe"),
}
"""The triples issue 50 names as risky, each with a stable id (a tensor axis beside them
where the mesh has room): pipeline x experts x FP8, context x packed x window,
fsdp x offload (activations and optimizer) x pipeline, zero1 x experts x pipeline.
They run before the generated sets, which cover what they leave."""

_GPU_ONLY = ("cudnn_attention",)  # cuDNN's kernel: a GPU, never XLA:CPU

# What a case costs, roughly its compile time against a dense tensor-parallel GPT (1 +
# the features' costs): pipeline stages and experts compile the most, so the greedy
# choice keeps them in few sets.
_COST = dict.fromkeys(compat.FEATURES, 0.2) | {
    "pipeline_gpipe": 3.0, "pipeline_1f1b": 3.0, "experts": 1.5, "expert_parallel": 0.5,
    "fp8_current": 1.0, "fp8_delayed": 1.0, "context_ring": 1.0, "context_ulysses": 0.5,
    "fsdp": 0.5, "zero1": 0.5, "offload_optimizer": 0.5, "offload_activations": 0.5}

_MAX_SIZE = 10  # features of a generated set: a failure stays readable
_SEEDS = 6  # uncovered pairs a step grows a set from (the hardest first)


@dataclasses.dataclass(frozen=True)
class Combination:
    """One set of the array.

    Attributes:
      id: stable across runs while the table and the declarations stay (``"c07"``,
        ``"cudnn-01"``, ``"triple-pipeline-experts-fp8"``).
      features: ``sp_jax.compat`` feature names, in ``FEATURES``' order, closed under
        what they bring along (the harness builds exactly these).
      modes: the modes it runs in (``MODES``' order): each feature has a meaning there,
        no pair is refused.
    """

    id: str
    features: tuple[str, ...]
    modes: tuple[str, ...]


@functools.cache
def _bare() -> dict[str, dict[frozenset[str], compat.Cell]]:
    return compat.build()  # the refusals, exclusive values and n/a cells, no coverage


@functools.cache
def targets(mode: str) -> frozenset[frozenset[str]]:
    """The cells of ``mode`` the array must run: each pair of features (a feature alone:
    a one-element set) that is neither refused, exclusive nor without meaning there."""
    cells = _bare()[mode]
    return frozenset(key for key in (frozenset(p) for p in itertools.combinations_with_replacement(
        compat.FEATURES, 2)) if cells[key].status not in ("refused", "exclusive", "n/a"))


def _tensor(shape: tuple[int, ...]) -> int:
    return dict(zip(compat_features.AXES, shape, strict=True))["tensor"]


@functools.cache
def _brings(name: str) -> frozenset[str]:
    """``name`` and what it brings along: what ``compat.features_of`` reports of the model
    its declaration builds (``tensor_sequence`` only with a tensor axis of its own)."""
    s = compat_features.setup([name])
    found = set(compat.features_of(_config(s), s.parallel, _mesh(s)))
    if _tensor(s.shape) == 1:
        found.discard("tensor_sequence")
    return frozenset({name, *s.names, *found})


def _config(s: compat_features.Setup) -> SimpleNamespace:
    """The GPTConfig's fields of ``s`` (defaults included), without building it."""
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)
                if f.default is not dataclasses.MISSING}
    return SimpleNamespace(**defaults | s.config)


def _mesh(s: compat_features.Setup) -> SimpleNamespace:
    return SimpleNamespace(shape=dict(zip(compat_features.AXES, s.shape, strict=True)))


def closure(names: Iterable[str]) -> frozenset[str]:
    """``names`` and what they bring along; ``unrolled_layers`` (the default) where no
    feature scans the layers."""
    found = frozenset().union(*(_brings(n) for n in names)) - {"unrolled_layers"}
    return found if "scan_layers" in found else found | {"unrolled_layers"}


@functools.cache
def devices(features: frozenset[str]) -> int:
    """The devices of the mesh ``compat_features.setup`` makes for ``features``; a
    ValueError there (two values of one option) is infinitely many."""
    try:
        return math.prod(compat_features.setup(sorted(features)).shape)
    except ValueError:
        return 1 << 30


def features_built(features: Iterable[str]) -> frozenset[str]:
    """The features of the model and call ``compat_features.setup(features)`` builds, as
    the library reports them (``compat.features_of(..., defaults=True)`` of its real
    ``GPTConfig``, and the call's options), ``tensor_sequence`` only with a tensor axis
    of its own: for a test that a set's names are what runs."""
    s = compat_features.setup(features)
    found = set(compat.features_of(s.gpt_config(), s.parallel, _mesh(s), defaults=True))
    found |= {f for flag, f in (("documents", "packed_documents"), ("custom_loss", "custom_loss"),
                                ("offload", "offload_optimizer")) if s.call.get(flag)}
    if _tensor(s.shape) == 1:
        found.discard("tensor_sequence")
    return frozenset(found)


def _pairs(features: Iterable[str]) -> set[frozenset[str]]:
    return {frozenset(p) for p in itertools.combinations_with_replacement(sorted(features), 2)}


def runs_in(features: frozenset[str]) -> tuple[str, ...]:
    """The modes in which the set ``features`` may run: each of its pairs a target there
    (no feature without meaning, no refused or exclusive pair) on at most MAX_DEVICES."""
    if devices(features) > MAX_DEVICES:
        return ()
    pairs = _pairs(features)
    return tuple(m for m in compat.MODES if pairs <= targets(m))


def _ordered(features: Iterable[str]) -> tuple[str, ...]:
    chosen = set(features)
    return tuple(f for f in compat.FEATURES if f in chosen)


def _cost(features: frozenset[str]) -> float:
    # summed in a fixed order: a set's iteration order follows the hash seed, and float
    # sums in another order differ in the last bits, which decided ties between equal
    # gains (measured: 1 of 12 hash seeds gave another array, and pytest-xdist's workers
    # collected different cases)
    return 1.0 + sum(_COST[f] for f in sorted(features))


class _Greedy:
    """AETG-like: each step grows sets from the hardest uncovered pairs, adding the
    feature that covers the most uncovered (mode, pair) cells per cost, and keeps the
    best; ties go to the order of ``compat.FEATURES``."""

    def __init__(self, allowed: tuple[str, ...]):
        self.allowed = allowed
        self.left = {m: {p for p in targets(m) if p <= set(allowed)} for m in compat.MODES}

    def take(self, features: frozenset[str], modes: Iterable[str]) -> tuple[str, ...]:
        """Marks the cells of ``features`` covered in ``modes``; the modes where it
        covered something."""
        used = []
        for m in modes:
            new = _pairs(features) & self.left[m]
            if new:
                self.left[m] -= new
                used.append(m)
        return tuple(used)

    def gain(self, features: frozenset[str]) -> tuple[float, tuple[str, ...]]:
        pairs, total, modes = _pairs(features), 0, []
        for m in runs_in(features):
            new = len(pairs & self.left[m])
            if new:
                total += new
                modes.append(m)
        return total / (_cost(features) * max(len(modes), 1)) if total else 0.0, tuple(modes)

    def grow(self, mode: str, pair: frozenset[str]) -> frozenset[str] | None:
        chosen = closure(pair)
        if mode not in runs_in(chosen):
            return None
        score = self.gain(chosen)[0]
        while len(chosen) < _MAX_SIZE:
            best, best_score = None, score
            for f in self.allowed:
                if f in chosen:
                    continue
                more = closure(chosen | {f})
                if len(more) > _MAX_SIZE or mode not in runs_in(more):
                    continue
                s = self.gain(more)[0]
                if s > best_score + 1e-9:
                    best, best_score = more, s
            if best is None:
                break
            chosen, score = best, best_score
        return chosen

    def seeds(self) -> list[tuple[str, frozenset[str]]]:
        """The uncovered cells whose features have the most uncovered cells left."""
        count: dict[str, int] = {}
        for cells in self.left.values():
            for p in cells:
                for f in p:
                    count[f] = count.get(f, 0) + 1
        order = {f: i for i, f in enumerate(compat.FEATURES)}
        cells = [(m, p) for m in compat.MODES for p in self.left[m]]
        cells.sort(key=lambda c: (-sum(count[f] for f in c[1]) - (len(c[1]) == 1),
                                  sorted(order[f] for f in c[1]), list(compat.MODES).index(c[0])))
        return cells[:_SEEDS]

    def run(self, prefix: str) -> list[Combination]:
        out = []
        while any(self.left.values()):
            best, best_score = None, -1.0
            for mode, pair in self.seeds():
                grown = self.grow(mode, pair)
                if grown is None:
                    raise AssertionError(f"covering: {mode} {sorted(pair)} cannot run in any "
                                         "set (what it brings along is refused there)")
                s, _ = self.gain(grown)
                if s > best_score + 1e-9:  # equal gains: the first seed's set
                    best, best_score = grown, s
            modes = self.take(best, runs_in(best))
            out.append(Combination(f"{prefix}{len(out) + 1:02d}", _ordered(best), modes))
        return out


@functools.cache
def _array() -> tuple[Combination, ...]:
    cpu = tuple(f for f in compat.FEATURES if f not in _GPU_ONLY)
    greedy = _Greedy(cpu)
    triples = []
    for name, features in TRIPLES.items():
        chosen = closure(features)
        triples.append(Combination(name, _ordered(chosen), runs_in(chosen)))
        greedy.take(chosen, runs_in(chosen))
    cpu_sets = greedy.run("c")
    gpu = _Greedy(tuple(compat.FEATURES))
    for combo in (*triples, *cpu_sets):  # what the CPU sets cover, the GPU sets need not
        gpu.take(frozenset(combo.features), combo.modes)
    return (*triples, *cpu_sets, *gpu.run("cudnn-"))


@functools.cache
def _feature_tier() -> frozenset[tuple[str, str]]:
    """(mode, id) of the cases of the feature tier: a greedy cover of every (mode,
    feature) cell by the array's cases, the case that runs the most cells left first (the
    cheaper of equals, then the array's order); the GPU's features (cuDNN) by their own
    sets, the others by the other sets only."""
    chosen = set()
    for gpu in (False, True):
        cases = [(m, c) for c in _array() for m in c.modes
                 if bool(set(c.features) & set(_GPU_ONLY)) == gpu]
        left = {(m, f) for m in compat.MODES for f in compat.FEATURES
                if frozenset({f}) in targets(m) and (f in _GPU_ONLY) == gpu}
        while left:
            def value(case, left=left):
                cells = {(case[0], f) for f in case[1].features} & left
                return len(cells), -_cost(frozenset(case[1].features))

            m, c = max(cases, key=value)
            left -= {(m, f) for f in c.features}
            chosen.add((m, c.id))
    return frozenset(chosen)


def combinations(tier: str = "all") -> list[Combination]:
    """The combinations of ``tier``: ``"all"`` the whole array (the risky triples, the
    generated sets ``cNN``, the GPU's ``cudnn-NN``; ``make test-combinations``),
    ``"feature"`` those of its cases that run each feature at least once in each mode
    where it has a meaning (each with the modes it runs in there; ``make test``)."""
    if tier == "all":
        return list(_array())
    if tier == "feature":
        chosen = _feature_tier()
        return [dataclasses.replace(c, modes=tuple(m for m in c.modes if (m, c.id) in chosen))
                for c in _array() if any((m, c.id) in chosen for m in c.modes)]
    raise ValueError(f"covering.combinations: unknown tier {tier!r}; use 'all' or 'feature'.")


def uncovered(mode: str, combos: Iterable[Combination] | None = None) -> set[frozenset[str]]:
    """The cells of ``mode`` (:func:`targets`) no combination (default: the whole array)
    runs in that mode."""
    left = set(targets(mode))
    for c in _array() if combos is None else combos:
        if mode in c.modes:
            left -= _pairs(c.features)
    return left


def cases(tier: str = "all") -> list[tuple[str, Combination]]:
    """``(mode, combination)`` of each case of ``tier``, the array's order."""
    return [(m, c) for c in combinations(tier) for m in c.modes]


def case_id(mode: str, combo: Combination) -> str:
    """The case's pytest id: ``f"{mode}-{combo.id}"``."""
    return f"{mode}-{combo.id}"


def params() -> list:
    """Every case as a ``pytest.param(mode, combination, id=case_id(...))`` for
    ``test_combination``: each marked ``slow`` (an end-to-end case: not in make
    test-fast), those outside the feature tier also ``combinations`` (make test leaves
    them to make test-combinations), those of :data:`OPEN` strict xfails."""
    import pytest

    feature = _feature_tier()

    def marks(m: str, c: Combination) -> tuple:
        case = case_id(m, c)
        known = (pytest.mark.xfail(strict=True, reason=OPEN[case]),) if case in OPEN else ()
        return (pytest.mark.slow, *known,
                *(() if (m, c.id) in feature else (pytest.mark.combinations,)))

    return [pytest.param(m, c, id=case_id(m, c), marks=marks(m, c)) for m, c in cases("all")]


def fingerprint() -> str:
    """A hash of the whole array (ids, features, modes) and the features' declarations:
    a recorded run stands for this array only."""
    text = json.dumps({"array": [dataclasses.astuple(c) for c in _array()],
                       "base": repr(compat_features.BASE),
                       "features": {n: repr(f) for n, f in compat_features.FEATURES.items()}},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sizes() -> dict[str, int]:
    """Cases of the whole array per mode."""
    return {m: sum(m in c.modes for c in _array()) for m in compat.MODES}
