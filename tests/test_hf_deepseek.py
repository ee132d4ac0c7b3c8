"""DeepSeek-V3 (``deepseek_v3``: multi-head latent attention with and without
``q_lora_rank``, ``rope_interleave``, YaRN, sigmoid group-limited routing with
``e_score_correction_bias``, a dense first layer, a shared expert) and GLM-4.5
(``glm4_moe``: grouped-query attention with partial rotary, q/k/v biases and q/k norms,
the same routing) checkpoints: transformers' logits (fp32, 1e-5 of the largest logit),
loss and gradients (tests/fixtures/hf/{deepseek_v3,deepseek_v3_direct,glm4_moe}, made by
scripts/make_deepseek_fixtures.py) on one device, on (data, expert, context, tensor)
meshes with expert parallelism and on (data, context, tensor) meshes with ring and
Ulysses attention; its greedy generations (teacher-forced, and with sp_jax's
``generate``: the latent cache); HF -> sp_jax -> HF bit for bit; the MTP layer
(tests/fixtures/hf/{deepseek_v3_mtp,glm4_moe_mtp}: transformers' MtpModel's logits);
YaRN's frequencies and attention factor as transformers computes them; config
translation and the presets. No torch, no network."""

import dataclasses
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from _util import (
    assert_bitwise,
    compiled_logits,
    compiled_loss,
    param_values,
    slow_except,
    to_host,
)
from conftest import make_mesh
from flax import nnx
from jax.sharding import AxisType
from safetensors.numpy import load_file, save_file

from sp_jax import ParallelConfig
from sp_jax.layers import YarnScaling, rope_attention_factor, rope_frequencies
from sp_jax.models import GPT, GPTConfig, generate, hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
NAMES = ["deepseek_v3", "deepseek_v3_direct", "glm4_moe"]
EXPERTS = ParallelConfig(expert_axis="expert")


def _mesh(shape, names) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[:int(np.prod(shape))])


@nnx.jit
def _logits_loss_grads(model, tokens):
    logits = model(tokens)
    loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens))(model)
    return logits, loss, grads


def _generations(golden) -> tuple[np.ndarray, list[int]]:
    """transformers' greedy generations as one batch ``[4, 48]`` (prompt + 32 new tokens,
    zeros after; the fourth row repeats the first) and the prompt lengths."""
    rows, lengths = [], []
    for i in range(3):
        rows.append(np.concatenate([golden[f"gen_prompt_{i}"], golden[f"gen_tokens_{i}"]]))
        lengths.append(len(golden[f"gen_prompt_{i}"]))
    batch = np.zeros((4, 48), np.int32)
    for r, row in enumerate([*rows, rows[0]]):
        batch[r, :len(row)] = row
    return batch, lengths


