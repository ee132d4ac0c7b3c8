"""QLoRA: the frozen base stored as int8, fp8 or nf4 (``LoRAConfig(base_dtype=...)``) and
dequantised inside each GEMM's op. Each format's dequantisation equals a NumPy
transcription of the format bit for bit, and its error against the fp32 weights is
reported; an adapted model with a quantized base computes what the same model with the
dequantised kernels in full precision computes (loss and adapter gradients, sharded and
unsharded, with fsdp); merged and read from a checkpoint."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _util import compiled_logits, perturb_adapters, to_host
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.layers.lora import LoRAParam, QuantizedBase
from sp_jax.models import GPT, GPTConfig, hf
from sp_jax.models import lora as model_lora
from sp_jax.ops.quant import FORMATS, block_sizes, dequantize, quantize

pytestmark = pytest.mark.slow  # (the fast tier is full: make test-fast's budget)

NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)  # QLoRA's Appendix E, as bitsandbytes


def _reference(w: np.ndarray, kind: str, block: int, scale_block: int) -> np.ndarray:
    """The format in NumPy, loop by block: quantise then dequantise ``w [in, out]``."""
    rows, cols = w.shape
    out = np.zeros_like(w)
    absmax = np.zeros((rows // block, cols), np.float32)
    codes = np.zeros_like(w)
    for c in range(cols):
        for b in range(rows // block):
            x = w[b * block:(b + 1) * block, c]
            s = np.float32(np.max(np.abs(x)))
            absmax[b, c] = s
            safe = s if s > 0 else np.float32(1)
            if kind == "int8":
                codes[b * block:(b + 1) * block, c] = np.round(x / safe * np.float32(127))
            elif kind == "fp8":
                codes[b * block:(b + 1) * block, c] = (x / safe * np.float32(448)).astype(
                    ml_dtypes.float8_e4m3fn).astype(np.float32)
            else:
                codes[b * block:(b + 1) * block, c] = np.argmin(
                    np.abs((x / safe)[:, None] - NF4[None]), axis=1)
    if kind == "nf4":  # the absmaxes double-quantised, per group of scale_block blocks
        for c in range(cols):
            for g in range(rows // block // scale_block):
                s = absmax[g * scale_block:(g + 1) * scale_block, c]
                mean = np.float32(np.mean(s, dtype=np.float32))
                centred = s - mean
                s2 = np.float32(np.max(np.abs(centred)))
                q = np.round(centred / (s2 if s2 > 0 else np.float32(1)) * np.float32(127))
                absmax[g * scale_block:(g + 1) * scale_block, c] = \
                    q * (s2 * np.float32(1 / 127)) + mean
    for c in range(cols):
        for b in range(rows // block):
            rows_b = slice(b * block, (b + 1) * block)
            if kind == "nf4":
                values = NF4[codes[rows_b, c].astype(int)]
            else:
                values = codes[rows_b, c] * np.float32(1 / (127 if kind == "int8" else 448))
            out[rows_b, c] = values * absmax[b, c]
    return out


@pytest.mark.parametrize("kind", FORMATS)
def test_dequantisation_equals_the_numpy_format_and_its_error(kind):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((128, 12)) * rng.uniform(0.1, 3, (1, 12))).astype(np.float32)
    w[:16, 0] = 0.0  # an all-zero block
    block, scale_block = 16, 4
    q = quantize(jnp.asarray(w), kind, block=block, scale_block=scale_block)
    got = np.asarray(dequantize(q, jnp.float32))
    want = _reference(w, kind, block, scale_block)
    np.testing.assert_array_equal(got, want)
    error = np.sqrt(np.mean((got - w) ** 2)) / np.sqrt(np.mean(w ** 2))
    big = quantize(jnp.ones((16384, 2)), kind)  # the default blocks: 64 rows, nf4 256 of them
    per_value = sum(x.nbytes for x in jax.tree.leaves(big)) / (16384 * 2)
    print(f"{kind}: relative RMS error {error:.4f}, {per_value:.4f} bytes a value")
    assert error < {"int8": 0.01, "fp8": 0.05, "nf4": 0.12}[kind]
    assert per_value == {"int8": 1 + 4 / 64, "fp8": 1 + 4 / 64,
                         "nf4": 0.5 + 1 / 64 + 8 / 64 / 256}[kind]


def test_block_sizes_fit_a_shard():
    assert block_sizes(8192) == (64, 128)
    assert block_sizes(1024) == (64, 16)
    assert block_sizes(24) == (8, 1)
    with pytest.raises(ValueError, match="block_sizes"):
        quantize(jnp.ones((24, 4)), "nf4", block=16)


def _config(kind, kv=2, **kw):
    return GPTConfig.llama("llama-tiny", vocab_size=64, hidden=64, num_layers=2, num_heads=4,
                           num_kv_heads=kv, mlp_hidden=128, max_seq_len=16,
                           lora=sp_jax.LoRAConfig(rank=4, alpha=8, init_lora_weights=False,
                                                  base_dtype=kind), **kw)


def _dequantised_twin(model):
    """The same adapted model with every frozen base in fp32: the dequantised values."""
    lora = dataclasses.replace(model.config.lora, base_dtype=None)
    twin = GPT(dataclasses.replace(model.config, lora=lora), parallel=model.parallel,
               rngs=nnx.Rngs(0))
    nnx.update(twin, nnx.state(model, LoRAParam))
    modules = {p: m for p, m in nnx.iter_graph(twin)}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, QuantizedBase) or (isinstance(var, nnx.Param) and
                                               var.get_value().dtype == jnp.bfloat16):
            value = jax.tree.map(np.asarray, var.get_value())
            full = dequantize(value, jnp.float32) if isinstance(var, QuantizedBase) else \
                value.astype(np.float32)
            getattr(modules[path[:-1]], path[-1]).set_value(
                jax.device_put(full, getattr(modules[path[:-1]], path[-1])[...].sharding))
    return twin


@pytest.mark.parametrize("kind", ("bf16", *FORMATS))
@pytest.mark.parametrize("shape,parallel,scan", [((1, 1), {}, False), ((2, 4), {}, False),
                                                 ((2, 2), dict(fsdp=True), False),
                                                 ((2, 2), dict(fsdp=True), True)])
def test_quantized_base_computes_the_dequantised_model(kind, shape, parallel, scan):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 16)))
    f = nnx.jit(nnx.value_and_grad(lambda m, t: m.loss(t, t),
                                   argnums=nnx.DiffState(0, LoRAParam)))
    with jax.set_mesh(make_mesh(*shape)):
        model = GPT(_config(kind, scan_layers=scan, remat=scan),
                    parallel=sp_jax.ParallelConfig(**parallel), rngs=nnx.Rngs(0))
        held = [v for _, v in nnx.iter_graph(model) if isinstance(v, QuantizedBase)]
        # 2 layers: q, kv, out, up, down (scanned: one stack of each)
        assert len(held) == (0 if kind == "bf16" else 5 if scan else 10)
        (loss, grads), (want, want_grads) = f(model, tokens), f(_dequantised_twin(model),
                                                               tokens)
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    chex.assert_trees_all_close(to_host(nnx.to_pure_dict(grads)),
                                to_host(nnx.to_pure_dict(want_grads)), rtol=1e-5, atol=1e-6)


def test_qlora_from_a_checkpoint_merges_and_trains_adapters_only():
    import optax

    from sp_jax.training import TrainStep

    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 16)))
    with jax.set_mesh(make_mesh(2, 4)):
        base = hf.from_hf("tests/fixtures/hf/llama")
        model = hf.from_hf("tests/fixtures/hf/llama",
                           lora=sp_jax.LoRAConfig(rank=4, base_dtype="nf4"))
        assert model.config.lora.base_dtype == "nf4"
        assert not nnx.to_flat_state(nnx.state(model, nnx.All(
            nnx.Param, nnx.Not(LoRAParam), lambda path, v: path[-1] == "kernel")))
        # the quantization error alone (lora_b = 0): a few percent of the logits
        drift = np.abs(np.asarray(compiled_logits(model, tokens)) -
                       np.asarray(compiled_logits(base, tokens))).max()
        assert 0 < drift < 0.1
        perturb_adapters(model)
        np.testing.assert_allclose(
            np.asarray(compiled_logits(model_lora.merge(model), tokens)),
            np.asarray(compiled_logits(model, tokens)), rtol=1e-5, atol=1e-5)
        same = model_lora.apply(base, sp_jax.LoRAConfig(rank=4, base_dtype="nf4"))
        chex.assert_trees_all_equal(
            to_host(nnx.to_pure_dict(nnx.state(same, QuantizedBase))),
            to_host(nnx.to_pure_dict(nnx.state(model, QuantizedBase))))
        from sp_jax.models import generate

        prompts = [[1, 2, 3, 4], [5, 6, 7]]  # decoding dequantises in its ops too
        np.testing.assert_array_equal(
            np.asarray(generate(model, prompts, max_new_tokens=5).tokens),
            np.asarray(generate(model_lora.merge(model), prompts, max_new_tokens=5).tokens))
        step = TrainStep(model, optax.adam(1e-2))
        leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(step.params))[0]
        assert all("lora" in jax.tree_util.keystr(p) for p, _ in leaves)
        batch = {"tokens": np.asarray(tokens)[None], "labels": np.asarray(tokens)[None]}
        losses = [float(step(batch, jax.random.key(i))["loss"]) for i in range(4)]
        assert losses[-1] < losses[0]
