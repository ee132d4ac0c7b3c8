"""Gemma 2 and Gemma 3 (text) checkpoints: transformers' golden logits, loss and gradients
(tests/fixtures/hf/gemma2, gemma3, made by scripts/make_hf_fixtures.py: head_dim apart
from hidden / heads, query_pre_attn_scalar 24, a window of 4 tokens, Gemma 2's binding
soft caps, Gemma 3's 5 sliding : 1 full layers with local and global rotary bases and
linear scaling, norms drawn around 0 for ``1 + weight``) on 1 and 2 x 4 devices (fp32,
1e-5), along transformers' greedy generations and by ``generate``; HF -> sp_jax -> HF
bit for bit as the family read; config.json translation both ways and its refusals. No
torch, no network (transformers' strict loading of the output only where installed)."""

import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest
from _util import assert_bitwise, param_values, to_host
from conftest import make_mesh
from flax import nnx
from safetensors.numpy import load_file
from test_hf import _assert_golden, _assert_written_bitwise, _generations, _logits_loss_grads

from sp_jax.models import GPTConfig, generate, hf
from sp_jax.models.hf.gemma2 import linear_rope_scaling
from sp_jax.models.hf.registry import family_of

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
GEMMAS = ["gemma2", "gemma3"]


def _config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def test_gemma_config_translation():
    """config.json -> GPTConfig -> config.json -> the same GPTConfig, for both fixtures and
    a Gemma 3 as transformers 4.x wrote it (rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern); each family writes what it read, and the
    Llama-shaped families express no Gemma."""
    g2 = hf.config_from_hf(_config("gemma2"))
    assert (g2.num_layers, g2.hidden, g2.num_heads, g2.num_kv_heads, g2.head_dim) == \
        (4, 16, 4, 2, 8)
    assert (g2.norm, g2.norm_offset, g2.post_norms, g2.scale_embeddings,
            g2.mlp_activation, g2.tie_embeddings, g2.qk_norm) == \
        ("rmsnorm", 1.0, True, True, "geglu_tanh", True, False)
    assert g2.attention_scale == 24 ** -0.5
    assert (g2.attention_softcap, g2.final_logit_softcap) == (5.0, 3.0)
    assert g2.layer_windows == (4, None, 4, None)
    assert (g2.rope_base, g2.rope_scaling, g2.rope_local_base) == (10000.0, None, None)
    assert (g2.pad_token_id, g2.eos_token_id, g2.bos_token_id) == (0, 1, 2)

    g3 = hf.config_from_hf(_config("gemma3"))
    assert g3.layer_windows == (4, 4, 4, 4, 4, None) and g3.qk_norm
    assert (g3.rope_base, g3.rope_local_base) == (1e6, 1e4)
    assert g3.rope_scaling == linear_rope_scaling(8.0)
    assert (g3.attention_softcap, g3.final_logit_softcap) == (None, None)
    assert g3.hf_model_type == "gemma3_text"

    for name, cfg in (("gemma2", g2), ("gemma3", g3)):
        out = hf.config_to_hf(cfg)
        source = _config(name)
        assert (out["model_type"], out["architectures"]) == \
            (source["model_type"], source["architectures"])
        for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim",
                    "attn_logit_softcapping", "final_logit_softcapping", "rope_parameters",
                    "hidden_activation", "tie_word_embeddings"):
            assert out[key] == source[key], (name, key)
        assert hf.config_from_hf(out) == cfg
        unnamed = dataclasses.replace(cfg, hf_model_type=None)
        assert hf.config_to_hf(unnamed)["model_type"] == \
            source["model_type"]  # the first family that expresses it is its own
        for other in ("llama", "mistral", "qwen2", "qwen3"):
            assert not hf.registry.REGISTRY[other].expresses(cfg), (name, other)

    old = {k: v for k, v in _config("gemma3").items()
           if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert hf.config_from_hf(old) == g3
    assert family_of(g3).model_type == "gemma3_text"


UNREPRODUCIBLE = [  # (config.json change, the error's words)
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"layer_types": ["sliding_attention"] * 5 + ["chunked_attention"]},
     r"layer_types\[5\]='chunked_attention'"),
    ({"layer_types": ["full_attention"] * 2}, "layer_types has 2 entries"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0},
                          "sliding_attention": {"rope_type": "default"}}}, "'yarn'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "sliding layers' rope_type must be 'default'"),
    ({"hidden_size": None}, "'hidden_size' is missing"),
]


def test_gemma_configs_sp_jax_cannot_reproduce_are_named():
    """A Gemma 3 config.json with what sp_jax does not compute (each of UNREPRODUCIBLE,
    one test: they cost no compile): one ValueError naming the key."""
    for change, match in UNREPRODUCIBLE:
        with pytest.raises(ValueError, match=match):
            hf.config_from_hf({**_config("gemma3"), **change})