def _assert_golden(name, mesh, parallel=ParallelConfig(), generations=True, **overrides):
    """Fixture ``name`` on ``mesh``: transformers' logits (1e-5 of the largest), loss,
    gradients (in transformers' names) and, with ``generations``, the logits along its
    greedy generations (each first new token's, and every new token the argmax)."""
    golden = np.load(FIXTURES / name / "golden.npz")
    gen_batch, lengths = _generations(golden)
    with jax.set_mesh(mesh):
        model = hf.from_hf(FIXTURES / name, parallel=parallel, **overrides)
        model.eval()
        logits, loss, grads = _logits_loss_grads(model, golden["input_ids"])
        gen_logits = to_host(compiled_logits(model, gen_batch)) \
            if generations else None
    msg = f"{name} {dict(mesh.shape)} {parallel.context_parallel}"
    scale = np.abs(golden["logits"]).max()
    np.testing.assert_allclose(to_host(logits), golden["logits"], rtol=0, atol=1e-5 * scale,
                               err_msg=msg)
    np.testing.assert_allclose(float(loss), float(golden["loss"]), rtol=1e-6, err_msg=msg)
    flat = {"/".join(map(str, k)): to_host(v[...]) for k, v in nnx.to_flat_state(grads)}
    named = hf.io._convert_to_hf(model.config, flat)
    for key in golden.files:
        if key.startswith("grad/"):
            np.testing.assert_allclose(named[key[5:]], golden[key], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{msg} {key}")
    for i, n in enumerate(lengths if generations else ()):
        np.testing.assert_allclose(gen_logits[i, n - 1], golden[f"gen_next_logits_{i}"],
                                   rtol=0, atol=1e-5 * scale, err_msg=f"{msg} {i}")
        np.testing.assert_array_equal(gen_logits[i, n - 1:n + 31].argmax(-1),
                                      golden[f"gen_tokens_{i}"], err_msg=f"{msg} {i}")
    return model


@pytest.mark.parametrize("name", slow_except(NAMES, "deepseek_v3"))
def test_golden_on_one_device_and_round_trip_bitwise(name, tmp_path):
    """One device: transformers' logits, loss, gradients and greedy generations; to_hf
    writes the checkpoint back bit for bit (rope_interleave's permutation undone, the
    routers' e_score_correction_bias kept) with a config that reads back the same, and
    -> sp_jax again (scanned layers: the dense layer a stack of its own) the same
    parameters."""
    model = _assert_golden(name, make_mesh(1, 1))
    with jax.set_mesh(make_mesh(1, 1)):
        hf.to_hf(model, tmp_path)
    original, written = (load_file(d / "model.safetensors") for d in (FIXTURES / name, tmp_path))
    assert sorted(written) == sorted(original)
    for key in original:
        assert written[key].dtype == original[key].dtype
        np.testing.assert_array_equal(written[key], original[key], err_msg=key)
    config = json.loads((tmp_path / "config.json").read_text())
    source = json.loads((FIXTURES / name / "config.json").read_text())
    assert config["model_type"] == source["model_type"]
    assert hf.config_from_hf(config) == hf.config_from_hf(source) == model.config
    with jax.set_mesh(make_mesh(2, 2)):
        again = hf.from_hf(tmp_path, scan_layers=True)
        hf.to_hf(again, tmp_path / "scanned")
    assert load_file(tmp_path / "scanned" / "model.safetensors").keys() == written.keys()
    with jax.set_mesh(make_mesh(1, 1)):
        unscanned = hf.from_hf(tmp_path / "scanned")
    assert_bitwise(param_values(model), param_values(unscanned))


MESHES = [  # (name, mesh shape, axes, parallel)
    ("deepseek_v3", (1, 4, 1, 2), ("data", "expert", "context", "tensor"), EXPERTS),
    ("deepseek_v3_direct", (2, 2, 1, 2), ("data", "expert", "context", "tensor"), EXPERTS),
    ("glm4_moe", (2, 2, 1, 2), ("data", "expert", "context", "tensor"), EXPERTS),
    ("deepseek_v3", (2, 2, 2), ("data", "context", "tensor"),
     ParallelConfig(context_parallel="ring")),
    ("deepseek_v3_direct", (1, 2, 2), ("data", "context", "tensor"),
     ParallelConfig(context_parallel="ulysses")),
    ("glm4_moe", (2, 2, 2), ("data", "context", "tensor"),
     ParallelConfig(context_parallel="ring")),
    ("glm4_moe", (1, 2, 2), ("data", "context", "tensor"),
     ParallelConfig(context_parallel="ulysses")),
    ("deepseek_v3", (2, 2, 2), ("data", "context", "tensor"),
     ParallelConfig(context_parallel="ulysses")),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,shape,axes,parallel", MESHES,
                         ids=[f"{m[0]}-{'x'.join(map(str, m[1]))}-{m[3].context_parallel}"
                              for m in MESHES])
def test_golden_on_expert_and_context_meshes(name, shape, axes, parallel):
    """(data, expert, context, tensor) meshes with expert parallelism, and (data,
    context, tensor) meshes with ring attention (MLA: the latent travels) and Ulysses:
    transformers' logits, loss and gradients (the generations' logits on the expert
    meshes)."""
    _assert_golden(name, _mesh(shape, axes), parallel, generations="expert" in axes)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_transformers(name):
    """sp_jax's generate (MLA: the latent cache, absorbed decoding; GLM: the key/value
    cache with partial rotary) on a (data, tensor) mesh: transformers' 32 greedy tokens
    for each of its three prompts."""
    golden = np.load(FIXTURES / name / "golden.npz")
    prompts = [golden[f"gen_prompt_{i}"].tolist() for i in range(3)]
    with jax.set_mesh(make_mesh(2, 2)):
        model = hf.from_hf(FIXTURES / name)
        tokens = generate(model, prompts, max_new_tokens=32).tokens
    for i in range(3):
        np.testing.assert_array_equal(tokens[i], golden[f"gen_tokens_{i}"], err_msg=str(i))


def _mtp_logits(model, tokens):
    """sp_jax's depth-1 MTP logits ``[B, S - 1, V]``: module 0 on the main model's
    final-normed hidden states ``0 .. S-2`` and the embeddings of tokens ``1 .. S-1``."""
    module = model.mtp[0]
    h = model.hidden_states(tokens)
    x = module.project(model.embed(tokens[:, 1:]), h[:, :-1])
    return model.logits_from_hidden(module.post_norm(module.block(x)))


@pytest.mark.slow  # 60-110 s on 2 shared cores: the slow tier
@pytest.mark.parametrize("fixture", ["deepseek_v3_mtp", "glm4_moe_mtp"])
def test_mtp_layer_equals_transformers(tmp_path, fixture):
    """A DeepSeek-V3 or GLM-4.5 checkpoint with one MTP layer (``model.layers.3.*``,
    transformers 5.x's ``MtpModel`` stored as their checkpoints hold it) reads with
    ``mtp_depth=1`` by
    default: the MTP logits equal transformers' (1e-5 of the largest) and the MTP loss
    its cross-entropy; the main logits equal transformers'; to_hf writes the checkpoint
    back bit for bit (the embedding and head copies included); ``mtp_depth=0`` skips
    the MTP layer and leaves the main model's parameters and logits as they are."""
    source = FIXTURES / fixture
    golden = np.load(source / "golden.npz")
    tokens = golden["input_ids"]
    with jax.set_mesh(make_mesh(1, 1)):
        model = hf.from_hf(source)
        assert model.config.mtp_depth == 1
        logits = np.asarray(compiled_logits(model, tokens))
        mtp_logits = np.asarray(nnx.jit(_mtp_logits)(model, tokens))
        _, metrics = compiled_loss(model, tokens)
        hf.to_hf(model, tmp_path / "out")
        plain = hf.from_hf(source, mtp_depth=0)
        plain_logits = np.asarray(compiled_logits(plain, tokens))
    scale = np.abs(golden["logits"]).max()
    np.testing.assert_allclose(logits, golden["logits"], rtol=0, atol=1e-5 * scale)
    scale = np.abs(golden["mtp_logits"]).max()
    np.testing.assert_allclose(mtp_logits, golden["mtp_logits"], rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(float(metrics["mtp_loss"]), golden["mtp_loss"], rtol=1e-5)
    original = load_file(source / "model.safetensors")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(written) == sorted(original)
    for key in original:
        np.testing.assert_array_equal(written[key], original[key], err_msg=key)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert plain.mtp is None and plain.config.mtp_depth == 0
    values = param_values(model)
    del values["mtp"]
    assert_bitwise(values, param_values(plain))
    np.testing.assert_array_equal(plain_logits, logits)


@pytest.mark.slow
def test_mtp_copies_are_checked(tmp_path):
    """An MTP layer's ``embed_tokens`` that is no copy of the main one is refused,
    naming it; a checkpoint whose MTP layer holds no copies reads as the one with them;
    a model without MTP modules writes ``num_nextn_predict_layers`` 0."""
    source = FIXTURES / "deepseek_v3_mtp"
    tensors = load_file(source / "model.safetensors")
    shutil.copy(source / "config.json", tmp_path / "config.json")
    bad = dict(tensors)
    bad["model.layers.3.embed_tokens.weight"] = bad["model.layers.3.embed_tokens.weight"] + 1
    save_file(bad, tmp_path / "model.safetensors")
    with jax.set_mesh(make_mesh(1, 1)):
        with pytest.raises(ValueError, match="model.layers.3.embed_tokens.weight differs"):
            hf.from_hf(tmp_path)
        save_file({k: v for k, v in tensors.items() if not k.startswith(
            ("model.layers.3.embed_tokens", "model.layers.3.shared_head.head"))},
            tmp_path / "model.safetensors")
        assert_bitwise(param_values(hf.from_hf(tmp_path)), param_values(hf.from_hf(source)))
        hf.to_hf(hf.from_hf(source, mtp_depth=0), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 0
    assert not any(k.startswith("model.layers.3.")
                   for k in load_file(tmp_path / "out" / "model.safetensors"))


def test_yarn_frequencies_and_attention_factor_equal_transformers():
    """YarnScaling: transformers' _compute_yarn_parameters (recorded) for DeepSeek-V3's
    settings and small ones (bit for bit; an attention factor other than 1, truncate
    off) and Kimi K2's (one entry one unit in the last place apart: torch's float32
    pow, rope_frequencies' docstring)."""
    rows = json.loads((FIXTURES / "yarn.json").read_text())
    for row in rows:
        rope = dict(row["rope"])
        base = rope.pop("rope_theta")
        rope.pop("rope_type")
        scaling = YarnScaling(**rope)
        got = rope_frequencies(row["head_dim"], base, scaling)
        want = np.asarray(row["inv_freq"], np.float32)
        if base == 50000.0:  # Kimi K2's
            np.testing.assert_allclose(got, want, rtol=1.2e-7, atol=0)
        else:
            np.testing.assert_array_equal(got, want)
        assert rope_attention_factor(scaling) == pytest.approx(row["attention_factor"],
                                                               rel=1e-15)
    assert {rope_attention_factor(YarnScaling(**{k: v for k, v in r["rope"].items()
                                                 if k not in ("rope_theta", "rope_type")}))
            for r in rows} != {1.0}  # a factor other than 1 is tested


def test_config_translation_and_refusals():  # no compile: 0.01 s
    """The fixtures' configs read as the fields they say (YaRN, DeepSeek's softmax
    scale, routing, dense layers, partial rotary); what sp_jax cannot reproduce is
    named."""
    ds = hf.config_from_hf(json.loads((FIXTURES / "deepseek_v3" / "config.json").read_text()))
    assert (ds.attention, ds.q_lora_rank, ds.kv_lora_rank, ds.rope_interleave) == \
        ("mla", 12, 16, True)
    assert ds.rope_scaling == YarnScaling(factor=4.0, original_max_position_embeddings=16,
                                          mscale=1.0, mscale_all_dim=0.5)
    m = 0.1 * 0.5 * np.log(4.0) + 1
    assert ds.attention_scale == pytest.approx(12 ** -0.5 * m * m, rel=1e-12)
    assert (ds.moe_scoring, ds.moe_groups, ds.moe_topk_groups, ds.moe_routed_scale,
            ds.num_dense_layers, ds.num_shared_experts, ds.num_experts) == \
        ("sigmoid", 2, 1, 2.5, 1, 1, 8)
    glm_json = json.loads((FIXTURES / "glm4_moe" / "config.json").read_text())
    glm = hf.config_from_hf(glm_json)
    assert (glm.partial_rotary_factor, glm.qk_norm, glm.qkv_bias, glm.out_bias,
            glm.num_kv_heads, glm.head_dim) == (0.5, True, True, False, 4, 8)
    rope = {k: v for k, v in glm_json["rope_parameters"].items()
            if k != "partial_rotary_factor"}
    assert hf.config_from_hf({**glm_json, "rope_parameters": rope}).partial_rotary_factor \
        == 0.5  # transformers' default
    source = json.loads((FIXTURES / "deepseek_v3" / "config.json").read_text())
    for change, match in [({"attention_bias": True}, "attention_bias=True"),
                          ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
                          ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
                          ({"kv_lora_rank": None}, "'kv_lora_rank' is missing"),
                          ({"rope_parameters": {"rope_type": "longrope"}}, "'longrope'")]:
        with pytest.raises(ValueError, match=match):
            hf.config_from_hf({**source, **change})
    # the MHA stand-in preset is no DeepSeek-V3 checkpoint
    with pytest.raises(ValueError, match="cannot express"):
        hf.config_to_hf(GPTConfig.deepseek_v3_moe("deepseek-v3-tiny"), "deepseek_v3")


@pytest.mark.slow
def test_checkpoint_copies_load(tmp_path):
    """A copied checkpoint directory with transformers 5.x's fused experts
    (``mlp.experts.gate_up_proj`` [E, 2F, h], ``down_proj`` [E, h, F], as its
    ``state_dict()`` gives them) reads as the per-expert one."""
    source = FIXTURES / "glm4_moe"
    tensors = load_file(source / "model.safetensors")
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts."
        fused[p + "gate_up_proj"] = np.stack([np.concatenate(
            [tensors[f"{p}{e}.gate_proj.weight"], tensors[f"{p}{e}.up_proj.weight"]])
            for e in range(8)])
        fused[p + "down_proj"] = np.stack([tensors[f"{p}{e}.down_proj.weight"]
                                           for e in range(8)])
    save_file(fused, tmp_path / "model.safetensors")
    shutil.copy(source / "config.json", tmp_path / "config.json")
    with jax.set_mesh(make_mesh(1, 1)):
        assert_bitwise(param_values(hf.from_hf(tmp_path)), param_values(hf.from_hf(source)))


# The published config.json entries the presets come from (deepseek-ai/DeepSeek-V3,
# moonshotai/Kimi-K2-Instruct: transformers 4.x spelling; zai-org/GLM-4.5-Air).
_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
           intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
           num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
           n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
           q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
           topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8,
           moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True,
           scoring_func="sigmoid", hidden_act="silu", max_position_embeddings=163840,
           rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False, bos_token_id=0,
           eos_token_id=1, num_nextn_predict_layers=1, attention_bias=False,
           torch_dtype="bfloat16",
           rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0,
                             mscale_all_dim=1.0, original_max_position_embeddings=4096,
                             type="yarn"))
_KIMI = dict(_V3, vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
             n_routed_experts=384, routed_scaling_factor=2.827, n_group=1, topk_group=1,
             first_k_dense_replace=1, max_position_embeddings=131072, rope_theta=50000.0,
             bos_token_id=163584, eos_token_id=163585, num_nextn_predict_layers=0,
             rope_scaling=dict(beta_fast=1.0, beta_slow=1.0, factor=32.0, mscale=1.0,
                               mscale_all_dim=1.0, original_max_position_embeddings=4096,
                               type="yarn"))
_AIR = dict(model_type="glm4_moe", vocab_size=151552, hidden_size=4096,
            intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
            num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_shared_experts=1,
            n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1,
            num_experts_per_tok=8, first_k_dense_replace=1, norm_topk_prob=True,
            partial_rotary_factor=0.5, rope_theta=1000000, max_position_embeddings=131072,
            rms_norm_eps=1e-5, attention_bias=True, use_qk_norm=False, hidden_act="silu",
            tie_word_embeddings=False, eos_token_id=[151329, 151336, 151338],
            pad_token_id=151329, num_nextn_predict_layers=1, torch_dtype="bfloat16")


@pytest.mark.parametrize("preset,config,billions", [
    pytest.param(lambda: GPTConfig.deepseek_v3("deepseek-v3"), _V3, 671.03,
                 marks=pytest.mark.slow),  # make test-fast's budget (24 s on 2 cores)
    pytest.param(lambda: GPTConfig.deepseek_v3("kimi-k2"), _KIMI, 1026.41,
                 marks=pytest.mark.slow),
    pytest.param(lambda: GPTConfig.glm4_moe("glm-4.5-air"), _AIR, 106.85,
                 marks=pytest.mark.slow),
], ids=["deepseek-v3", "kimi-k2", "glm-4.5-air"])
def test_presets_are_the_published_configs(preset, config, billions):
    """Each preset is its published config.json read by from_hf's translation (the
    training-only fields apart: the reader freezes the selection bias), writes back as
    its family, and has the published size without the MTP layer (DeepSeek-V3: 671B;
    Kimi K2: 1.03T; GLM-4.5-Air: 106B + the MTP layer's ~1.3B)."""
    cfg = preset()
    read = hf.config_from_hf(config, param_dtype=np.float32)
    assert read.mtp_depth == config["num_nextn_predict_layers"]  # the MTP layers, read
    assert read == dataclasses.replace(cfg, moe_bias_update_rate=0.0,
                                       moe_seq_aux_loss_coef=0.0, mtp_depth=read.mtp_depth)
    assert hf.config_to_hf(cfg)["model_type"] == config["model_type"]
    # counted on scanned stacks: the same parameters, each kind traced once (unrolled: 35 s)
    model = nnx.eval_shape(lambda: GPT(dataclasses.replace(cfg, scan_layers=True),
                                       rngs=nnx.Rngs(0)))
    count = sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(model,
                                                                               nnx.Param)))
    assert count / 1e9 == pytest.approx(billions, abs=0.01)


