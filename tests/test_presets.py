"""The fine-grained mixture-of-experts presets (``GPTConfig.qwen3_moe``,
``GPTConfig.deepseek_v3_moe``): each builds with the parameter count a NumPy formula gives
from its config numbers (Qwen3-30B-A3B's published 30.5B total, 29.9B non-embedding and
3.3B active), reads and writes as the Hugging Face family it names, is the memory
planner's preset of the same name, and the test-size ones run forward sharded over an
expert axis as unsharded."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import copy_weights, param_values
from flax import nnx
from jax.sharding import AxisType

import sp_jax
from sp_jax.analysis.plan import MODELS
from sp_jax.models import GPT, GPTConfig, hf

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
PRESETS = {
    "qwen3-30b-a3b": lambda: GPTConfig.qwen3_moe("qwen3-30b-a3b"),
    "qwen3-moe-tiny": lambda: GPTConfig.qwen3_moe("qwen3-moe-tiny"),
    "deepseek-v3": lambda: GPTConfig.deepseek_v3_moe("deepseek-v3"),
    "deepseek-v3-tiny": lambda: GPTConfig.deepseek_v3_moe("deepseek-v3-tiny"),
}


def _counts(c: GPTConfig) -> tuple[int, int]:
    """(total, active per token) parameters from the config's numbers (NumPy int64): per
    layer q / k / v / out kernels, q/k norms, the router, the routed and shared SwiGLU
    experts, two norms and a sigmoid router's selection bias (``E``, not a matmul); the
    embedding, the untied head and the final norm."""
    i = np.int64
    h, d, layers = i(c.hidden), i(c.head_dim or c.hidden // c.num_heads), i(c.num_layers)
    attention = h * d * (2 * c.num_heads + 2 * c.num_kv_heads) + 2 * d * c.qk_norm
    expert = 3 * h * c.moe_mlp_hidden
    rest = attention + h * c.num_experts + 2 * h
    outside = i(c.vocab_size) * h * (1 if c.tie_embeddings else 2) + h
    total = layers * (rest + expert * (c.num_experts + c.num_shared_experts)) + outside + \
        layers * c.num_experts * (c.moe_scoring == "sigmoid")
    active = layers * (rest + expert * (c.experts_per_token + c.num_shared_experts)) + outside
    return int(total), int(active)


def _built(cfg: GPTConfig, layers: int) -> int:
    cfg = dataclasses.replace(cfg, num_layers=layers)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_presets_count_their_parameters_and_read_as_their_family():
    """Each preset built at 1 and 2 layers, extrapolated (every layer alike), has the
    formula's count, and ``flops_per_token`` counts the active matmul parameters; the
    planner's preset of the same name has that count and the model's shape; Qwen3-MoE
    writes and reads back as ``qwen3_moe`` and the golden fixture's config.json reads as
    the tiny preset with its sizes."""
    for name, make in PRESETS.items():
        cfg = make()
        assert cfg.num_moe_layers == cfg.num_layers, name  # every layer a mixture
        total, active = _counts(cfg)
        one, two = _built(cfg, 1), _built(cfg, 2)
        assert one + (cfg.num_layers - 1) * (two - one) == total, name
        d = cfg.head_dim
        matmul = active - cfg.vocab_size * cfg.hidden - cfg.hidden - cfg.num_layers * (
            2 * cfg.hidden + 2 * d * cfg.qk_norm)  # no table lookup, no norms
        assert cfg.flops_per_token(4096) == 6 * matmul + 12 * cfg.num_layers * \
            cfg.num_heads * d * 4096, name
        # the planner's deepseek-v3 is the real architecture (MLA, dense first layers),
        # the MoE preset of that name its multi-head-attention stand-in
        if name in MODELS and not MODELS[name].kv_lora_rank:
            shape = MODELS[name]
            assert shape.params == total, name
            fields = ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "hidden",
                      "head_dim", "num_experts", "experts_per_token", "moe_mlp_hidden",
                      "num_shared_experts", "qk_norm", "tie_embeddings", "mlp_activation")
            planned = shape.gpt_config()
            assert [getattr(planned, f) for f in fields] == \
                [getattr(cfg, f) for f in fields], name
    # Qwen/Qwen3-30B-A3B's model card: 30.5B parameters, 29.9B without the embedding
    # and head, 3.3B activated
    total, active = _counts(PRESETS["qwen3-30b-a3b"]())
    assert round(total / 1e8) == 305 and 3.3e9 <= active < 3.4e9
    assert round((total - 2 * 151936 * 2048) / 1e8) == 299
    qwen = PRESETS["qwen3-30b-a3b"]()
    written = hf.config_to_hf(qwen)
    assert (written["model_type"], written["head_dim"], written["num_experts"],
            written["moe_intermediate_size"]) == ("qwen3_moe", 128, 128, 768)
    assert hf.config_from_hf(written) == qwen
    fixture = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    assert hf.config_from_hf(fixture) == GPTConfig.qwen3_moe(  # its head_dim: 32 / 8
        "qwen3-moe-tiny", vocab_size=96, max_seq_len=64, hidden=32, head_dim=None,
        mlp_hidden=48, num_experts=4, experts_per_token=2, moe_mlp_hidden=16,
        rope_base=1e4, tie_embeddings=True, router_aux_loss_coef=0.01, eos_token_id=95,
        pad_token_id=93, param_dtype=jnp.float32)


@pytest.mark.slow  # make test-fast's budget: the other tests of the file stay fast
def test_tiny_presets_run_forward_sharded_as_unsharded():
    """``qwen3-moe-tiny`` (16 experts, 4 per token) and ``deepseek-v3-tiny`` (32 experts,
    8 per token, one shared) on 8 CPU devices, experts over 4 (4 and 8 local experts
    each) x tensor 2: the logits of the unsharded model with the same weights (fp32,
    1e-5)."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 32)), jnp.int32)
    axes = ("data", "expert", "context", "tensor")

    def forward(cfg, shape, parallel, weights=None):
        mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * 4,
                             devices=jax.devices()[:int(np.prod(shape))])
        with jax.set_mesh(mesh):
            model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(1))
            if weights is not None:  # another seed: every weight is copied
                copy_weights(model, weights)
            return param_values(model), np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))

    for name in ("qwen3-moe-tiny", "deepseek-v3-tiny"):
        cfg = PRESETS[name]()
        weights, sharded = forward(cfg, (1, 4, 1, 2), sp_jax.ParallelConfig(expert_axis="expert"))
        _, plain = forward(cfg, (1, 1, 1, 1), sp_jax.ParallelConfig(), weights)
        assert sharded.shape == (4, 32, 256), name
        np.testing.assert_allclose(sharded, plain, rtol=1e-5, atol=1e-5, err_msg=name)
        assert np.isfinite(sharded).all() and sharded.std() > 0, name
