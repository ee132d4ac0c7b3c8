"""LoRA adapters out to and in from Hugging Face PEFT: ``to_peft`` writes an adapter that
``peft.PeftModel.from_pretrained`` loads onto the transformers base with sp_jax's logits
(fp32, 1e-5); ``from_peft`` reads it back exactly; ``to_hf(merge_lora=True)`` writes a
plain checkpoint transformers loads with the same logits. Torch, transformers and peft
are test-only dependencies: the tests that need them skip where they are absent."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import compiled_logits, perturb_adapters
from conftest import make_mesh

import sp_jax
from sp_jax.models import hf

pytestmark = pytest.mark.slow

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
LORA = sp_jax.LoRAConfig(rank=4, alpha=8)


def _adapted(directory, lora=LORA):
    model = hf.from_hf(directory, lora=lora)
    perturb_adapters(model, scale=0.05)
    return model


def _peft_logits(base_dir, adapter_dir, tokens):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def _tokens(vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (2, 16)).astype(np.int32)


@pytest.mark.parametrize("family,targets", [("llama", None), ("qwen2", ("q", "v", "down"))])
def test_peft_loads_the_export_with_sp_jax_logits(family, targets, tmp_path):
    lora = LORA if targets is None else sp_jax.LoRAConfig(rank=4, alpha=8, targets=targets)
    with jax.set_mesh(make_mesh(2, 4)):
        model = _adapted(FIXTURES / family, lora)
        tokens = _tokens(model.config.vocab_size)
        want = np.asarray(compiled_logits(model, jnp.asarray(tokens)))
        hf.to_peft(model, tmp_path / "adapter", base_model_name_or_path=str(FIXTURES / family))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    got = _peft_logits(FIXTURES / family, tmp_path / "adapter", tokens)
    np.testing.assert_allclose(got, want[..., :got.shape[-1]], rtol=1e-5, atol=1e-5)


def test_mha_export_loads_in_peft(tmp_path):
    """Multi-head attention: q, k and v fused in one (head, {q, k, v}, head_dim) kernel."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    with jax.set_mesh(make_mesh(2, 4)):
        model = _adapted(tmp_path / "base")
        assert model.config.num_kv_heads == model.config.num_heads
        tokens = _tokens(64)
        want = np.asarray(compiled_logits(model, jnp.asarray(tokens)))
        hf.to_peft(model, tmp_path / "adapter")
    got = _peft_logits(tmp_path / "base", tmp_path / "adapter", tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_from_peft_reads_the_adapter_back_exactly(tmp_path):
    """No torch needed: to_peft then from_peft onto a freshly read base (on another mesh)
    gives the same logits, and writing it again the same tensors, bitwise."""
    from safetensors.numpy import load_file

    with jax.set_mesh(make_mesh(2, 4)):
        model = _adapted(FIXTURES / "llama")
        tokens = jnp.asarray(_tokens(model.config.vocab_size))
        logits = np.asarray(compiled_logits(model, tokens))
        hf.to_peft(model, tmp_path / "a")
    with jax.set_mesh(make_mesh(1, 8)):
        again = hf.from_peft(hf.from_hf(FIXTURES / "llama"), tmp_path / "a")
        assert again.config.lora == LORA
        np.testing.assert_allclose(np.asarray(compiled_logits(again, tokens)), logits, rtol=1e-5,
                                   atol=1e-5)
        hf.to_peft(again, tmp_path / "b")
    first, second = (load_file(str(tmp_path / d / "adapter_model.safetensors"))
                     for d in "ab")
    assert sorted(first) == sorted(second) and len(first) == 2 * 7 * 2  # 2 layers
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


def test_merged_export_loads_in_transformers(tmp_path):
    with jax.set_mesh(make_mesh(2, 4)):
        model = _adapted(FIXTURES / "llama")
        tokens = _tokens(model.config.vocab_size)
        want = np.asarray(compiled_logits(model, jnp.asarray(tokens)))
        with pytest.raises(ValueError, match="merge_lora=True"):
            hf.to_hf(model, tmp_path / "refused")
        hf.to_hf(model, tmp_path / "merged", merge_lora=True)
        plain = hf.from_hf(tmp_path / "merged")
        assert plain.config.lora is None
        np.testing.assert_allclose(np.asarray(plain(jnp.asarray(tokens))), want,
                                   rtol=1e-5, atol=1e-5)
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                               dtype=torch.float32)
    with torch.no_grad():
        got = loaded.eval()(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_peft_config_errors(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["c_attn"]}))
    with pytest.raises(ValueError, match="c_attn"):
        hf.peft.read_peft_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
         "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        hf.peft.read_peft_config(tmp_path)
    with jax.set_mesh(make_mesh(1, 1)):
        with pytest.raises(ValueError, match="no LoRA adapters"):
            hf.to_peft(hf.from_hf(FIXTURES / "llama"), tmp_path / "x")
