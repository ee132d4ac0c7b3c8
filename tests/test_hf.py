"""Hugging Face checkpoints: golden logits, loss and gradients that transformers computed
(tests/fixtures/hf, made by scripts/make_hf_fixtures.py) reproduced on 1, 8 (2x4) and 8
(1x8) devices (GPT-2 and Llama; Mistral, Qwen2 and Qwen3 on 1 and 2x4; the mixtures of
experts Mixtral and Qwen3-MoE on (data, expert, context, tensor) meshes (1, 4, 1, 2) and
(2, 2, 1, 2) with expert parallelism, with transformers' load-balancing loss; head_dim
apart from hidden / heads in Qwen3, Mistral and Llama, and a Qwen2 with windows on some
layers only, on 1 and 2x4), and the logits along transformers' greedy generations (41
positions, past Mistral's sliding window); sp_jax -> Hugging Face -> sp_jax bitwise with
the special token ids and generation_config.json; config translation; every bad tensor
named before anything is placed. No torch, no network."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _util import assert_bitwise, param_values, slow_except, to_host
from conftest import make_mesh
from flax import nnx
from jax.sharding import AxisType
from safetensors.numpy import load_file

from sp_jax import ParallelConfig
from sp_jax.models import GPT, GPTConfig, RopeScaling, hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
MESHES = [(1, 1), (2, 4), (1, 8)]
DENSE = ["gpt2", "llama", "mistral", "qwen2", "qwen3"]
MOE = ["mixtral", "qwen3_moe"]  # mixtures of experts
FAMILIES = DENSE + MOE
NEW = ("mistral", "qwen2", "qwen3")  # tested on the first two meshes (the suite's time)
# (data, expert, context, tensor): the (2, 4)-equivalent meshes with an expert axis
MOE_MESHES = [(1, 4, 1, 2), (2, 2, 1, 2)]
EXPERTS = ParallelConfig(expert_axis="expert")


def _expert_mesh(*shape: int) -> jax.sharding.Mesh:
    """A (data, expert, context, tensor) mesh over the first devices."""
    return jax.make_mesh(shape, ("data", "expert", "context", "tensor"),
                         axis_types=(AxisType.Explicit,) * 4,
                         devices=jax.devices()[:int(np.prod(shape))])


def _meshes(family: str) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh, ParallelConfig]:
    """Two 8-device meshes for a family's round trips and the model's ParallelConfig: (2,
    4) and (1, 8); a mixture of experts' two MOE_MESHES with expert parallelism."""
    if family in MOE:
        return _expert_mesh(*MOE_MESHES[0]), _expert_mesh(*MOE_MESHES[1]), EXPERTS
    return make_mesh(2, 4), make_mesh(1, 8), ParallelConfig()


@nnx.jit
def _logits_loss_grads(model, tokens):
    logits = model(tokens)
    loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens))(model)
    return logits, loss, grads


@nnx.jit
def _logits_losses_grads(model, tokens):
    """The logits, the loss with its metrics and the loss's gradients."""
    logits = model(tokens)
    (loss, metrics), grads = nnx.value_and_grad(
        lambda m: m.loss(tokens, return_metrics=True), has_aux=True)(model)
    return logits, loss, metrics, grads


def _assert_golden_grads(model, grads, golden, msg: str) -> None:
    """sp_jax's gradients, in transformers' names and layouts, against the golden ones."""
    flat = {"/".join(map(str, k)): to_host(v[...]) for k, v in nnx.to_flat_state(grads)}
    named = hf.io._convert_to_hf(model.config, flat)  # gradients in transformers' names
    for key in golden.files:
        if key.startswith("grad/"):
            got, want = named[key[5:]], golden[key]
            pad = model.config.pad_token_id
            if key.endswith("embed_tokens.weight") and pad is not None:
                # transformers' Llama-shaped embeddings are nn.Embedding(padding_idx=
                # pad_token_id): no gradient through the pad token's row (sp_jax has
                # one, docs/api.md); every other row as transformers'
                keep = np.arange(len(want)) != pad
                got, want = got[keep], want[keep]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{msg} {key}")


def _assert_written_bitwise(original: dict, directory) -> dict:
    """``directory/model.safetensors`` (a ``to_hf`` output) holds exactly the tensors of
    ``original`` (names, dtypes, bits); returns what it holds."""
    written = load_file(directory / "model.safetensors")
    assert sorted(written) == sorted(original)
    for name in original:
        assert written[name].dtype == original[name].dtype
        np.testing.assert_array_equal(written[name], original[name], err_msg=name)
    return written


