"""Optimizer precision: ``sp_jax.training.adamw`` (moments in a chosen dtype; bitwise
``optax.adamw`` without one, a NumPy reference of the same arithmetic with bf16 moments)
and ``ParallelConfig(grad_reduce_dtype=jnp.bfloat16)`` (gradients summed over the
micro-batches in fp32 per data shard, reduced over the data axes in bf16: against the
per-shard gradients of an unsharded model summed in bf16, and the compiled step's
all-reduces carrying bf16)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _util import copy_weights, slow_except
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import TrainStep, adamw, lm_loss

B1, B2, EPS, LR, WD = 0.9, 0.999, 1e-8, 1e-2, 0.1


def _tree_and_grads(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(5, 3)).astype(np.float32),
              "b": {"bias": rng.normal(size=(3,)).astype(np.float32)}}
    grads = [jax.tree.map(lambda p: (rng.normal(size=p.shape) * 10.0 ** rng.integers(-4, 1))
                          .astype(np.float32), params) for _ in range(steps)]
    return params, grads


def _run(tx, params, grads):
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = []
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        out.append((updates, state))
    return params, out


@pytest.mark.parametrize("schedule", slow_except([False, True], False))
def test_adamw_without_moment_dtypes_is_optax_adamw_bitwise(schedule):
    params, grads = _tree_and_grads(6)
    lr = optax.linear_schedule(LR, LR / 10, 6) if schedule else LR
    got = _run(adamw(lr, b1=B1, b2=B2, eps=EPS, weight_decay=WD), params, grads)
    want = _run(optax.adamw(lr, b1=B1, b2=B2, eps=EPS, weight_decay=WD), params, grads)
    jax.tree.map(np.testing.assert_array_equal, got, want)  # same state structure too


def test_adamw_bf16_moments_follow_a_numpy_reference():
    """bf16 first and second moments: each step reads them, updates and bias-corrects in
    fp32 and stores them rounded to bf16 (NumPy float32 / ml_dtypes.bfloat16 here)."""
    params, grads = _tree_and_grads(6, seed=1)
    bf16 = jnp.bfloat16
    _, steps = _run(adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, mu_dtype=bf16,
                          nu_dtype=bf16), params, grads)
    f32, b16 = np.float32, ml_dtypes.bfloat16
    p = jax.tree.map(np.asarray, params)
    mu = jax.tree.map(lambda x: np.zeros(x.shape, b16), p)
    nu = jax.tree.map(lambda x: np.zeros(x.shape, b16), p)
    for t, (g, (updates, state)) in enumerate(zip(grads, steps, strict=True), start=1):
        m32 = jax.tree.map(lambda g, m: f32(1 - B1) * g + f32(B1) * m.astype(f32), g, mu)
        v32 = jax.tree.map(lambda g, v: f32(1 - B2) * (g * g) + f32(B2) * v.astype(f32), g, nu)
        mu, nu = jax.tree.map(lambda x: x.astype(b16), (m32, v32))
        adam = state[0]
        assert all(x.dtype == bf16 for x in jax.tree.leaves((adam.mu, adam.nu)))
        # the stored moments: bitwise (no power or root involved)
        jax.tree.map(np.testing.assert_array_equal, (adam.mu, adam.nu), (mu, nu))
        c1, c2 = f32(1) - f32(B1) ** f32(t), f32(1) - f32(B2) ** f32(t)
        want = jax.tree.map(lambda m, v, w, c1=c1, c2=c2: -f32(LR) * (
            (m / c1) / (np.sqrt(v / c2) + f32(EPS)) + f32(WD) * w), m32, v32, p)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-9),
                     updates, want)
        p = jax.tree.map(lambda w, u: w + np.asarray(u), p, updates)
    # and the bf16 moments differ from fp32 ones (the test can tell them apart)
    _, fp32 = _run(adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD), params, grads)
    assert not np.array_equal(np.asarray(fp32[-1][1][0].nu["w"]),
                              np.asarray(steps[-1][1][0].nu["w"]).astype(np.float32))


@pytest.mark.slow
def test_adamw_names_a_bad_moment_dtype():
    with pytest.raises(TypeError, match="nu_dtype"):
        adamw(1e-3, nu_dtype=jnp.int32)
    with pytest.raises(TypeError, match="mu_dtype"):
        adamw(1e-3, mu_dtype="not-a-dtype")
    with pytest.raises(TypeError, match="grad_reduce_dtype"):
        sp_jax.ParallelConfig(grad_reduce_dtype="not-a-dtype")
    with pytest.raises(ValueError, match="grad_reduce_dtype"):
        sp_jax.ParallelConfig(grad_reduce_dtype=jnp.int8)
    assert sp_jax.ParallelConfig(grad_reduce_dtype="bfloat16").grad_reduce_dtype == \
        jnp.bfloat16


# -- grad_reduce_dtype -----------------------------------------------------------------

CFG = GPTConfig(vocab_size=61, max_seq_len=16, num_layers=2, num_heads=4, hidden=16,
                mlp_hidden=32, scan_layers=True)
M, ROWS = 2, 8


def _capture() -> optax.GradientTransformation:
    """An 'optimizer' whose state is the last gradient (the step's, bitwise) and whose
    update is zero."""
    return optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p),
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    t = np.random.default_rng(seed).integers(0, CFG.vocab_size, (M, ROWS, CFG.max_seq_len + 1))
    return {"tokens": t[..., :-1].astype(np.int32), "labels": t[..., 1:].astype(np.int32)}


def _step_grads(mesh, parallel, batch):
    with jax.set_mesh(mesh):
        step = TrainStep(GPT(CFG, parallel=parallel, rngs=nnx.Rngs(0)), _capture())
        step(batch, jax.random.key(0))
        return jax.tree.map(np.asarray, nnx.to_pure_dict(step.opt_state)), step


def _reference(model, batch, data: int):
    """Each data shard's rows (contiguous blocks of the batch dimension) through an
    unsharded copy: fp32 gradient sums over the micro-batches, cast to bf16 and summed
    over the shards in bf16, back in fp32, normalised by the total target count."""
    with jax.set_mesh(make_mesh(1, 1)):
        ref = copy_weights(GPT(CFG, parallel=sp_jax.ParallelConfig(), rngs=nnx.Rngs(1)), model)
        graph, params, rest = nnx.split(ref, nnx.Param, ...)

        @jax.jit
        def grad_sum(params, micro):
            return jax.grad(lambda p: lm_loss(nnx.merge(graph, p, rest), micro,
                                              jax.random.key(0))[0])(params)

        rows = ROWS // data
        total = None
        for d in range(data):
            acc = None
            for m in range(M):
                micro = {k: v[m, d * rows:(d + 1) * rows] for k, v in batch.items()}
                g = jax.tree.map(np.asarray, nnx.to_pure_dict(grad_sum(params, micro)))
                acc = g if acc is None else jax.tree.map(np.add, acc, g)
            low = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), acc)
            total = low if total is None else jax.tree.map(
                lambda a, b: (a.astype(np.float32) + b.astype(np.float32)).astype(
                    ml_dtypes.bfloat16), total, low)  # one rounding: exact bf16 addition
    scale = np.float32(1.0) / np.float32(np.sum(batch["labels"] != -100))
    return jax.tree.map(lambda x: x.astype(np.float32) * scale, total)


def _all_reduces(lowered: str, groups: str = "", op_name: str = "all_reduce"
                 ) -> tuple[int, int]:
    """(non-scalar all-reduces (or ``op_name`` ops) carrying bf16, non-scalar ones
    carrying another dtype) in a lowered (StableHLO) module, those over ``groups`` (e.g.
    ``"[[0, 2], [1, 3]]"``) or all groups of more than one device: the collectives the
    program asks for. (XLA:CPU's compiled module sums a bf16 all-reduce in fp32 after
    rounding its input to bf16: the CPU has no bf16 all-reduce; GPUs keep it.)"""
    low = other = 0
    for op in lowered.split(f'"stablehlo.{op_name}"')[1:]:
        found = re.search(r"replica_groups = dense<([^>]*)>", op.split("\n", 1)[0]).group(1)
        if not found.startswith(groups) or re.fullmatch(r"\[(\[\d+\](, )?)*\]", found):
            continue  # another group, or one device per group (an axis of size 1)
        types = re.search(r"\}\) : \(([^)]*)\)", op).group(1)
        shapes = re.findall(r"tensor<([^>]*)>", types)
        shapes = [t for t in shapes if "x" in t]  # scalars: losses, counts
        if shapes:
            low += all(t.endswith("xbf16") for t in shapes)
            other += not all(t.endswith("xbf16") for t in shapes)
    return low, other


def test_grad_reduce_bf16_is_the_bf16_sum_of_per_shard_fp32_gradients():
    """data 2 x tensor 2: the step's gradients equal per-shard fp32 sums (an unsharded
    model on each shard's rows) rounded to bf16 and summed in bf16, to within one bf16
    rounding of a per-shard sum (its fp32 rounding differs with the tensor split) and
    exactly for nearly all elements; the fp32 reduction's gradients differ."""
    batch = _batch()
    parallel = sp_jax.ParallelConfig(grad_reduce_dtype=jnp.bfloat16)
    got, step = _step_grads(make_mesh(2, 2), parallel, batch)
    want = _reference(step.sync_model(), batch, data=2)
    fp32, _ = _step_grads(make_mesh(2, 2), sp_jax.ParallelConfig(), batch)
    exact = total = 0
    for g, w, f in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(fp32),
                       strict=True):
        np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=1e-8)
        np.testing.assert_allclose(g, f, rtol=0, atol=2 ** -7 * np.max(np.abs(f)))
        exact += int(np.sum(g == w))
        total += g.size
    assert exact >= 0.9 * total, f"{exact} of {total} exactly equal"
    assert any(not np.array_equal(g, f) for g, f in zip(jax.tree.leaves(got),
                                                        jax.tree.leaves(fp32), strict=True))