@pytest.mark.slow
def test_tiny_presets_build_and_write_their_family(tmp_path):
    """deepseek-v3-tiny (YaRN, 4 groups of experts, a dense layer) and glm-4.5-tiny
    build on a (data, tensor) mesh, and to_hf -> from_hf gives the same parameters."""
    for cfg in (GPTConfig.deepseek_v3("deepseek-v3-tiny"), GPTConfig.glm4_moe("glm-4.5-tiny")):
        with jax.set_mesh(make_mesh(2, 2)):
            model = GPT(cfg, rngs=nnx.Rngs(0))
            hf.to_hf(model, tmp_path / cfg.hf_model_type)
            again = hf.from_hf(tmp_path / cfg.hf_model_type)
        assert_bitwise(param_values(model), param_values(again))


@pytest.mark.slow  # the fast tier has the golden fixture and the config translation
def test_checkpoints_as_published_and_as_transformers_saves_them(tmp_path):
    """Kimi K2's published ``config.json`` (``model_type: kimi_k2``, DeepSeek-V3's
    architecture) reads as ``deepseek_v3``; a config counting an MTP layer
    (``num_nextn_predict_layers``: transformers 5.x writes 1 for every DeepSeek-V3
    config) over a checkpoint holding none (``DeepseekV3ForCausalLM.save_pretrained``)
    reads the main model with ``mtp_depth=0``, the same parameters as the config saying
    0, while ``mtp_depth=1`` asked for names the missing tensors; FP8 block-scaled
    weights (``quantization_config``) are refused with the fix."""
    source = FIXTURES / "deepseek_v3"
    shutil.copytree(source, tmp_path / "k2")
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "k2" / "config.json").write_text(json.dumps(
        {**config, "model_type": "kimi_k2", "num_nextn_predict_layers": 1}))
    with jax.set_mesh(make_mesh(1, 1)):
        read = hf.from_hf(tmp_path / "k2")
        plain = hf.from_hf(source)
        with pytest.raises(ValueError, match=r"model\.layers\.3\.eh_proj\.weight .* missing"):
            hf.from_hf(tmp_path / "k2", mtp_depth=1)
    assert read.config.mtp_depth == 0 and read.config.hf_model_type == "deepseek_v3"
    assert_bitwise(param_values(read), param_values(plain))
    with pytest.raises(ValueError, match=r"quantization_config .*dequantise"):
        hf.config_from_hf({**config, "quantization_config": {"quant_method": "fp8"}})