def _assert_golden(model, golden, logits, loss, grads, gen_logits, lengths, msg: str) -> None:
    """A model's logits, loss and gradients against transformers' (``golden``), and the
    logits ``gen_logits`` of its greedy generations (``_generations``' rows of
    ``lengths``): each first new token's logits and the 32 argmax tokens."""
    np.testing.assert_allclose(to_host(logits), golden["logits"], rtol=1e-5, atol=1e-5,
                               err_msg=msg)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(gen_logits[i, n - 1], golden[f"gen_next_logits_{i}"],
                                   rtol=1e-5, atol=1e-5, err_msg=f"{msg} {i}")
        np.testing.assert_array_equal(gen_logits[i, n - 1:n + 31].argmax(-1),
                                      golden[f"gen_tokens_{i}"], err_msg=f"{msg} generation {i}")
    np.testing.assert_allclose(float(loss), float(golden["loss"]), rtol=1e-6, err_msg=msg)
    _assert_golden_grads(model, grads, golden, msg)


def _generations(golden) -> tuple[np.ndarray, list[int]]:
    """transformers' greedy generations as one batch ``[4, 48]`` (each prompt and its 32
    new tokens, zeros after; a fourth row repeats the first, for the data axis) and the
    prompt lengths: a causal model's logits at a position see only the tokens before."""
    rows, lengths = [], []
    for i in range(3):
        prompt, new = golden[f"gen_prompt_{i}"], golden[f"gen_tokens_{i}"]
        rows.append(np.concatenate([prompt, new]))
        lengths.append(len(prompt))
    batch = np.zeros((4, 48), np.int32)
    for r, row in enumerate([*rows, rows[0]]):
        batch[r, :len(row)] = row
    return batch, lengths


@pytest.mark.parametrize("family", slow_except(DENSE, "llama"))
def test_golden_logits_loss_and_gradients(family):
    """transformers' logits, loss and gradients; and along each of its greedy generations
    (teacher-forced: prompt + 32 tokens, 41 positions at most), the logits of the first
    new token (1e-5) and every new token as the argmax of the position before it."""
    golden = np.load(FIXTURES / family / "golden.npz")
    tokens = golden["input_ids"]
    gen_batch, lengths = _generations(golden)
    for shape in MESHES[:2] if family in NEW else MESHES:
        with jax.set_mesh(make_mesh(*shape)):
            model = hf.from_hf(FIXTURES / family)
            model.eval()  # transformers' golden values are in eval mode (no dropout)
            logits, loss, grads = _logits_loss_grads(model, tokens)
            gen_logits = to_host(nnx.jit(lambda m, t: m(t))(model, gen_batch))
        np.testing.assert_allclose(to_host(logits), golden["logits"], rtol=1e-5, atol=1e-5,
                                   err_msg=f"{family} {shape}")
        for i, n in enumerate(lengths):
            np.testing.assert_allclose(gen_logits[i, n - 1], golden[f"gen_next_logits_{i}"],
                                       rtol=1e-5, atol=1e-5, err_msg=f"{family} {shape} {i}")
            np.testing.assert_array_equal(gen_logits[i, n - 1:n + 31].argmax(-1),
                                          golden[f"gen_tokens_{i}"],
                                          err_msg=f"{family} {shape} generation {i}")
        np.testing.assert_allclose(float(loss), float(golden["loss"]), rtol=1e-6)
        _assert_golden_grads(model, grads, golden, f"{family} {shape}")


def _golden_and_round_trip(name: str, shape, tmp_path, scan: bool = False,
                           **expect) -> GPT:
    """Fixture ``name`` on a ``shape`` mesh (``scan``: scanned layers): transformers'
    logits (fp32, 1e-5), loss and gradients, the logits along its greedy generations; HF
    -> sp_jax -> HF bit for bit with config.json's ``expect`` entries as transformers
    wrote them, and -> sp_jax again (4x2) the same parameters."""
    directory = FIXTURES / name
    golden = np.load(directory / "golden.npz")
    tokens = golden["input_ids"]
    gen_batch, lengths = _generations(golden)
    with jax.set_mesh(make_mesh(*shape)):
        model = hf.from_hf(directory, scan_layers=scan)
        model.eval()
        logits, loss, grads = _logits_loss_grads(model, tokens)
        gen_logits = to_host(nnx.jit(lambda m, t: m(t))(model, gen_batch))
        hf.to_hf(model, tmp_path)
    _assert_golden(model, golden, logits, loss, grads, gen_logits, lengths, f"{name} {shape}")
    original, written = (load_file(d / "model.safetensors") for d in (directory, tmp_path))
    assert sorted(written) == sorted(original)
    for key in original:
        assert written[key].dtype == original[key].dtype
        np.testing.assert_array_equal(written[key], original[key], err_msg=key)
    config = json.loads((tmp_path / "config.json").read_text())
    source = json.loads((directory / "config.json").read_text())
    for key, value in expect.items():
        assert config[key] == source[key] == value, key
    assert hf.config_from_hf(config) == dataclasses.replace(model.config, scan_layers=False)
    with jax.set_mesh(make_mesh(4, 2)):  # a third layout (4 heads: not 1x8)
        again = hf.from_hf(tmp_path, scan_layers=scan)
    assert_bitwise(param_values(model), param_values(again))
    return model