@pytest.mark.slow
def test_grad_reduce_bf16_all_reduces_bf16():
    """data 2 x tensor 2: the step's all-reduces over the data axis carry bf16, one per
    parameter's gradient (in the lowered module: GSPMD's fp32 reductions of the default
    step are not there); none over the data axis is in another dtype (those over the
    tensor axis are the layers' own, fp32)."""
    batch = _batch()
    with jax.set_mesh(make_mesh(2, 2)):
        step = TrainStep(GPT(CFG, parallel=sp_jax.ParallelConfig(
            grad_reduce_dtype=jnp.bfloat16), rngs=nnx.Rngs(0)), optax.adamw(1e-3))
        batch = step.place(batch)
        text = step._jitted(batch).lower(step.params, step.rest, step.opt_state, batch,
                                         jax.random.key(0)).as_text()
        low, other = _all_reduces(text, "[[0, 2], [1, 3]]")
        leaves = len(jax.tree.leaves(step.params))
    assert (low, other) == (leaves, 0)


@pytest.mark.slow
def test_grad_reduce_dtype_refuses_what_it_does_not_cover():
    with jax.set_mesh(make_mesh(2, 2)):
        model = GPT(CFG, parallel=sp_jax.ParallelConfig(
            fsdp=True, grad_reduce_dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="grad_reduce_dtype.*fsdp='full'"):
            TrainStep(model, optax.sgd(0.1))


@pytest.mark.slow
@pytest.mark.parametrize("schedule, fsdp", [("gpipe", False), ("1f1b", False),
                                            ("1f1b", True)])
def test_grad_reduce_bf16_in_a_pipeline(schedule, fsdp):
    """stage 2 x data 2: the pipeline's one reduction per step carries bf16 (its
    all-reduces over more than one device) and gives the per-shard fp32 sums summed in
    bf16: a stage's layers within one bf16 rounding of the reference and equal for
    nearly all elements; the parameters every stage holds (embedding, final norm), whose
    stage parts are summed in the same bf16 reduction, within a bf16 rounding of the
    leaf's largest value. With fsdp the stage weights' reduction is a bf16
    reduce-scatter."""
    batch = _batch(1)
    mesh = jax.make_mesh((2, 2, 1, 1), ("stage", "data", "context", "tensor"),
                         devices=jax.devices()[:4])
    parallel = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=M,
                                     pipeline_schedule=schedule, fsdp=fsdp,
                                     grad_reduce_dtype=jnp.bfloat16)
    got, step = _step_grads(mesh, parallel, batch)
    with jax.set_mesh(mesh):
        placed = step.place(batch)
        text = step._jitted(placed).lower(step.params, step.rest, step.opt_state, placed,
                                          jax.random.key(0)).as_text()
    low, other = _all_reduces(text)
    assert low >= 1 and other == 0, (low, other)
    if fsdp:  # the stage weights' gradients: reduce-scattered over data in bf16
        low, other = _all_reduces(text, op_name="reduce_scatter")
        assert low >= 1 and other == 0, (low, other)
    want = _reference(step.sync_model(), batch, data=2)
    exact = total = 0
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree.leaves(want), strict=True):
        if "blocks" in jax.tree_util.keystr(path):  # one stage's: as unpipelined
            np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=1e-8, err_msg=str(path))
            exact += int(np.sum(g == w))
            total += g.size
        else:  # each stage's part rounded to bf16 (the reference rounds their sum)
            np.testing.assert_allclose(g, w, rtol=0, atol=2 ** -7 * np.max(np.abs(w)),
                                       err_msg=str(path))
    assert exact >= 0.9 * total, f"{exact} of {total} exactly equal"
