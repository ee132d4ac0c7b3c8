"""The combination harness: a set of features of ``sp_jax.compat``'s table, in a mode,
against the same model unsharded.

``run(features, mode)`` builds the small GPT of tests/compat_features.py's ``setup``
(each feature declared once there: its configuration, ``ParallelConfig`` fields, mesh
axes, call options and what the reference keeps) on the smallest mesh the features
need, and the unsharded reference (one device, the default ``ParallelConfig``, the same
weights; what changes the math stays in it), and compares, as a user runs each mode:

- ``train``: three steps of :class:`sp_jax.training.TrainStep` (AdamW; the features'
  ``offload_optimizer``, a custom ``loss_fn``, packed rows, micro-batches: two for a
  pipeline), the same batches and keys for both: the loss of every step, every gradient
  of the first step (what the optimizer received, recorded in its state) and the
  parameters after the third. fp32: 1e-5. FP8: the first step's loss within 4e-4, its
  gradients as test_compat's FP8 cases, the amaxes the first step recorded (delayed
  scaling) within 1e-6; the later steps' losses within 1e-2. Attention dropout stays on
  in both: its masks are drawn per position, the same under every sharding, so the
  comparison is the exact one.
- ``eval``: ``model(tokens)`` logits and ``model.hidden_states(tokens)`` (eval mode:
  dropout off).
- ``generate``: greedy tokens of ``sp_jax.models.generate`` for ragged prompts equal to
  the one-device model's (a set whose logits bound is looser than fp32's, bf16 compute
  or FP8: equal up to a row's first difference, and there a near-tie of the reference's
  own logits, :func:`_greedy`); and the cache read back: after a prefill and decode steps,
  the next-token logits from the sharded model's cache (whatever its layout: split over
  a context axis, ring attention's zigzag) equal the reference's, and the reference's
  full-forward logits of the same rows (FP8: not the forward's, since decoding's
  single-token products run in the compute dtype while the prefill quantises; and the
  prompts given padded to a width every mesh divides, :func:`_fp8_rows`).

A refused, exclusive or meaningless set raises a ValueError before anything is built
(:func:`check`); a set whose mesh needs more devices than there are, too. A feature
that needs a GPU (cuDNN's kernel) runs elsewhere in its declared stand-in
(``Feature.cpu_stand_in``: the sharded model's run inside it; cuDNN's attention: XLA's
implementation of ``jax.nn.dot_product_attention`` in its place), or is skipped
(``pytest.skip``) where it declares none.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import compat_features
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import cache_and_forward_logits, copy_weights, decoded_logits, param_values, to_host
from flax import nnx

from sp_jax import Layout, compat
from sp_jax.layers import document_labels
from sp_jax.models import GPT, generate
from sp_jax.training import TrainStep, lm_loss

MODES = tuple(compat.MODES)
B, STEPS = 4, 3
S = compat_features.BASE["max_seq_len"]
VOCAB = compat_features.BASE["vocab_size"]
PROMPTS = ([5, 17, 3, 60, 41, 9, 60], [12, 2], [33, 8, 19])  # ragged rows
NEW_TOKENS = 6


def documents(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Packed rows ``[rows, S]``: ``segment_ids`` (two documents a row, 10 and 6 tokens;
    row 1 a single one) and their ``positions``."""
    docs = np.where(np.arange(S) < 10, 1, 2)[None].repeat(rows, 0).astype(np.int32)
    docs[1] = 1
    return docs, np.where(docs == 1, np.arange(S), np.arange(S) - 10).astype(np.int32)


TIMES: dict[tuple[tuple[str, ...], str], float] = {}
"""Seconds each ``run`` took, by (features, mode) (for the report of a run)."""