MESH_IDS = lambda s: f"{s[0]}x{s[1]}"  # noqa: E731


@pytest.mark.slow  # head_dim's fast golden case: the Mistral-Nemo shape below
@pytest.mark.parametrize("shape", [(1, 1), (2, 4)], ids=MESH_IDS)
def test_qwen3_head_dim_apart_from_width_golden_and_round_trip(shape, tmp_path):
    """A Qwen3 whose head_dim (8) is not hidden / heads (32 / 8 = 4; q 64 wide, o_proj
    64 -> 32, 2 key/value heads, untied head): transformers' logits (fp32, 1e-5), loss
    and gradients, the logits along its greedy generations; HF -> sp_jax -> HF bit for
    bit with head_dim in config.json, and -> sp_jax again the same parameters."""
    model = _golden_and_round_trip("qwen3_head_dim", shape, tmp_path, model_type="qwen3",
                                   head_dim=8)
    assert (model.config.head_dim, model.config.hidden, model.config.num_heads) == (8, 32, 8)


# fixture -> (head_dim, hidden, heads, layer_windows) as read, config.json entries written
SHAPES = {
    "mistral_head_dim": ((16, 40, 4, None),
                         dict(model_type="mistral", head_dim=16, sliding_window=4)),
    "llama_head_dim": ((6, 32, 4, None), dict(model_type="llama", head_dim=6)),
    "qwen2_layer_windows": ((None, 32, 8, (None, 4, 4)),
                            dict(model_type="qwen2", use_sliding_window=True, sliding_window=4,
                                 max_window_layers=1,
                                 layer_types=["full_attention", "sliding_attention",
                                              "sliding_attention"])),
}


@pytest.mark.parametrize("name,shape", slow_except(
    [(n, s) for n in SHAPES for s in MESHES[:2]], ("mistral_head_dim", (1, 1))),
    ids=lambda v: MESH_IDS(v) if isinstance(v, tuple) else v)
def test_head_dim_and_layer_windows_golden_and_round_trip(name, shape, tmp_path):
    """A Mistral-Nemo-shaped Mistral (hidden 40, 4 heads of 16, a window of 4), a Llama
    with an explicit head_dim (6 with hidden 32 and 4 heads: q narrower than hidden) and a
    Qwen2 with windows on some layers only (``max_window_layers=1`` of 3, window 4: full,
    sliding, sliding): transformers' logits (fp32, 1e-5), loss, gradients and greedy
    generations on 1 and 2x4 devices (2x4: scanned layers, the windows as scanned data);
    HF -> sp_jax -> HF bit for bit, config.json's
    head_dim / window entries as transformers wrote them."""
    (head_dim, hidden, heads, windows), expect = SHAPES[name]
    model = _golden_and_round_trip(name, shape, tmp_path, scan=shape != (1, 1), **expect)
    cfg = model.config
    assert (cfg.head_dim, cfg.hidden, cfg.num_heads, cfg.layer_windows) == \
        (head_dim, hidden, heads, windows)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["1x2x4", "2x4x1"])
def test_mistral_on_a_ring_mesh_gives_golden_logits_and_gradients(mesh):
    """The Mistral checkpoint (a sliding window of 4) onto (data, context, tensor) meshes
    with ring attention (the sequence in zigzag order: chunks of 4 and of 2 tokens, so
    the window spans chunk boundaries and whole chunks lie outside it): transformers'
    logits (1e-5), loss and gradients; and its greedy generations teacher-forced (48
    positions: chunks of 6)."""
    golden = np.load(FIXTURES / "mistral" / "golden.npz")
    shape = tuple(int(n) for n in mesh.split("x"))
    gen_batch, lengths = _generations(golden)
    with jax.set_mesh(jax.make_mesh(shape, ("data", "context", "tensor"),
                                    axis_types=(AxisType.Explicit,) * 3,
                                    devices=jax.devices()[:int(np.prod(shape))])):
        model = hf.from_hf(FIXTURES / "mistral",
                           parallel=ParallelConfig(context_parallel="ring"))
        model.eval()
        logits, loss, grads = _logits_loss_grads(model, golden["input_ids"])
        gen_logits = to_host(nnx.jit(lambda m, t: m(t))(model, gen_batch))
    _assert_golden(model, golden, logits, loss, grads, gen_logits, lengths,
                   f"mistral ring {mesh}")


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE)
def test_golden_moe_logits_losses_and_gradients(family):
    """A mixture of experts on a (data, expert, context, tensor) mesh with expert
    parallelism (Mixtral (1, 4, 1, 2), Qwen3-MoE (2, 2, 1, 2); the round trips below run
    both on both): transformers' logits (1e-5); its plain next-token loss
    (output_router_logits=False) as metrics["lm_loss"], its load-balancing loss as
    metrics["moe_aux_loss"] and its loss with output_router_logits=True (lm_loss +
    router_aux_loss_coef * aux) as sp_jax's loss, whose gradients are transformers'."""
    golden = np.load(FIXTURES / family / "golden.npz")
    for shape in MOE_MESHES[:1] if family == "mixtral" else MOE_MESHES[1:]:
        with jax.set_mesh(_expert_mesh(*shape)):
            model = hf.from_hf(FIXTURES / family, parallel=EXPERTS)
            model.eval()
            logits, loss, metrics, grads = _logits_losses_grads(model, golden["input_ids"])
        msg = f"{family} {shape}"
        np.testing.assert_allclose(to_host(logits), golden["logits"], rtol=1e-5, atol=1e-5,
                                   err_msg=msg)
        np.testing.assert_allclose(float(metrics["lm_loss"]), float(golden["loss"]),
                                   rtol=1e-6, err_msg=msg)
        np.testing.assert_allclose(float(metrics["moe_aux_loss"]), float(golden["aux_loss"]),
                                   rtol=1e-5, err_msg=msg)
        np.testing.assert_allclose(float(loss), float(golden["loss_with_aux"]), rtol=1e-6,
                                   err_msg=msg)
        _assert_golden_grads(model, grads, golden, msg)


