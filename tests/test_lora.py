"""LoRA (``sp_jax.LoRAConfig``): adapters inside the linear ops, exact against the
unsharded adapted model and against the base model with the adapters merged into its
kernels (an independent computation: plain GEMMs of ``W + scale * A @ B``); ``lora_b =
0`` leaves the base bitwise; the training step differentiates and holds the adapters
only, and its compiled program has no weight-gradient GEMM of a frozen kernel."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import compiled_logits, perturb_adapters, to_host
from flax import nnx
from jax.sharding import AxisType

import sp_jax
from sp_jax.layers.lora import LoRAParam
from sp_jax.models import GPT, GPTConfig
from sp_jax.models import lora as model_lora
from sp_jax.training import TrainStep

pytestmark = pytest.mark.slow

V, S, B = 64, 16, 4


def _mesh(data=1, tensor=1, context=1):
    return jax.make_mesh((data, context, tensor), ("data", "context", "tensor"),
                         axis_types=(AxisType.Explicit,) * 3,
                         devices=jax.devices()[:data * context * tensor])


def _config(kv_heads=2, **kw) -> GPTConfig:
    return GPTConfig.llama("llama-tiny", vocab_size=V, hidden=32, num_layers=2, num_heads=4,
                           num_kv_heads=kv_heads, mlp_hidden=64, max_seq_len=S, **kw)


LORA = sp_jax.LoRAConfig(rank=4, alpha=8)
TOKENS = np.random.default_rng(0).integers(0, V, (B, S))


def _loss_and_adapter_grads(model):
    f = nnx.jit(nnx.value_and_grad(lambda m, t: m.loss(t, t),
                                   argnums=nnx.DiffState(0, LoRAParam)))
    loss, g = f(model, jnp.asarray(TOKENS))
    return float(loss), to_host(nnx.to_pure_dict(g))


def _run(cfg, mesh, parallel=sp_jax.ParallelConfig()):
    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))
        perturb_adapters(model)
        return _loss_and_adapter_grads(model)


@pytest.fixture(scope="module")
def references():
    return {kv: _run(_config(kv, lora=LORA), _mesh()) for kv in (2, 4)}


CASES = {
    "data_tensor_gqa": (2, dict(data=2, tensor=4), {}),
    "data_tensor_mha": (4, dict(data=2, tensor=4), {}),
    "collective_matmul_recompute": (2, dict(data=2, tensor=2),
                                    dict(collective_matmul=True, recompute_allgather=True)),
    "fsdp": (2, dict(data=2, tensor=2), dict(fsdp=True)),
    "context_ring": (2, dict(data=2, context=2, tensor=2), dict(context_parallel="ring")),
    "kv_replicated_t4": (1, dict(data=2, tensor=4), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_lora_matches_unsharded(case, references):
    kv, shape, parallel = CASES[case]
    ref = references[kv] if kv in references else _run(_config(kv, lora=LORA), _mesh())
    loss, grads = _run(_config(kv, lora=LORA), _mesh(**shape),
                       sp_jax.ParallelConfig(**parallel))
    assert loss == pytest.approx(ref[0], rel=1e-6)
    chex.assert_trees_all_close(grads, ref[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv", [2, 4])
def test_adapted_model_equals_its_merged_base(kv):
    """The adapters in the ops compute what plain GEMMs of the merged kernels ``W +
    scale * A @ B`` compute (each adapter on its part's columns)."""
    with jax.set_mesh(_mesh(2, 4)):
        model = GPT(_config(kv, lora=LORA), rngs=nnx.Rngs(0))
        perturb_adapters(model)
        merged = model_lora.merge(model)
        assert not nnx.to_flat_state(nnx.state(merged, LoRAParam))
        tokens = jnp.asarray(TOKENS)
        np.testing.assert_allclose(np.asarray(compiled_logits(model, tokens)),
                                   np.asarray(compiled_logits(merged, tokens)), rtol=2e-5,
                                   atol=2e-5)


def test_zero_lora_b_is_the_base_bitwise_and_disabled_restores():
    with jax.set_mesh(_mesh(2, 4)):
        base = GPT(_config(2), rngs=nnx.Rngs(0))
        adapted = model_lora.apply(base, LORA)
        tokens = jnp.asarray(TOKENS)
        want = np.asarray(compiled_logits(base, tokens))
        np.testing.assert_array_equal(np.asarray(compiled_logits(adapted, tokens)), want)
        # the same base draws with adapters built in from the start
        built = GPT(_config(2, lora=LORA), rngs=nnx.Rngs(0))
        np.testing.assert_array_equal(np.asarray(compiled_logits(built, tokens)), want)
        perturb_adapters(adapted)
        changed = np.asarray(compiled_logits(adapted, tokens))
        assert np.abs(changed - want).max() > 1e-4
        with model_lora.disabled(adapted):
            np.testing.assert_array_equal(np.asarray(compiled_logits(adapted, tokens)), want)
        np.testing.assert_array_equal(np.asarray(compiled_logits(adapted, tokens)), changed)


def test_generation_with_adapters_equals_the_merged_model():
    """Decoding runs the adapters in its single-token ops: the same greedy tokens as the
    model with them merged into its kernels."""
    from sp_jax.models import generate

    with jax.set_mesh(_mesh(2, 4)):
        for kv in (2, 4):
            model = GPT(_config(kv, lora=LORA), rngs=nnx.Rngs(0))
            perturb_adapters(model, scale=0.3)
            prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
            got = generate(model, prompts, max_new_tokens=6).tokens
            want = generate(model_lora.merge(model), prompts, max_new_tokens=6).tokens
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _dots(hlo: str) -> list[tuple[int, ...]]:
    """The output shapes of the dot instructions of an optimized HLO module."""
    shapes = []
    for m in re.finditer(r"= f32\[([0-9,]*)\][^=]*? dot\(", hlo):
        shapes.append(tuple(int(d) for d in m.group(1).split(",") if d))
    return shapes


def _step_hlo(cfg):
    """The compiled step's HLO text, and the local shapes of the model's 2-D kernels; 3
    rows of 16 tokens per device (48 tokens: no activation has a kernel's shape)."""
    tokens = np.random.default_rng(1).integers(0, V, (1, 6, S))
    with jax.set_mesh(_mesh(2, 4)):
        model = GPT(cfg, rngs=nnx.Rngs(0))
        step = TrainStep(model, optax.adamw(1e-2))
        batch = step.place({"tokens": tokens, "labels": tokens})
        compiled = step._jitted(batch).lower(step.params, step.rest, step.opt_state, batch,
                                             jax.random.key(0)).compile()
        kernels = {tuple(v[...].addressable_shards[0].data.shape)
                   for _, v in nnx.iter_graph(model)
                   if isinstance(v, nnx.Param) and not isinstance(v, LoRAParam)
                   and v[...].ndim == 2}
        return step, compiled.as_text(), kernels


def test_train_step_holds_and_differentiates_the_adapters_only():
    # rank 3: no adapter gradient has a kernel's shape either
    step, hlo, kernels = _step_hlo(_config(2, lora=sp_jax.LoRAConfig(rank=3)))
    params = nnx.to_pure_dict(step.params)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    assert leaves and all("lora" in jax.tree_util.keystr(p) for p, _ in leaves)
    assert jax.tree.structure(nnx.to_pure_dict(step.opt_state[0].mu)) == \
        jax.tree.structure(params)
    frozen = [s for s in _dots(hlo) if s in kernels]
    assert not frozen, f"weight-gradient GEMMs of frozen kernels: {frozen}"
    # the same check finds them in the full fine-tune's step (it can fail)
    _, full, kernels = _step_hlo(_config(2))
    assert [s for s in _dots(full) if s in kernels]


def test_masked_adapter_entries_stay_zero_and_the_base_stays_frozen():
    with jax.set_mesh(_mesh(2, 2)):
        model = GPT(_config(2, lora=LORA), rngs=nnx.Rngs(0))
        base = to_host(nnx.to_pure_dict(nnx.state(model, nnx.All(nnx.Param,
                                                                  nnx.Not(LoRAParam)))))
        step = TrainStep(model, optax.adamw(3e-2, weight_decay=0.1))
        losses = []
        for i in range(4):
            batch = {"tokens": TOKENS[None], "labels": TOKENS[None]}
            losses.append(float(step(batch, jax.random.key(i))["loss"]))
        assert losses[-1] < losses[0]
        step.sync_model() if hasattr(step, "sync_model") else nnx.update(
            model, step.params)
        up = model.blocks[0].mlp.up
        b = np.asarray(up.lora_b[...])
        assert np.abs(b).max() > 0  # it trained
        mask = sp_jax.layers.lora.lora_mask(up.lora_parts, LORA, b.shape[1])
        np.testing.assert_array_equal(b[mask == 0], 0.0)
        qkv = model.blocks[0].attention.qkv
        kv_b = np.asarray(qkv.kv_lora_b[...])
        assert np.abs(kv_b[:LORA.rank]).max() == 0.0  # q's adapter never writes k/v
        chex.assert_trees_all_equal(
            to_host(nnx.to_pure_dict(nnx.state(model, nnx.All(nnx.Param,
                                                              nnx.Not(LoRAParam))))), base)


def test_lora_config_errors():
    with pytest.raises(ValueError, match="rank"):
        sp_jax.LoRAConfig(rank=0)
    with pytest.raises(ValueError, match="targets"):
        sp_jax.LoRAConfig(rank=4, targets=("qkv",))
    with pytest.raises(ValueError, match="dropout"):
        sp_jax.LoRAConfig(rank=4, dropout=0.1)
    with pytest.raises(ValueError, match="base_dtype"):
        sp_jax.LoRAConfig(rank=4, base_dtype="int4")
    assert sp_jax.LoRAConfig(rank=4, targets=("v", "q")).targets == ("q", "v")
    with pytest.raises(ValueError, match="fp8"):
        _config(2, lora=LORA, fp8=sp_jax.Fp8Recipe())
    cfg = _config(2, lora=LORA)
    assert GPTConfig.from_dict(__import__("dataclasses").asdict(cfg)).lora == LORA