def check(features: Iterable[str], mode: str) -> compat_features.Setup:
    """The :class:`compat_features.Setup` of ``features`` in ``mode``; a ValueError
    naming the cell where the table says the set cannot run: a refused pair
    (``compat.check``'s CombinationError), two values of one option, a feature with no
    meaning in ``mode``, or a mesh larger than the devices there are."""
    features = tuple(features)
    if mode not in MODES:
        raise ValueError(f"harness: unknown mode {mode!r}; use one of {list(MODES)}.")
    unknown = [f for f in features if f not in compat.FEATURES]
    if unknown:
        raise ValueError(f"harness: unknown features {unknown}; use names of "
                         "sp_jax.compat.FEATURES.")
    for a, b in itertools.combinations_with_replacement(features, 2):
        status = compat.cell(mode, a, b).status
        if status in ("exclusive", "n/a"):
            what = f"{a} alone" if a == b else f"{a} x {b}"
            raise ValueError(f"harness: {what} is {status} in {mode} (sp_jax.compat); it "
                             "cannot run.")
    compat.check(mode, list(features), where="harness")
    made = compat_features.setup(features)
    compat.check(mode, list(made.names), where="harness")  # with what they imply
    if made.devices > jax.device_count():
        raise ValueError(f"harness: {features} need a mesh {made.shape} over "
                         f"{compat_features.AXES} ({made.devices} devices); there are "
                         f"{jax.device_count()}.")
    return made


def run(features: Iterable[str], mode: str, *,
        tamper: Callable[[nnx.Module], None] | None = None) -> None:
    """Runs ``features`` in ``mode`` sharded and unsharded and compares them (see the
    module's docstring); an AssertionError naming the features, the mode and the
    quantity that differs. ``tamper``: called with the sharded model after it holds the
    reference's weights (a test that the harness can fail)."""
    features = tuple(features)
    made = check(features, mode)
    stand_in = contextlib.nullcontext()
    if made.device == "gpu" and jax.default_backend() != "gpu":
        if made.cpu_stand_in is None:
            pytest.skip(f"{features}: needs a GPU (cuDNN's attention kernel)")
        stand_in = made.cpu_stand_in()
    start = time.perf_counter()
    ref = _reference(made.reference(), _shape(made), mode)  # never in the stand-in
    with stand_in:
        got = _RUNS[mode](made, _shape(made), ref["init"], tamper)
    _compare(made, mode, got, ref, f"{'+'.join(features)} in {mode}", _shape(made))
    TIMES[features, mode] = time.perf_counter() - start


# -- the models -----------------------------------------------------------------------


def _build(made: compat_features.Setup, init: dict | None, tamper=None
           ) -> tuple[Any, nnx.Module]:
    """The mesh and the model of ``made`` on it, with the parameter values ``init`` (None:
    its own, from seed 0), laid out as the model's annotations say; ``tamper(model)``
    then, under the mesh."""
    mesh = made.mesh()
    with jax.set_mesh(mesh):
        model = GPT(made.gpt_config(), parallel=made.parallel, rngs=nnx.Rngs(0))
        if init is not None:
            copy_weights(model, init)
            state = nnx.state(model, nnx.Param)
            nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
        if tamper is not None:
            tamper(model)
    return mesh, model


def _shape(made: compat_features.Setup) -> tuple[int, int, int]:
    """``(micro_batches, rows, data)`` of a step: a pipeline's micro-batches (else one),
    ``B`` rows, or more where the data axes (data and expert: the batch's split) ask, and
    the data axes' size."""
    micro = made.parallel.pipeline_microbatches if made.parallel.pipeline_axis else 1
    sizes = dict(zip(compat_features.AXES, made.shape, strict=True))
    data = math.prod(sizes.get(a, 1) for a in Layout.of(made.parallel).data_axes)
    return micro, max(B, micro * data), data