def test_gemma_to_hf_refuses_what_it_cannot_write():
    """Two window sizes (Gemma has one sliding_window) and Gemma 3's scaled local
    layers are named; a Gemma config is no Llama, and a Llama with one of Gemma's parts
    is written by no family."""
    cfg = hf.config_from_hf(_config("gemma2"))
    with pytest.raises(ValueError, match="holds windows"):
        hf.config_to_hf(dataclasses.replace(cfg, layer_windows=(4, None, 8, None)))
    g3 = hf.config_from_hf(_config("gemma3"))
    with pytest.raises(ValueError, match="cannot express"):
        hf.config_to_hf(dataclasses.replace(g3, rope_local_base=None),
                        model_type="gemma3_text")
    with pytest.raises(ValueError, match="cannot express"):
        hf.config_to_hf(cfg, model_type="llama")
    llama = hf.config_from_hf(_config("llama"))
    for field, value in (("attention_softcap", 50.0), ("final_logit_softcap", 30.0),
                         ("norm_offset", 1.0), ("scale_embeddings", True),
                         ("attention_scale", 0.5)):  # Gemma's parts: no Llama writes them
        with pytest.raises(ValueError, match="neither"):
            hf.config_to_hf(dataclasses.replace(llama, **{field: value}))
    assert isinstance(llama, GPTConfig)


@pytest.mark.parametrize("family,shape", [
    ("gemma2", (1, 1)), pytest.param("gemma2", (2, 4), marks=pytest.mark.slow),
    pytest.param("gemma3", (1, 1), marks=pytest.mark.slow),
    pytest.param("gemma3", (2, 4), marks=pytest.mark.slow)],
    ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else v)
def test_gemma_golden_logits_loss_and_gradients(family, shape):
    """transformers' logits (fp32, 1e-5), loss and gradients (the norms' included: ``1 +
    weight``, before and after attention and MLP); along its greedy generations (41
    positions, past the window of 4) the first new token's logits and every new token as
    the argmax. (2, 4): tensor and sequence parallelism."""
    golden = np.load(FIXTURES / family / "golden.npz")
    tokens = golden["input_ids"]
    gen_batch, lengths = _generations(golden)
    with jax.set_mesh(make_mesh(*shape)):
        model = hf.from_hf(FIXTURES / family)
        model.eval()
        logits, loss, grads = _logits_loss_grads(model, tokens)
        gen_logits = to_host(nnx.jit(lambda m, t: m(t))(model, gen_batch))
    _assert_golden(model, golden, logits, loss, grads, gen_logits, lengths, f"{family} {shape}")


@pytest.mark.slow
@pytest.mark.parametrize("family", GEMMAS)
def test_gemma_generate_equals_transformers_greedy(family):
    """``generate``: 32 new tokens of 3 ragged prompts in one batch on 2 x 4 devices
    (the cache past the window of 4; Gemma 2's soft caps in decoding), equal to
    transformers' greedy generation of each prompt alone."""
    golden = np.load(FIXTURES / family / "golden.npz")
    prompts = [golden[f"gen_prompt_{i}"].tolist() for i in range(3)]
    expected = np.stack([golden[f"gen_tokens_{i}"] for i in range(3)])
    with jax.set_mesh(make_mesh(2, 4)):
        out = generate(hf.from_hf(FIXTURES / family), prompts, max_new_tokens=32)
    np.testing.assert_array_equal(out.tokens, expected)


@pytest.mark.parametrize("family", [pytest.param("gemma2", marks=pytest.mark.slow),
                                    "gemma3"])
def test_gemma_round_trip_is_bitwise(family, tmp_path):
    """HF -> sp_jax (2x4) -> HF: every tensor bit for bit (the MLP's pre-norm from
    pre_feedforward_layernorm, post_attention_layernorm after the attention), written as
    the family read (model_type, architectures, layer_types, rope_parameters); -> sp_jax
    again (4x2, and with scanned layers): the same parameters."""
    original = load_file(FIXTURES / family / "model.safetensors")
    with jax.set_mesh(make_mesh(2, 4)):
        model = hf.from_hf(FIXTURES / family)
        hf.to_hf(model, tmp_path / "a")
        scanned = hf.from_hf(FIXTURES / family, scan_layers=True)
        hf.to_hf(scanned, tmp_path / "b")
    for written in ("a", "b"):  # unrolled and scanned layers
        _assert_written_bitwise(original, tmp_path / written)
    source, config = _config(family), json.loads((tmp_path / "a" / "config.json").read_text())
    for key in ("model_type", "architectures", "layer_types", "rope_parameters",
                "sliding_window", "query_pre_attn_scalar"):
        assert config[key] == source[key], key
    assert hf.config_from_hf(config) == hf.config_from_hf(source)
    with jax.set_mesh(make_mesh(4, 2)):  # 4 heads: tensor-parallel up to 4
        again = hf.from_hf(tmp_path / "a")
    assert_bitwise(param_values(model), param_values(again))


@pytest.mark.slow
@pytest.mark.parametrize("family", GEMMAS)
def test_transformers_loads_gemma_to_hf_strictly(family, tmp_path):
    """Where torch and transformers are installed (the fixtures script's environment),
    a to_hf directory loads with no missing or unexpected tensors as the family's class
    and gives the golden logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    golden = np.load(FIXTURES / family / "golden.npz")
    with jax.set_mesh(make_mesh(1, 1)):
        hf.to_hf(hf.from_hf(FIXTURES / family), tmp_path)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(loaded).__name__ == _config(family)["architectures"][0]
    with torch.no_grad():
        logits = loaded.eval()(input_ids=torch.from_numpy(
            golden["input_ids"].astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(logits, golden["logits"], rtol=1e-5, atol=1e-5)