@pytest.mark.slow
def test_mla_fields_that_would_be_ignored_are_refused_or_applied():
    """With ``attention="mla"``: ``num_kv_heads`` other than ``num_heads`` is refused
    (one shared latent, no key/value heads to group), and without ``attention_scale`` a
    YaRN ``rope_scaling`` with ``mscale_all_dim`` gives DeepSeek's softmax scale (as
    ``from_hf`` and the presets set it), not ``qk_head_dim ** -0.5``."""
    from sp_jax.layers import MultiHeadLatentAttention
    from sp_jax.layers.mla import mla_softmax_scale

    with pytest.raises(ValueError, match=r"num_kv_heads=2 is not supported with multi-head "
                                         r"latent attention"):
        GPTConfig.deepseek_v3("deepseek-v3-tiny", num_kv_heads=2)
    cfg = GPTConfig.deepseek_v3("deepseek-v3-tiny", attention_scale=None, rope_scaling=(
        yarn := YarnScaling(factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                            mscale_all_dim=0.5)))
    attention = nnx.eval_shape(lambda: MultiHeadLatentAttention(
        cfg.attention_config(), rngs=nnx.Rngs(0)))
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    want = mla_softmax_scale(qk, {"rope_type": "yarn", "factor": yarn.factor,
                                  "mscale_all_dim": 0.5})
    assert want != qk ** -0.5 and attention.softmax_scale == pytest.approx(want, rel=1e-12)