def _batches(made: compat_features.Setup, shape: tuple[int, ...]
             ) -> list[dict[str, np.ndarray]]:
    """``STEPS`` batches ``[micro, rows / micro, S]`` of random tokens (seeded), with the
    packed rows' ``segment_ids`` / ``positions`` when the set has documents."""
    micro, n = shape[:2]
    rng = np.random.default_rng(1)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(0, VOCAB, (n, S + 1)).astype(np.int32)
        rows = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
        if made.call.get("documents"):
            rows |= dict(zip(("segment_ids", "positions"), documents(n), strict=True))
        out.append({k: v.reshape(micro, n // micro, S) for k, v in rows.items()})
    return out


def custom_loss(model: nnx.Module, batch: dict, key: jax.Array) -> tuple:
    """A ``loss_fn`` other than ``lm_loss``: the cross entropy written out from the
    logits of ``model(tokens)`` (packed rows: targets across documents dropped), dropout
    drawing from ``key``; ``(sum, count)``."""
    docs = {k: batch[k] for k in ("segment_ids", "positions") if k in batch}
    labels = batch["labels"]
    if "segment_ids" in docs:
        labels = document_labels(labels, docs["segment_ids"], -100)
    logits = model(batch["tokens"], rngs=nnx.Rngs(dropout=key), **docs).astype(jnp.float32)
    keep = labels != -100
    # one-hot, not a gather: logits sharded over the vocabulary on an Explicit mesh
    targets = jax.nn.one_hot(jnp.where(keep, labels, 0), logits.shape[-1]) * keep[..., None]
    return -jnp.sum(jax.nn.log_softmax(logits) * targets), jnp.sum(keep)


def _recording(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` whose state also holds the last gradients it was given (what the step
    computed, reduced and laid out as the optimizer sees them)."""
    def init(params):
        return tx.init(params), jax.tree.map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        updates, inner = tx.update(grads, state[0], params)
        return updates, (inner, grads)

    return optax.GradientTransformation(init, update)


def _train(made: compat_features.Setup, shape: tuple[int, int, int], init: dict | None,
           tamper=None) -> dict:
    """Three ``TrainStep`` s of ``made`` from ``init``: losses, the first step's
    gradients, the final parameters (host arrays), the initial values."""
    mesh, model = _build(made, init, tamper)
    init = param_values(model)
    loss_fn = custom_loss if made.call.get("custom_loss") else lm_loss
    with jax.set_mesh(mesh):
        step = TrainStep(model, _recording(optax.adamw(LR, eps=ADAM_EPS)), loss_fn=loss_fn,
                         offload_optimizer=bool(made.call.get("offload")))
        losses, grads = [], None
        for i, batch in enumerate(_batches(made, shape)):
            losses.append(float(step(batch, jax.random.key(i))["loss"]))
            if i == 0:
                grads = to_host(nnx.to_pure_dict(step.opt_state[1]))
        params = to_host(nnx.to_pure_dict(step.params))
    return dict(init=init, losses=np.array(losses), grads=grads, params=params)


def _forward(model: nnx.Module, tokens: jax.Array, docs: dict) -> tuple:
    return model(tokens, **docs), model.hidden_states(tokens, **docs)


_FORWARD = nnx.jit(_forward)


def _eval(made: compat_features.Setup, shape: tuple[int, int, int], init: dict | None,
          tamper=None) -> dict:
    """Logits and hidden states of ``made`` in eval mode on the batch's rows."""
    mesh, model = _build(made, init, tamper)
    init = param_values(model)
    first = _batches(made, (1, shape[1]))[0]
    docs = {k: first[k][0] for k in ("segment_ids", "positions") if k in first}
    with jax.set_mesh(mesh):
        model.eval()
        logits, hidden = _FORWARD(model, first["tokens"][0], docs)
    return dict(init=init, logits=to_host(logits), hidden=to_host(hidden))


def _generate(made: compat_features.Setup, shape: tuple[int, int, int], init: dict | None,
              tamper=None) -> dict:
    """Greedy tokens of ``generate`` for ``PROMPTS``, and the next-token logits read from
    the cache after a prefill and decode steps (``cache_and_forward_logits``) with the
    model's full-forward logits of the same rows."""
    reference = init is None  # its own weights: the unsharded reference
    mesh, model = _build(made, init, tamper)
    init = param_values(model)
    rng = np.random.default_rng(0)
    rows = max(2, shape[2])  # two rows, or one per data shard
    full = rng.integers(0, VOCAB, (rows, S)).astype(np.int32)
    lengths, steps = np.resize([5, 3], rows), 4
    prompts: Any = [list(p) for p in PROMPTS]
    if made.first_step:  # FP8: both models given the same rows (see _fp8_rows)
        prompts = _fp8_rows()
    with jax.set_mesh(mesh):
        tokens = np.asarray(generate(model, prompts, max_new_tokens=NEW_TOKENS).tokens)
        decoding = model.for_decoding()
        decoding.eval()
        cached, forward = cache_and_forward_logits(decoding, full, lengths, steps)
        picked = None
        if reference:  # the logits its greedy tokens were picked from
            given, given_lengths = _prompt_array(prompts)
            own = np.zeros((len(given_lengths), S), np.int32)
            own[:, :given.shape[1]] = given
            at_new = given_lengths[:, None] + np.arange(NEW_TOKENS)
            own[np.arange(len(own))[:, None], at_new] = tokens
            picked = decoded_logits(decoding, own, given_lengths, NEW_TOKENS - 1)
    at = lengths + steps - 1
    return dict(init=init, tokens=tokens, cached=cached,
                forward=forward[np.arange(rows), at], picked=picked)


def _prompt_array(prompts: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [rows, 8], lengths [rows])`` of ``PROMPTS`` as lists or already padded
    (:func:`_fp8_rows`)."""
    if isinstance(prompts, tuple):
        return prompts
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), 8), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens, lengths


def _fp8_rows() -> tuple[np.ndarray, np.ndarray]:
    """``PROMPTS`` as ``generate``'s padded form, ``[3, 8]`` and lengths: a width every
    mesh's sequence shards divide, so that ``generate`` pads no position more on any mesh.

    FP8 current scaling takes one amax over the whole activation tensor, so every row
    and every padded position of a batch sets the scale of all of them. The rows are
    left as given: on a data axis of 2 ``generate`` adds a fourth, a copy of the first,
    which adds no new value to any amax (measured before it copied: a filler row of one
    token changed 1 of 18 greedy tokens of the one-device model), and the comparison
    checks exactly that. The positions past a prompt's end are the ones the width adds,
    the same on both sides."""
    tokens = np.zeros((len(PROMPTS), 8), np.int32)
    lengths = np.zeros(len(PROMPTS), np.int32)
    for i, prompt in enumerate(PROMPTS):
        tokens[i, :len(prompt)], lengths[i] = prompt, len(prompt)
    return tokens, lengths


_RUNS = {"train": _train, "eval": _eval, "generate": _generate}


def _reference(made: compat_features.Setup, shape: tuple[int, int, int], mode: str) -> dict:
    """The unsharded model's results in ``mode`` (its own weights, seed 0; batches of
    ``shape``), cached by what they depend on: the configuration, the call's options and
    the batch's shape (sets that differ only in how they lay the model out share one)."""
    rows = {"train": shape[:2], "eval": shape[1], "generate": shape[2]}[mode]
    key = (tuple(sorted((k, repr(v)) for k, v in made.config.items())),
           tuple(sorted(made.call.items())), rows, mode)
    if key not in _REFERENCES:
        _REFERENCES[key] = _RUNS[mode](made, shape, None)
    return _REFERENCES[key]


_REFERENCES: dict[tuple, dict] = {}


# -- the comparison -------------------------------------------------------------------


def _leaves(tree: Any) -> dict[str, np.ndarray]:
    """Each leaf of ``tree`` as a host array, by its path."""
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _close(got: Any, want: Any, bound: tuple[float, float], what: str) -> None:
    """Every leaf of ``got`` within ``bound`` (rtol, atol) of ``want``'s, paths equal."""
    got_leaves, want_leaves = _leaves(got), _leaves(want)
    assert got_leaves.keys() == want_leaves.keys(), (
        f"{what}: the leaves differ: {sorted(got_leaves.keys() ^ want_leaves.keys())}")
    rtol, atol = bound
    for path, x in got_leaves.items():
        np.testing.assert_allclose(x, want_leaves[path], rtol=rtol, atol=atol,
                                   err_msg=f"{what}{path}")


def _close_positions(got: np.ndarray, want: np.ndarray, bound: tuple[float, float],
                     flips: int, what: str,
                     noise: Callable[[], np.ndarray] | None = None) -> None:
    """``got`` within ``bound`` of ``want`` (``[rows, seq, ...]``) at every position but
    at most ``flips`` of them (0: :func:`_close`) and, with ``noise`` (a function giving
    ``[rows, seq]``: how far the reference's own values move under fp32 noise,
    :func:`_noise`), but those where ``got`` differs by at most :data:`NOISE_SLACK` times
    that (called only when some position is off the bound)."""
    got, want = np.asarray(got), np.asarray(want)
    rtol, atol = bound
    off = ~np.isclose(got, want, rtol=rtol, atol=atol)
    bad = np.argwhere(off.reshape(*off.shape[:2], -1).any(axis=-1))
    diff = np.abs(got - want).reshape(*off.shape[:2], -1).max(axis=-1)
    keep = np.ones(off.shape[:2], bool)
    excused = 0
    if noise is not None and len(bad) > flips:
        envelope = noise()
        moved = diff[tuple(bad.T)] <= NOISE_SLACK * envelope[tuple(bad.T)]
        keep[tuple(bad[moved].T)] = False
        bad, excused = bad[~moved], int(moved.sum())
    more = "" if noise is None else f"; {excused} more within the reference's fp32 noise"
    assert len(bad) <= flips, (
        f"{what}: {len(bad)} of {off.shape[0] * off.shape[1]} positions off the bound "
        f"(at most {flips}{more}): "
        f"{bad[:5].tolist()}, largest difference {np.max(diff[tuple(bad.T)]):.3g}, largest "
        f"value {np.max(np.abs(want)):.3g}")
    keep[tuple(bad.T)] = False
    np.testing.assert_allclose(got[keep], want[keep], rtol=rtol, atol=atol, err_msg=what)


NOISE_ULPS, NOISE_TRIALS, NOISE_SLACK = 4, 12, 1.25
"""FP8 eval's allowance (:func:`_noise`): each fp32 weight of the reference multiplied by
``1 + u``, ``u`` uniform within ``NOISE_ULPS`` units in the last place of 1 (the size of
the fp32 difference the sharding itself makes: another summation order moves the fp32
logits by up to 1.8e-6 of values up to ~4, measured on tensor_sequence with and without
grouped-query attention), in ``NOISE_TRIALS`` seeded trials; a position whose sharded
difference is at most ``NOISE_SLACK`` times the largest of the trials' is a value the
reference itself rounds to either FP8 quantum."""


def _noise(made: compat_features.Setup, shape: tuple[int, int, int], ref: dict,
           name: str) -> np.ndarray:
    """``[rows, seq]``: the largest difference over :data:`NOISE_TRIALS` trials between
    the reference's eval ``name`` (logits, hidden) and the same model's with fp32 noise
    in its weights (:data:`NOISE_ULPS`), each position's largest over its values.

    Why (measured, 2026-12-07): FP8 current scaling quantises every GEMM's input to e4m3
    (3 mantissa bits); a value within fp32 rounding of the boundary between two quanta
    lands on either, ~6% apart, and causal attention carries it to every later position
    of its row. tensor_sequence + grouped_query + FP8 eval differs from the reference by
    0.0428 at 5 of 64 positions (row 0 from position 2); the reference with 1-ulp noise
    in its weights differs from itself by the same 0.0428 at the same 5 positions in 2 of
    3 trials. eval-c14 (0.122 at 28 positions) and eval-c15 (0.0239 at one) likewise
    (1 of 3 trials; 5 of 12 at 4 ulps). A wrong sharding is no such value: it moves
    positions the reference's own noise never moves (tests/combinations/
    test_combinations.py's tampered model fails)."""
    cache = ref.setdefault("noise", {})
    if name not in cache:
        rng = np.random.default_rng(0)
        reference = made.reference()

        def noisy(path, x):
            x = np.asarray(x)
            if x.dtype != np.float32 or "fp8_history" in jax.tree_util.keystr(path):
                return x
            u = rng.uniform(-1.0, 1.0, x.shape) * NOISE_ULPS * np.finfo(np.float32).eps
            return (x * (1 + u)).astype(np.float32)

        trials = []
        for _ in range(NOISE_TRIALS):
            moved = _RUNS["eval"](reference, shape,
                                  jax.tree_util.tree_map_with_path(noisy, ref["init"]))
            for key in ("logits", "hidden"):
                trials.append((key, np.abs(np.asarray(moved[key]) - np.asarray(ref[key]))))
        for key in ("logits", "hidden"):
            d = [t for k, t in trials if k == key]
            cache[key] = np.max([x.reshape(*x.shape[:2], -1).max(axis=-1) for x in d], axis=0)
    return cache[name]


LR, ADAM_EPS = 3e-3, 1e-5
"""The harness's AdamW (:func:`_train`)."""


def _close_params(got: dict, ref: dict, bound: tuple[float, float], what: str) -> None:
    """The parameters after :data:`STEPS` AdamW steps within ``bound``, or, per entry,
    within what AdamW makes of the first step's gradient difference: its update ``lr m /
    (sqrt(v) + eps)`` moves by up to ``lr |dg| / (|g| + eps)`` for a gradient ``g``
    changed by ``dg``, so ``STEPS`` times that (twice: the later steps' gradients differ
    as much again). An entry whose gradient is near zero moves by a sizeable part of ``lr``
    for an fp32 difference of its gradient (measured, train-c19 2026-12-07: a gradient of
    -2.64e-6 against the reference's -2.72e-6, within the gradients' 1e-5, moved its
    parameter 1.39e-5 off after 3 steps); a wrong update (a step lost, a shard's moments
    mixed up) moves entries whose gradients agree."""
    got_g, want_g = _leaves(got["grads"]), _leaves(ref["grads"])
    got_p, want_p = _leaves(got["params"]), _leaves(ref["params"])
    assert got_p.keys() == want_p.keys(), (
        f"{what}: the leaves differ: {sorted(got_p.keys() ^ want_p.keys())}")
    rtol, atol = bound
    for path, x in got_p.items():
        want = want_p[path]
        allowed = atol + rtol * np.abs(want)
        if path in got_g and path in want_g and got_g[path].shape == x.shape:
            g, w = got_g[path], want_g[path]
            allowed = allowed + 2 * STEPS * LR * np.abs(g - w) / (np.abs(w) + ADAM_EPS)
        off = np.abs(x.astype(np.float64) - want) > allowed
        assert not off.any(), (
            f"{what}{path}: {int(off.sum())} of {x.size} entries off the bound and AdamW's "
            f"allowance for their gradients' difference, first at "
            f"{np.argwhere(off)[0].tolist()}: {x[off][0]} vs {want[off][0]}")


def _histories(params: dict) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in
            jax.tree_util.tree_flatten_with_path(params)[0] if "fp8_history" in str(p)}


def _plain(params: dict) -> dict:
    """``params`` without the FP8 amax histories (not parameters the optimizer moves)."""
    def drop(tree):
        if isinstance(tree, dict):
            return {k: drop(v) for k, v in tree.items() if "fp8_history" not in str(k)}
        return tree
    return drop(params)


def _compare(made: compat_features.Setup, mode: str, got: dict, ref: dict,
             what: str, shape: tuple[int, int, int]) -> None:
    if mode == "train":
        losses, want = got["losses"], ref["losses"]
        assert np.all(np.isfinite(losses)), f"{what}: losses {losses}"
        if made.first_step:  # FP8: the first step bounded, the later ones loosely
            np.testing.assert_allclose(losses[0], want[0], rtol=made.bound("loss")[0],
                                       err_msg=f"{what}: the first step's loss")
            # later steps: one FP8 quantum flipped by another summation order, amplified
            # by AdamW, may move them (measured on three sets: within 2e-7 relative);
            # not "falling": the three batches are random tokens, the reference's losses
            # rise and fall too
            np.testing.assert_allclose(losses, want, rtol=1e-2,
                                       err_msg=f"{what}: FP8 losses of later steps")
            _close(got["grads"], ref["grads"], made.bound("grads"), f"{what}: gradient ")
            g, w = _histories(got["params"]), _histories(ref["params"])
            assert g.keys() == w.keys(), f"{what}: amax histories {sorted(g)} vs {sorted(w)}"
            rtol, atol = made.bounds.get("amax", (1e-6, 0.0))
            for name, h in g.items():  # newest first: the first step's in column STEPS - 1
                np.testing.assert_allclose(h[..., STEPS - 1], w[name][..., STEPS - 1],
                                           rtol=rtol, atol=atol,
                                           err_msg=f"{what}: amaxes {name}")
            return
        np.testing.assert_allclose(losses, want, rtol=made.bound("loss")[0],
                                   atol=made.bound("loss")[1], err_msg=f"{what}: losses")
        _close(got["grads"], ref["grads"], made.bound("grads"), f"{what}: gradient ")
        _close_params(got, ref, made.bound("params"), f"{what}: parameters after {STEPS} steps ")
    elif mode == "eval":
        bound = made.bound("logits")
        # bf16 / FP8 with experts: a discrete choice may flip at one position (measured,
        # eval-cudnn-04: bf16 + FP8 + sigmoid routing in stages, 1 of 32 positions' logits
        # off by up to 1.85, every other position within the bound): a token routed to
        # another expert, or a value rounded to the other FP8 quantum, changes that
        # position's whole output. fp32 sets: none.
        flips = int(bound != compat_features.FP32_BOUND and "experts" in made.names)
        for name in ("logits", "hidden"):
            # FP8: also where the reference's own fp32 noise moves it as far (_noise)
            noise = (functools.partial(_noise, made, shape, ref, name) if made.first_step
                     else None)
            _close_positions(got[name], ref[name], bound, flips, f"{what}: {name}", noise)
    else:
        bound = made.bound("logits")
        _greedy(got["tokens"], ref["tokens"], ref["picked"], bound, what)
        _close(got["cached"], ref["cached"], bound,
               f"{what}: next-token logits from the cache vs the reference's")
        if not made.first_step:  # FP8: decoding's single-token products run unquantised
            _close(got["cached"], ref["forward"], bound,
                   f"{what}: next-token logits from the cache vs the reference's forward")


def _greedy(got: np.ndarray, want: np.ndarray, picked: np.ndarray,
            bound: tuple[float, float], what: str) -> None:
    """Greedy tokens ``[rows, NEW_TOKENS]`` of the sharded model (``got``) against the
    reference's (``want``), ``picked``: the reference's logits ``[rows, NEW_TOKENS, V]``
    its tokens were chosen from (its own decoding, :func:`decoded_logits`).

    fp32 (the logits ``bound`` fp32's): equal. A looser bound (bf16 compute, FP8): equal
    up to a row's first difference, and there a near-tie of the reference: the logits
    of the two tokens within twice the bound of each other (each may move by the bound
    under the sharding, ``bound`` the comparison's ``(rtol, atol)`` of logits), which
    whole bf16 / FP8 quanta of rounding can flip (measured: an FP8 value rounded from
    bf16 flips by one e4m3 quantum, ~6%); after it the rows' contexts differ, so the
    rest of the row is not compared."""
    if bound == compat_features.FP32_BOUND:
        np.testing.assert_array_equal(got, want, err_msg=f"{what}: greedy tokens")
        return
    rtol, atol = bound
    for row in range(want.shape[0]):
        differ = np.flatnonzero(got[row] != want[row])
        if differ.size == 0:
            continue
        n = differ[0]
        logits = picked[row, n].astype(np.float64)
        a, b = int(want[row, n]), int(got[row, n])
        margin, allowed = logits[a] - logits[b], 2 * (atol + rtol * max(abs(logits[a]),
                                                                        abs(logits[b])))
        assert margin <= allowed, (
            f"{what}: greedy tokens of row {row} differ at new token {n} ({b} against the "
            f"reference's {a}), where the reference's logits are {margin:.4g} apart, not a "
            f"near-tie (<= {allowed:.4g}, twice the logits' bound): {got[row]} vs "
            f"{want[row]}")