@pytest.mark.parametrize("family", slow_except(FAMILIES, "llama"))
def test_round_trip_is_bitwise(family, tmp_path):
    """HF -> sp_jax (2x4) -> HF: the same tensors bit for bit, and the config (the same
    family, the special token ids in config.json and generation_config.json as
    transformers wrote them); -> sp_jax again (1x8, and scanned layers): the same
    parameters and shardings as a model built directly. Mixtures of experts on the
    (1, 4, 1, 2) and (2, 2, 1, 2) meshes with expert parallelism."""
    original = load_file(FIXTURES / family / "model.safetensors")
    first, second, parallel = _meshes(family)
    with jax.set_mesh(first):
        model = hf.from_hf(FIXTURES / family, parallel=parallel)
        built = GPT(model.config, parallel=parallel, rngs=nnx.Rngs(0))
        specs = lambda m: jax.tree.map(lambda v: v[...].sharding.spec,  # noqa: E731
                                       nnx.state(m, nnx.Param))
        assert specs(model) == specs(built)  # placed straight into the model's shardings
        hf.to_hf(model, tmp_path / "a")
        scanned = hf.from_hf(FIXTURES / family, parallel=parallel, scan_layers=True)
        hf.to_hf(scanned, tmp_path / "b")
    written = _assert_written_bitwise(original, tmp_path / "a")
    assert load_file(tmp_path / "b" / "model.safetensors").keys() == written.keys()
    source = json.loads((FIXTURES / family / "config.json").read_text())
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert hf.config_from_hf(config) == hf.config_from_hf(source)
    assert config["model_type"] == source["model_type"] == family
    generation = json.loads((tmp_path / "a" / "generation_config.json").read_text())
    source_generation = json.loads(
        (FIXTURES / family / "generation_config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config.get(key) == source.get(key) == generation.get(key) == \
            source_generation.get(key), key
    assert generation["_from_model_config"] is True
    with jax.set_mesh(second):
        again = hf.from_hf(tmp_path / "a", parallel=parallel)
    assert_bitwise(param_values(model), param_values(again))


@pytest.mark.parametrize("family", slow_except([*FAMILIES, "mistral_no_window"],
                                                "mistral_no_window"))
def test_to_hf_writes_the_family_it_read(family, tmp_path):
    """from_hf -> to_hf (no model_type=) writes the class the checkpoint was read as:
    config.json's architectures and model_type as the source's, every tensor bit for bit;
    a Mistral without a window (which a Llama also expresses) stays MistralForCausalLM."""
    source_dir = FIXTURES / family.removesuffix("_no_window")
    source = json.loads((source_dir / "config.json").read_text())
    if family == "mistral_no_window":
        source = {**source, "sliding_window": None}
        source_dir = tmp_path / "source"
        source_dir.mkdir()
        (source_dir / "config.json").write_text(json.dumps(source))
        (source_dir / "model.safetensors").symlink_to(
            FIXTURES / "mistral" / "model.safetensors")
    with jax.set_mesh(make_mesh(1, 1)):
        model = hf.from_hf(source_dir)
        assert model.config.hf_model_type == source["model_type"]
        hf.to_hf(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == \
        (source["model_type"], source["architectures"])
    assert written.get("sliding_window") == source.get("sliding_window")
    original, back = load_file(source_dir / "model.safetensors"), \
        load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name in original:
        assert back[name].dtype == original[name].dtype, name
        np.testing.assert_array_equal(back[name], original[name], err_msg=name)


def test_presets_remember_their_family():
    """A preset writes its preset's family; model_type= still chooses; a family the config
    no longer fits falls back to the first that expresses it; a bad remembered family is
    named."""
    llama = GPTConfig.llama("llama-tiny")
    assert (GPTConfig.gpt2("tiny").hf_model_type, llama.hf_model_type,
            GPTConfig.mixtral("mixtral-tiny").hf_model_type) == ("gpt2", "llama", "mixtral")
    assert hf.config_to_hf(GPTConfig.gpt2("tiny"))["architectures"] == ["GPT2LMHeadModel"]
    assert hf.config_to_hf(GPTConfig.mixtral("mixtral-tiny"))["model_type"] == "mixtral"
    assert hf.config_to_hf(llama)["architectures"] == ["LlamaForCausalLM"]
    assert hf.config_to_hf(llama, model_type="mistral")["architectures"] == \
        ["MistralForCausalLM"]
    assert hf.config_to_hf(dataclasses.replace(llama, hf_model_type="mistral"))[
        "architectures"] == ["MistralForCausalLM"]
    windowed = dataclasses.replace(llama, sliding_window=16)  # a Llama has no window
    assert hf.config_to_hf(windowed)["model_type"] == "mistral"
    assert GPTConfig.from_dict(dataclasses.asdict(llama)) == llama  # as checkpoints store it
    with pytest.raises(ValueError, match="hf_model_type='gemma' is not one sp_jax writes"):
        hf.config_to_hf(dataclasses.replace(llama, hf_model_type="gemma"))
    with pytest.raises(ValueError, match="hf_model_type=3 must be a Hugging Face model_type"):
        dataclasses.replace(llama, hf_model_type=3)


def test_config_translation():
    v5 = json.loads((FIXTURES / "llama" / "config.json").read_text())
    cfg = hf.config_from_hf(v5)
    assert (cfg.num_kv_heads, cfg.rope_base, cfg.norm_epsilon, cfg.tie_embeddings) == \
        (2, 10000.0, 1e-6, False)
    assert cfg.rope_scaling == RopeScaling(4.0, 1.0, 4.0, 8)
    # transformers 4.x: rope_theta and rope_scaling at the top level
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=10000.0, rope_scaling={
        k: v for k, v in v5["rope_parameters"].items() if k != "rope_theta"})
    assert hf.config_from_hf(v4) == cfg
    assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg
    gpt2 = hf.config_from_hf(json.loads((FIXTURES / "gpt2" / "config.json").read_text()))
    assert (gpt2.positions, gpt2.mlp_activation, gpt2.dropout, gpt2.attention_dropout) == \
        ("learned", "gelu", 0.1, 0.1)
    assert hf.config_from_hf(hf.config_to_hf(gpt2)) == gpt2
    # head_dim: hidden / heads (32 / 8) stays the derived default; another is read
    assert hf.config_from_hf({**v5, "head_dim": 4}) == cfg and cfg.head_dim is None
    wide = hf.config_from_hf({**v5, "head_dim": 8})
    assert wide.head_dim == 8 and hf.config_to_hf(wide)["head_dim"] == 8
    assert hf.config_from_hf(hf.config_to_hf(wide)) == wide
    with pytest.raises(ValueError, match="neither GPT-2-shaped"):  # GPT-2 has no head_dim
        hf.config_to_hf(dataclasses.replace(gpt2, head_dim=8))
    for bad, match in [
        ({**v5, "model_type": "gemma"}, "model_type='gemma'"),  # (mistral: now supported)
        ({**v5, "head_dim": 5}, "even head size, got head_dim=5"),
        ({**v5, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "'yarn'"),
        ({**v5, "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({**hf.config_to_hf(gpt2), "embd_pdrop": 0.0}, "embd_pdrop=0.0 differs"),
    ]:
        with pytest.raises(ValueError, match=match):
            hf.config_from_hf(bad)
    with pytest.raises(ValueError, match="neither GPT-2-shaped.*positions='rotary'"):
        hf.config_to_hf(GPTConfig(vocab_size=64, max_seq_len=8, num_layers=1, num_heads=2,
                                  hidden=8, positions="rotary"))


def _config(family):
    return json.loads((FIXTURES / family / "config.json").read_text())


def test_config_translation_mistral_qwen2_qwen3():
    """Sliding windows (Mistral's as it is; Qwen's on all layers or none, refused on some),
    Qwen3's q/k norm and head_dim, biases, special token ids (several eos ids), and the
    family written back."""
    mistral, qwen2, qwen3 = (_config(f) for f in NEW)
    cfg = hf.config_from_hf(mistral)
    assert (cfg.sliding_window, cfg.qkv_bias, cfg.out_bias, cfg.qk_norm, cfg.bos_token_id,
            cfg.eos_token_id, cfg.pad_token_id) == (4, False, False, False, 1, 2, None)
    full = hf.config_from_hf({**mistral, "sliding_window": None})
    assert (full.sliding_window, full.hf_model_type) == (None, "mistral")
    assert hf.config_to_hf(full)["model_type"] == "mistral"  # the family it was read as
    forgotten = dataclasses.replace(full, hf_model_type=None)
    assert hf.config_to_hf(forgotten)["model_type"] == "llama"  # the first expressing it
    assert hf.config_to_hf(full, model_type="llama")["model_type"] == "llama"  # asked for
    assert hf.config_to_hf(full, model_type="mistral")["model_type"] == "mistral"
    assert hf.config_from_hf(hf.config_to_hf(full, model_type="mistral")) == full
    with pytest.raises(ValueError, match="model_type='mistral' cannot express"):
        hf.config_to_hf(dataclasses.replace(full, qkv_bias=True, out_bias=True),
                        model_type="mistral")
    cfg = hf.config_from_hf(qwen2)
    assert (cfg.qkv_bias, cfg.out_bias, cfg.mlp_bias, cfg.tie_embeddings,
            cfg.sliding_window) == (True, False, False, True, None)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (90, 91, 92)
    window = {"use_sliding_window": True, "sliding_window": 8, "layer_types": None}
    assert hf.config_from_hf({**qwen2, **window, "max_window_layers": 0}).sliding_window == 8
    assert hf.config_from_hf({**qwen2, **window, "max_window_layers": 2}).sliding_window \
        is None  # from layer 2 on: none of the 2
    assert hf.config_from_hf({**qwen2, "sliding_window": 8}).sliding_window is None  # off
    some = hf.config_from_hf({**qwen2, **window,  # a window on some layers only
                              "layer_types": ["full_attention", "sliding_attention"]})
    assert (some.sliding_window, some.layer_windows) == (None, (None, 8))
    windowed = hf.config_from_hf({**qwen2, **window, "max_window_layers": 0})
    assert hf.config_from_hf(hf.config_to_hf(windowed)) == windowed
    cfg = hf.config_from_hf(qwen3)
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.out_bias, cfg.eos_token_id, cfg.pad_token_id) == \
        (True, False, False, (94, 95), 93)
    assert hf.config_to_hf(cfg)["eos_token_id"] == [94, 95]
    assert "bos_token_id" not in hf.config_to_hf(cfg)  # None: left to transformers' default
    assert hf.config_from_hf({**qwen3, "attention_bias": True}).out_bias is True
    # transformers' default head_dim for Qwen3 is 128 whatever the width
    assert hf.config_from_hf({k: v for k, v in qwen3.items() if k != "head_dim"}
                             ).head_dim == 128
    assert GPTConfig.from_dict(dataclasses.asdict(cfg)) == cfg  # as checkpoints store it
    with pytest.raises(TypeError, match="GPTConfig.eos_token_id='2' must be a token id"):
        dataclasses.replace(cfg, eos_token_id="2")
    for family in NEW:  # every family's shape keys are required
        with pytest.raises(ValueError, match=f"'num_hidden_layers' is missing \\(a {family}"):
            hf.config_from_hf({k: v for k, v in _config(family).items()
                               if k != "num_hidden_layers"})


@pytest.mark.slow
def test_config_translation_mixtral_qwen3_moe():
    """The experts' fields (either key of the expert count), Mixtral's default rope base,
    Qwen3-MoE's decoder_sparse_step / norm_topk_prob / sliding window, what sp_jax refuses
    (mlp_only_layers, router jitter, no experts), a head_dim that is not hidden / heads
    (Qwen3-30B-A3B's), and dense and mixture-of-experts families each refusing the
    other's configs."""
    mixtral, qwen3_moe = _config("mixtral"), _config("qwen3_moe")
    cfg = hf.config_from_hf(mixtral)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_mlp_hidden, cfg.moe_norm_topk,
            cfg.moe_layer_freq, cfg.router_aux_loss_coef, cfg.rope_base, cfg.sliding_window,
            cfg.qk_norm, cfg.tie_embeddings) == (4, 2, 16, True, 1, 0.02, 1e6, None, False,
                                                 False)
    assert cfg == dataclasses.replace(GPTConfig.mixtral(
        "mixtral-tiny", vocab_size=96, max_seq_len=64, hidden=32, num_experts=4,
        mlp_hidden=16, moe_mlp_hidden=16), bos_token_id=1, eos_token_id=2,
        param_dtype=jnp.float32)
    assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg
    v4 = {k: v for k, v in mixtral.items() if k != "rope_parameters"}  # transformers' 1e6
    assert hf.config_from_hf(v4).rope_base == 1e6
    assert hf.config_from_hf({**v4, "rope_theta": 1e4}).rope_base == 1e4
    assert hf.config_from_hf({**mixtral, "sliding_window": 8}).sliding_window == 8
    cfg = hf.config_from_hf(qwen3_moe)
    assert (cfg.num_experts, cfg.moe_mlp_hidden, cfg.mlp_hidden, cfg.moe_norm_topk,
            cfg.moe_layer_freq, cfg.qk_norm, cfg.router_aux_loss_coef,
            cfg.tie_embeddings) == (4, 16, 48, True, 1, True, 0.01, True)
    assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg
    published = {k: v for k, v in qwen3_moe.items() if k != "num_local_experts"}
    assert hf.config_from_hf({**published, "num_experts": 4}) == cfg  # 4.x / Hub spelling
    assert hf.config_to_hf(cfg)["num_experts"] == 4
    sparse = hf.config_from_hf({**qwen3_moe, "decoder_sparse_step": 2})
    assert (sparse.moe_layer_freq, [sparse.is_moe_layer(i) for i in range(2)]) == \
        (2, [False, True])
    assert hf.config_from_hf({**published, "num_experts": 4}).moe_norm_topk is True
    assert hf.config_from_hf({k: v for k, v in qwen3_moe.items()
                              if k != "norm_topk_prob"}).moe_norm_topk is False  # default
    window = {"use_sliding_window": True, "sliding_window": 8}
    assert hf.config_from_hf({**qwen3_moe, **window}).sliding_window == 8
    assert hf.config_from_hf({**qwen3_moe, "sliding_window": 8}).sliding_window is None
    for bad, match in [
        ({**qwen3_moe, "mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
        ({**qwen3_moe, "num_local_experts": 0}, "num_experts=0"),
        ({k: v for k, v in qwen3_moe.items() if k != "moe_intermediate_size"},
         "'moe_intermediate_size' is missing"),
        ({k: v for k, v in mixtral.items() if k != "num_local_experts"},
         "'num_local_experts' .* is missing"),
        ({**mixtral, "router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ]:
        with pytest.raises(ValueError, match=match):
            hf.config_from_hf(bad)
    wide = hf.config_from_hf({**qwen3_moe, "head_dim": 128})
    assert wide.head_dim == 128 and hf.config_from_hf(hf.config_to_hf(wide)) == wide
    moe, dense = hf.config_from_hf(qwen3_moe), hf.config_from_hf(_config("qwen3"))
    for family, config in hf.registry.REGISTRY.items():
        assert config.expresses(moe) == (family == "qwen3_moe"), family
        assert config.expresses(dense) == (family == "qwen3"), family
    with pytest.raises(ValueError, match="model_type='qwen3' cannot express.*num_experts=4"):
        hf.config_to_hf(moe, model_type="qwen3")
    with pytest.raises(ValueError, match="model_type='mixtral' cannot express.*num_experts=0"):
        hf.config_to_hf(hf.config_from_hf(_config("mistral")), model_type="mixtral")


@pytest.mark.slow
def test_moe_fused_experts_and_dense_layers():
    """transformers 5.x's fused expert tensors (its state_dict(): mlp.experts.gate_up_proj /
    down_proj) read as the per-expert ones; a Qwen3-MoE with decoder_sparse_step=2 (a
    dense layer 0, experts in layer 1) out and back bitwise, each layer's tensors named
    as transformers names them, a missing expert tensor named with its sp_jax path."""
    tensors = load_file(FIXTURES / "mixtral" / "model.safetensors")
    fused = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            fused[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for i in range(2):
        p = f"model.layers.{i}.block_sparse_moe.experts."
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack([np.concatenate(
            [tensors[f"{p}{e}.w1.weight"], tensors[f"{p}{e}.w3.weight"]]) for e in range(4)])
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(
            [tensors[f"{p}{e}.w2.weight"] for e in range(4)])
    config = {**_config("qwen3_moe"), "decoder_sparse_step": 2}
    with jax.set_mesh(_expert_mesh(*MOE_MESHES[0])):
        assert_bitwise(param_values(hf.from_hf(fused, _config("mixtral"), parallel=EXPERTS)),
                       param_values(hf.from_hf(FIXTURES / "mixtral", parallel=EXPERTS)))
        model = GPT(hf.config_from_hf(config), parallel=EXPERTS, rngs=nnx.Rngs(0))
        state = hf.to_hf_state_dict(model)
        again = hf.from_hf(state, config, parallel=EXPERTS)
        missing = "model.layers.1.mlp.experts.2.up_proj.weight"
        with pytest.raises(ValueError, match=rf"{missing} \(for blocks/1/mlp/experts_up\) is "
                                             "missing"):
            hf.from_hf({k: v for k, v in state.items() if k != missing}, config,
                       parallel=EXPERTS)
    assert_bitwise(param_values(model), param_values(again))
    assert state["model.layers.0.mlp.gate_proj.weight"].shape == (48, 32)  # dense
    assert state["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (32, 16)
    assert state["model.layers.1.mlp.gate.weight"].shape == (4, 32)  # the router
    assert not any(k.startswith("model.layers.0.mlp.experts") for k in state)
    assert not any(k.startswith("model.layers.1.mlp.gate_proj") for k in state)


@pytest.mark.slow
@pytest.mark.parametrize("preset,count", [
    (GPTConfig.gpt2("small"), 124_439_808),  # Hugging Face gpt2
    (GPTConfig.gpt2("medium"), 354_823_168),  # gpt2-medium
    (GPTConfig.llama("llama-2-7b"), 6_738_415_616),  # meta-llama/Llama-2-7b-hf
    (GPTConfig.llama("llama-3-8b"), 8_030_261_248),  # meta-llama/Meta-Llama-3-8B
    (GPTConfig.mixtral("mixtral-8x7b"), 46_702_792_704),  # mistralai/Mixtral-8x7B-v0.1
])
def test_presets_have_the_published_parameter_counts(preset, count):
    """The models built at 1 and 2 layers, extrapolated (every block is the same)."""
    def params(layers):
        cfg = dataclasses.replace(preset, num_layers=layers)
        model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
        return sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))

    one, two = params(1), params(2)
    assert one + (preset.num_layers - 1) * (two - one) == count


def test_bad_checkpoints_are_named_before_anything_is_placed(monkeypatch):
    tensors = load_file(FIXTURES / "llama" / "model.safetensors")
    config = json.loads((FIXTURES / "llama" / "config.json").read_text())
    placed = []
    real = jax.make_array_from_callback
    monkeypatch.setattr(jax, "make_array_from_callback",
                        lambda *a: placed.append(a) or real(*a))
    k = "model.layers.1.self_attn.k_proj.weight"
    cases = [
        ({**tensors, k: tensors[k][:4]}, rf"{k} has shape \(4, 32\), but "
                                          r"blocks/1/attention/qkv/kv_kernel \(32, 16\) needs "
                                          r"\(8, 32\)"),
        ({n: t for n, t in tensors.items() if n != "model.norm.weight"},
         r"model.norm.weight \(for final_norm/scale\) is missing"),
        ({**tensors, "model.layers.0.extra.weight": tensors[k]},
         r"unknown tensors \['model.layers.0.extra.weight'\]"),
        ({**tensors, k: tensors[k].astype(np.int32)}, f"{k} has dtype int32"),
    ]
    with jax.set_mesh(make_mesh(2, 4)):
        for state, match in cases:
            with pytest.raises(ValueError, match=match):
                hf.from_hf(state, config)
        assert not placed  # nothing was placed
        # bf16 tensors fit fp32 parameters exactly; fp32 ones need param_dtype= for bf16
        half = {n: t.astype(ml_dtypes.bfloat16) for n, t in tensors.items()}
        model = hf.from_hf(half, config)
        assert model.embed.embedding[...].dtype == jnp.float32
        with pytest.raises(ValueError, match="float32, which .* cannot hold exactly"):
            hf.from_hf(tensors, {**config, "dtype": "bfloat16"})
        model = hf.from_hf(tensors, {**config, "dtype": "bfloat16"},
                           param_dtype=jnp.bfloat16)
        assert model.embed.embedding[...].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="a state dict needs config_json"):
        hf.from_hf(tensors)


@pytest.mark.slow
def test_sharded_checkpoint_directory(tmp_path):
    """to_hf(max_shard_bytes=...) writes shards with an index; from_hf reads them."""
    with jax.set_mesh(make_mesh(2, 4)):
        model = hf.from_hf(FIXTURES / "llama")
        hf.to_hf(model, tmp_path, max_shard_bytes=20_000)
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
        again = hf.from_hf(tmp_path)
    assert_bitwise(param_values(model), param_values(again))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_to_hf_strictly(family, tmp_path):
    """Where torch and transformers are installed (not in CI: the fixtures script's
    environment), a to_hf directory loads with no missing or unexpected tensors, gives
    sp_jax's logits and keeps the special token ids in its model and generation
    configs."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    golden = np.load(FIXTURES / family / "golden.npz")
    first, _, parallel = _meshes(family)
    with jax.set_mesh(first):
        model = hf.from_hf(FIXTURES / family, parallel=parallel)
        hf.to_hf(model, tmp_path)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = loaded.eval()(input_ids=torch.from_numpy(
            golden["input_ids"].astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(logits, golden["logits"], rtol=1e-5, atol=1e-5)
    source = _config(family)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(loaded.config, key) == getattr(loaded.generation_config, key) == \
            source.get(key), key
