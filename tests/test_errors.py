"""The bad-input matrix: every documented bad input fails early, with a ValueError /
TypeError / RuntimeError that names the value and the fix. Each case has the id of its
row in docs/errors.md's "Bad inputs" table; a test checks the two lists agree."""

import json
import re
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.analysis import gpu_mesh
from sp_jax.data import ByteTokenizer, Documents, check_vocab, load_tokenizer
from sp_jax.layers import GroupedQKVProjection
from sp_jax.models import GPT, GPTConfig, decode, generate, hf
from sp_jax.models.blocks import Block
from sp_jax.pipeline import pipeline_schedule

LAYERS = [
    sp_jax.ColumnParallelLinear,
    sp_jax.RowParallelLinear,
    sp_jax.ColumnSequenceParallelLinear,
    sp_jax.RowSequenceParallelLinear,
]


def _file(name: str, content: bytes) -> str:
    """A new file ``name`` holding ``content``, in a fresh temporary directory."""
    path = Path(tempfile.mkdtemp()) / name
    path.write_bytes(content)
    return str(path)


GPT_BASE = dict(vocab_size=64, max_seq_len=16, num_layers=1, num_heads=4, hidden=32)


def _on(mesh_shape, fn):
    """Runs ``fn`` under a (data, tensor) mesh of the given shape."""
    with jax.set_mesh(make_mesh(*mesh_shape)):
        return fn()


def _on_context(mesh_shape, fn):
    """Runs ``fn`` under a (data, context, tensor) mesh of the given shape."""
    mesh = jax.make_mesh(mesh_shape, ("data", "context", "tensor"),
                         devices=jax.devices()[: int(np.prod(mesh_shape))])
    with jax.set_mesh(mesh):
        return fn()


_PIPE = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=2)


def _on_stages(fn):
    """Runs ``fn`` under a (stage, data, context, tensor) = (2, 1, 1, 4) mesh."""
    mesh = jax.make_mesh((2, 1, 1, 4), ("stage", "data", "context", "tensor"))
    with jax.set_mesh(mesh):
        return fn()


_LLAMA = Path(__file__).parent / "fixtures" / "hf" / "llama"


def _checkpoint(**files) -> str:
    """A copy of the Llama fixture directory with ``files`` (name -> bytes, or None to
    leave it out) replacing its own: a bad Hugging Face checkpoint."""
    directory = Path(tempfile.mkdtemp())
    for name in ("config.json", "model.safetensors"):
        (directory / name).write_bytes((_LLAMA / name).read_bytes())
    for name, content in files.items():
        name = name.replace("__", ".")
        if content is None:
            (directory / name).unlink()
        else:
            (directory / name).write_bytes(content)
    return str(directory)


def _without(key: str) -> bytes:
    config = json.loads((_LLAMA / "config.json").read_text())
    return json.dumps({k: v for k, v in config.items() if k != key}).encode()


def _layer(cls=sp_jax.ColumnSequenceParallelLinear, n_in=16, n_out=16, **kw):
    return cls(n_in, n_out, rngs=nnx.Rngs(0), **kw)


def _gpt(**kw):
    return GPT(GPTConfig(**{**GPT_BASE, **kw}), rngs=nnx.Rngs(0))


# The layers that take [batch, seq, hidden] activations besides the linear ones, each
# built for hidden size 32: name -> (row of a wrong hidden size, the argument naming it)
HIDDEN_LAYERS = {
    "LayerNorm": ("E48", "num_features"), "RMSNorm": ("E48", "num_features"),
    "CausalSelfAttention": ("E49", "hidden"), "GroupedQKVProjection": ("E49", "hidden"),
    "MLP": ("E50", "hidden"), "Block": ("E51", "hidden"),
}


def _hidden_32(name):
    rngs = nnx.Rngs(0)
    return {
        "LayerNorm": lambda: sp_jax.LayerNorm(32, rngs=rngs),
        "RMSNorm": lambda: sp_jax.RMSNorm(32, rngs=rngs),
        "CausalSelfAttention": lambda: sp_jax.CausalSelfAttention(
            sp_jax.AttentionConfig(32, 4), rngs=rngs),
        "GroupedQKVProjection": lambda: GroupedQKVProjection(
            sp_jax.AttentionConfig(32, 4, num_kv_heads=2), rngs=rngs),
        "MLP": lambda: sp_jax.MLP(sp_jax.MLPConfig(32, 64), rngs=rngs),
        "Block": lambda: Block(GPTConfig(**GPT_BASE), rngs=rngs),
    }[name]()


def _wrong_hidden(name):
    """The message pattern of a hidden size of 16 into ``name``'s layer, and the call."""
    what = HIDDEN_LAYERS[name][1]
    pattern = (rf"^{name}: input feature size 16 \(shape \(2, 8, 16\)\) does not match "
               rf"{what}=32; pass \[batch, seq, 32\] activations, or build the layer with "
               rf"{what}=16")
    return pattern, lambda: _on((2, 4), lambda: _hidden_32(name)(jnp.ones((2, 8, 16))))


def _tensor_only_mesh():
    mesh = jax.make_mesh((4,), ("tensor",), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        _layer()


# id -> (exception, message pattern, thunk)
CASES = {
    # mesh and configuration
    "E01": (ValueError, r"needs a device mesh, but none is set.*set_mesh",
            lambda: _layer()(jnp.ones((2, 8, 16)))),
    "E02": (ValueError, r"tensor axis 'model'.*not in the mesh axes \('data', 'tensor'\)",
            lambda: _on((2, 4), lambda: _layer(
                parallel=sp_jax.ParallelConfig(tensor_axis="model")))),
    "E03": (ValueError, r"data axis 'data'.*data_axis=None", _tensor_only_mesh),
    "E04": (ValueError, r"Unknown ParallelConfig key\(s\) \['tensor_size'\]; valid keys",
            lambda: sp_jax.ParallelConfig.from_dict({"tensor_size": 4})),
    "E05": (TypeError, r"recompute_allgather='yes' must be True or False",
            lambda: sp_jax.ParallelConfig(recompute_allgather="yes")),
    "E06": (ValueError, r"wgrad_dtype=.*int32.* must be a floating dtype",
            lambda: sp_jax.ParallelConfig(wgrad_dtype=jnp.int32)),
    "E07": (TypeError, r"parallel=\{'recompute_allgather': True\} must be a sp_jax.ParallelConfig",
            lambda: _layer(parallel={"recompute_allgather": True})),
    # shapes and divisibility
    "E08": (ValueError, r"out_features=30 is not divisible by the size 4 of mesh axis",
            lambda: _on((2, 4), lambda: _layer(sp_jax.ColumnParallelLinear, 16, 30))),
    "E09": (ValueError, r"in_features=30 is not divisible by the size 4 of mesh axis",
            lambda: _on((2, 4), lambda: _layer(sp_jax.RowSequenceParallelLinear, 30, 16))),
    "E10": (ValueError, r"sequence length=6 is not divisible by the size 4 of mesh axis "
                        r"'tensor'; pad the sequence",
            lambda: _on((2, 4), lambda: _layer()(jnp.ones((2, 6, 16))))),
    "E11": (ValueError, r"batch size=3 is not divisible by the size 2 .*data_axis=None",
            lambda: _on((2, 4), lambda: _layer()(jnp.ones((3, 8, 16))))),
    "E12": (ValueError, r"expects input of shape \[batch, seq, 16\], got rank 2",
            lambda: _on((2, 4), lambda: _layer()(jnp.ones((8, 16))))),
    "E13": (ValueError, r"input feature size 12 .* does not match in_features=16",
            lambda: _on((2, 4), lambda: _layer()(jnp.ones((2, 8, 12))))),
    "E14": (ValueError, r"in_features=0 must be a positive int",
            lambda: _layer(n_in=0)),
    "E15": (ValueError, r"num_heads=6 is not divisible by the size 4",
            lambda: _on((2, 4), lambda: sp_jax.CausalSelfAttention(sp_jax.AttentionConfig(24, 6),
                                                                   rngs=nnx.Rngs(0)))),
    "E16": (ValueError, r"hidden=30 must be divisible by num_heads=4",
            lambda: GPTConfig(**{**GPT_BASE, "hidden": 30})),
    # dtypes
    "E17": (TypeError, r"input dtype int32 is not floating point",
            lambda: _on((2, 4), lambda: _layer()(jnp.ones((2, 8, 16), jnp.int32)))),
    "E18": (TypeError, r"token ids must be integers, got dtype float32",
            lambda: _on((2, 4), lambda: sp_jax.VocabParallelEmbedding(
                64, 16, rngs=nnx.Rngs(0))(jnp.zeros((2, 8))))),
    # values
    "E19": (ValueError, r"token id 64 at position \(1, 2\) is outside \[0, 64\)",
            lambda: _on((2, 4), lambda: sp_jax.VocabParallelEmbedding(
                64, 16, rngs=nnx.Rngs(0))(np.zeros((2, 8), np.int32) + 64 * (
                    np.arange(16).reshape(2, 8) == 10)))),
    "E20": (ValueError, r"label 50 at position \(0, 0\) is outside \[0, 50\) \(or -100\)",
            lambda: _on((2, 4), lambda: sp_jax.parallel_cross_entropy(
                jnp.zeros((2, 8, 50)), np.full((2, 8), 50)))),
    "E21": (ValueError, r"sequence length 32 exceeds max_seq_len=16",
            lambda: _on((2, 4), lambda: _gpt()(np.zeros((2, 32), np.int32)))),
    "E22": (ValueError, r"label_smoothing=1.5 must be in \[0, 1\)",
            lambda: _on((2, 4), lambda: sp_jax.parallel_cross_entropy(
                jnp.zeros((2, 8, 64)), np.zeros((2, 8), np.int32), label_smoothing=1.5))),
    "E23": (ValueError, r"expects logits \[batch, seq, vocab\] and labels \[batch, seq\], got "
                        r"logits \(2, 8, 64\) and labels \(2, 4\)",
            lambda: _on((2, 4), lambda: sp_jax.parallel_cross_entropy(
                jnp.zeros((2, 8, 64)), np.zeros((2, 4), np.int32)))),
    "E24": (ValueError, r"Unknown GPTConfig key\(s\) \['n_layer'\]",
            lambda: GPTConfig.from_dict({**GPT_BASE, "n_layer": 2})),
    "E25": (ValueError, r"GPTConfig.dropout=1.0 must be in \[0, 1\)",
            lambda: GPTConfig(**{**GPT_BASE, "dropout": 1.0})),
    "E29": (ValueError, r"GPTConfig.norm='batchnorm' is not a known norm; use one of "
                        r"\['layernorm', 'rmsnorm'\]",
            lambda: GPTConfig(**{**GPT_BASE, "norm": "batchnorm"})),
    "E30": (ValueError, r"GPTConfig.positions='alibi' is not a known position encoding; use "
                        r"one of \['learned', 'rotary'\]",
            lambda: GPTConfig(**{**GPT_BASE, "positions": "alibi"})),
    # context parallelism (tests/test_context.py checks them on the GPT too)
    "E31": (ValueError, r"context_parallel='rings' is not a known kind of context "
                        r"parallelism; use one of \(None, 'ring', 'ulysses'\)",
            lambda: sp_jax.ParallelConfig(context_parallel="rings")),
    "E32": (ValueError, r"context_axis='tensor' is also the tensor or a data axis; context "
                        r"parallelism needs a mesh axis of its own",
            lambda: sp_jax.ParallelConfig(context_parallel="ring", context_axis="tensor")),
    "E33": (ValueError, r"context axis 'context'.*not in the mesh axes \('data', 'tensor'\)",
            lambda: _on((2, 4), lambda: _layer(
                parallel=sp_jax.ParallelConfig(context_parallel="ring")))),
    "E34": (ValueError, r"num_heads=4 is not divisible by.*tensor x context, or "
                        r"context_parallel='ring'",
            lambda: _on_context((1, 4, 2), lambda: GPT(
                GPTConfig(**GPT_BASE), parallel=sp_jax.ParallelConfig(
                    context_parallel="ulysses"), rngs=nnx.Rngs(0)))),
    "E35": (ValueError, r"ring context parallelism over 4 devices splits the sequence into 8 "
                        r"chunks.*sequence length=12 is not divisible by 8; pad the sequence",
            lambda: _on_context((1, 4, 1), lambda: GPT(
                GPTConfig(**GPT_BASE), parallel=sp_jax.ParallelConfig(
                    context_parallel="ring"), rngs=nnx.Rngs(0))(np.zeros((1, 12), np.int32)))),
    "E36": (ValueError, r"GPTConfig.attention_implementation='flash' is not a known kernel; "
                        r"use 'xla' \(every backend\) or 'cudnn' \(GPUs\)",
            lambda: GPTConfig(**{**GPT_BASE, "attention_implementation": "flash"})),
    "E37": (ValueError, r"attention_implementation='cudnn' cannot run ring attention.*use "
                        r"attention_implementation='xla' or context_parallel='ulysses'",
            lambda: _on_context((1, 2, 2), lambda: GPT(
                GPTConfig(**{**GPT_BASE, "attention_implementation": "cudnn",
                             "dtype": jnp.bfloat16}),
                parallel=sp_jax.ParallelConfig(context_parallel="ring"), rngs=nnx.Rngs(0)))),
    # sharding over data
    "E38": (ValueError, r"fsdp=True\) shards parameters over the data axes, but "
                        r"data_axis=None",
            lambda: sp_jax.ParallelConfig(fsdp=True, data_axis=None)),
    "E39": (ValueError, r"ColumnSequenceParallelLinear \(fsdp\): in_features=6 is not "
                        r"divisible by the size 4.*or fsdp=False",
            lambda: _on((4, 2), lambda: _layer(
                n_in=6, n_out=8, parallel=sp_jax.ParallelConfig(fsdp=True)))),
    # Llama-family models and Hugging Face checkpoints
    "E40": (ValueError, r"GPTConfig.num_kv_heads=3 must be a positive divisor of "
                        r"num_heads=4",
            lambda: GPTConfig(**{**GPT_BASE, "num_kv_heads": 3})),
    "E41": (ValueError, r"num_kv_heads=3 cannot be laid out over a tensor axis of size 2.*"
                        r"choose num_kv_heads a divisor or a multiple of 2",
            lambda: _on((4, 2), lambda: _gpt(num_heads=6, hidden=48, num_kv_heads=3))),
    "E42": (ValueError, r"key/value heads per tensor shard=1 is not divisible by the size 2"
                        r".*num_kv_heads a multiple of tensor x context",
            lambda: _on_context((1, 2, 2), lambda: GPT(
                GPTConfig(**{**GPT_BASE, "num_kv_heads": 2}),
                parallel=sp_jax.ParallelConfig(context_parallel="ulysses"),
                rngs=nnx.Rngs(0)))),
    "E43": (ValueError, r"attention_dropout=0.1 needs attention_implementation='xla'",
            lambda: _on((2, 4), lambda: _gpt(attention_dropout=0.1,
                                             attention_implementation="cudnn"))),
    "E44": (ValueError, r"GPTConfig.llama: name='llama-4' is not one of",
            lambda: GPTConfig.llama("llama-4")),
    "E45": (ValueError, r"config.json: model_type='bert' is not one sp_jax converts",
            lambda: hf.config_from_hf({"model_type": "bert"})),
    "E46": (ValueError, r"from_hf: the checkpoint does not match[\s\S]*model.norm.weight \(for "
                        r"final_norm/scale\) is missing",
            lambda: _on((2, 4), lambda: hf.from_hf({}, hf.config_to_hf(
                GPTConfig.llama("llama-tiny"))))),
    "E47": (ValueError, r"to_hf: this GPTConfig is neither GPT-2-shaped.*Llama-shaped",
            lambda: hf.config_to_hf(GPTConfig(**{**GPT_BASE, "positions": "rotary"}))),
    # hidden sizes of the other layers (tests below: every layer, rank too, under jit)
    "E48": (ValueError, *_wrong_hidden("LayerNorm")),
    "E49": (ValueError, *_wrong_hidden("CausalSelfAttention")),
    "E50": (ValueError, *_wrong_hidden("MLP")),
    "E51": (ValueError, *_wrong_hidden("Block")),
    # pipeline stages
    "E52": (ValueError, r"ParallelConfig.pipeline_schedule='zb' is not a known schedule; "
                        r"use one of \('gpipe', '1f1b'\)",
            lambda: sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_schedule="zb")),
    "E53": (ValueError, r"pipeline_microbatches, pipeline_repeats and pipeline_schedule need "
                        r"a pipeline; set pipeline_axis",
            lambda: sp_jax.ParallelConfig(pipeline_microbatches=4)),
    "E54": (ValueError, r"pipeline axis 'stage' \(ParallelConfig.pipeline_axis\) is not in "
                        r"the mesh axes \('data', 'tensor'\)",
            lambda: _on((2, 4), lambda: GPT(GPTConfig(**{**GPT_BASE, "scan_layers": True}),
                                            parallel=_PIPE, rngs=nnx.Rngs(0)))),
    "E55": (ValueError, r"pipeline_axis='stage'\) needs GPTConfig\(scan_layers=True\)",
            lambda: _on_stages(lambda: GPT(GPTConfig(**GPT_BASE), parallel=_PIPE,
                                           rngs=nnx.Rngs(0)))),
    "E56": (ValueError, r"GPT: num_layers=1 is not divisible by stages x pipeline_repeats = "
                        r"2 x 1 = 2; use a multiple of 2 layers",
            lambda: _on_stages(lambda: GPT(GPTConfig(**{**GPT_BASE, "scan_layers": True}),
                                           parallel=_PIPE, rngs=nnx.Rngs(0)))),
    "E57": (ValueError, r"pipeline_microbatches=3 must be a multiple of the 2 stages with "
                        r"pipeline_repeats=2",
            lambda: pipeline_schedule("1f1b", 2, 3, 2)),
    # text data and packed documents
    "E58": (ValueError, r"docs.jsonl:2: no field 'text' \(fields: 'body'\); pass "
                        r"--text-field",
            lambda: Documents.from_paths(_file("docs.jsonl", b'{"text": "a"}\n{"body": "b"}\n'))),
    "E59": (ValueError, r"docs.jsonl:1: not UTF-8 text",
            lambda: Documents.from_paths(_file("docs.jsonl", b'{"text": "caf\xe9"}\n'))),
    "E60": (ValueError, r"no documents in .*empty\.txt",
            lambda: Documents.from_paths(_file("empty.txt", b""))),
    "E61": (ValueError, r"tokenizer .*tok\.json does not load as a Hugging Face tokenizer\.json",
            lambda: load_tokenizer(_file("tok.json", b"{not json"))),
    "E62": (ValueError, r"tokenizer bytes has 257 ids but the model's vocabulary is 256",
            lambda: check_vocab(ByteTokenizer(), 256)),
    "E63": (ValueError, r"GPT: segment_ids must be integers of the tokens' shape \(2, 8\)",
            lambda: _on((1, 1), lambda: _gpt().loss(
                jnp.zeros((2, 8), jnp.int32), segment_ids=jnp.zeros((2, 7), jnp.int32)))),
    "E64": (ValueError, r"segment_ids \(packed documents\) need implementation='xla'",
            lambda: sp_jax.attention.blockwise_attention(
                *(jnp.zeros((1, 8, 2, 4)),) * 3, implementation="cudnn",
                segment_ids=jnp.ones((1, 8), jnp.int32))),
    # Hugging Face checkpoint files (one line naming the file, and the key)
    "E65": (ValueError, r"from_hf: .*model\.safetensors is not a readable safetensors file "
                        r"\(Error while deserializing header: incomplete metadata, file not "
                        r"fully covered\): truncated",
            lambda: hf.from_hf(_checkpoint(model__safetensors=(
                _LLAMA / "model.safetensors").read_bytes()[:30_000]))),
    "E66": (ValueError, r"from_hf: .*model\.safetensors is not a readable safetensors file "
                        r"\(Error while deserializing header: invalid JSON in header",
            lambda: hf.from_hf(_checkpoint(
                model__safetensors=b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}..."))),
    "E67": (FileNotFoundError, r"from_hf: .*config\.json is missing \(a Hugging Face "
                               r"checkpoint directory holds config\.json",
            lambda: hf.from_hf(_checkpoint(config__json=None))),
    "E68": (ValueError, r"from_hf: .*config\.json is not valid JSON \(Expecting .* at line 1 "
                        r"column 2\)",
            lambda: hf.from_hf(_checkpoint(config__json=b"{model_type: llama}"))),
    "E69": (ValueError, r"/config\.json: the key 'hidden_size' is missing \(a llama "
                        r"config\.json needs it",
            lambda: hf.from_hf(_checkpoint(config__json=_without("hidden_size")))),
    "E70": (FileNotFoundError, r"no \*\.safetensors in .* \(it holds pytorch_model\.bin: "
                               r"sp_jax reads safetensors only\); with transformers, "
                               r"AutoModelForCausalLM\.from_pretrained\(dir\)"
                               r"\.save_pretrained\(out\) writes model\.safetensors \(its "
                               r"default in 4\.x and 5\.x\)",
            lambda: hf.from_hf(_checkpoint(model__safetensors=None,
                                           pytorch_model__bin=b"torch"))),
    "E71": (ValueError, r"config\.json: layer_types\[1\]='chunked_attention' is not a layer "
                        r"type sp_jax reads",
            lambda: hf.config_from_hf({**hf.config_to_hf(GPTConfig.llama(
                "llama-tiny", qkv_bias=True, out_bias=False)), "model_type": "qwen2",
                "use_sliding_window": True, "sliding_window": 8,
                "layer_types": ["full_attention", "chunked_attention"]})),
    "E72": (ValueError, r"ring_attention: sliding_window=0 must be a positive int",
            lambda: sp_jax.attention.ring_attention(
                *(jnp.zeros((1, 4, 2, 8)),) * 3, axis_name="context", sliding_window=0)),
    "E73": (ValueError, r"GPTConfig.sliding_window=0 must be a positive int",
            lambda: GPTConfig(**{**GPT_BASE, "sliding_window": 0})),
    # generation
    "E74": (ValueError, r"decode: the model has ParallelConfig\(pipeline_axis='stage'\); "
                        r"prefill and decode_step run on its re-layout without stages, "
                        r"decode.unpipelined\(model\)",
            lambda: _on_stages(lambda: decode.prefill(GPT(
                GPTConfig(**{**GPT_BASE, "num_layers": 2, "scan_layers": True}),
                parallel=sp_jax.ParallelConfig(pipeline_axis="stage"), rngs=nnx.Rngs(0)),
                jnp.zeros((2, 4), jnp.int32), jnp.array([1, 2]), 8))),
    "E75": (ValueError, r"generate: token ids must be in \[0, 64\) \(the model's vocab_size\)",
            lambda: _on((1, 4), lambda: generate(_gpt(), [[1, 64]], max_new_tokens=2))),
    "E76": (ValueError, r"generate: sampling \(temperature > 0\) needs rngs=",
            lambda: _on((1, 4), lambda: generate(_gpt(), [[1]], max_new_tokens=2,
                                                 temperature=0.7))),
    "E77": (ValueError, r"generate: the longest prompt \(3 tokens, padded to 4\) and "
                        r"max_new_tokens=20 reach position 21, outside the learned position "
                        r"table of max_seq_len=16",
            lambda: _on((1, 4), lambda: generate(_gpt(), [[1, 2, 3]], max_new_tokens=20))),
    "E78": (ValueError, r"GPTConfig.attention='latent' is not a registered attention; use "
                        r"one of \['mha'.*register_attention\(name, cls\)",
            lambda: GPTConfig(**GPT_BASE, attention="latent")),
    "E79": (ValueError, r"implementation='cudnn' needs values of the keys' head size .* use "
                        r"implementation='xla' for a value head size of its own",
            lambda: sp_jax.attention.blockwise_attention(
                jnp.ones((1, 8, 2, 8)), jnp.ones((1, 8, 2, 8)), jnp.ones((1, 8, 2, 16)),
                implementation="cudnn")),
    "E80": (ValueError, r"GPTConfig: attention_implementation='cudnn' computes attention in "
                        r"float32 \(dtype=float32\), but cuDNN's fused attention takes float16 "
                        r"or bfloat16 only; use dtype=jnp.bfloat16 .* or "
                        r"attention_implementation='xla'",
            lambda: GPTConfig(**GPT_BASE, attention_implementation="cudnn")),
    "E81": (ValueError, r"ulysses_attention: implementation='cudnn' takes float16 or bfloat16 "
                        r"q, k and v \(cuDNN's fused attention\), got float32, float32, float32: "
                        r".*or use implementation='xla'",
            lambda: _on_context((1, 2, 1), lambda: jax.shard_map(
                lambda x: sp_jax.attention.ulysses_attention(
                    x, x, x, axis_name="context", implementation="cudnn"),
                in_specs=jax.P(None, "context"), out_specs=jax.P(None, "context"))(
                    jax.device_put(jnp.ones((1, 8, 2, 4)), jax.P(None, "context"))))),
    # tools
    "E26": (ValueError, r"Unknown GPU target 'a100'; known targets",
            lambda: gpu_mesh((8,), ("tensor",), target="a100")),
    "E27": (RuntimeError, r"before",
            lambda: sp_jax.xla_flags.apply_xla_flags()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case):
    exc, pattern, thunk = CASES[case]
    with pytest.raises(exc, match=pattern):
        thunk()


def test_docs_table_lists_exactly_these_cases():
    table = (Path(__file__).parent.parent / "docs" / "errors.md").read_text()
    table_ids = set(re.findall(r"^\| (E\d\d) \|", table, flags=re.M))
    assert table_ids == set(CASES) | {"E28"}  # E28: wrong checkpoint, tests/test_checkpoint.py
    assert len(table_ids) >= 15


# -- the same errors through jit, and on every layer -------------------------------------


@pytest.mark.parametrize("cls", LAYERS)
def test_every_layer_checks_rank_and_features(mesh_2x4, cls):
    with jax.set_mesh(mesh_2x4):
        layer = cls(16, 16, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"got rank 2"):
            layer(jnp.ones((8, 16)))
        with pytest.raises(ValueError, match="input feature size 12"):
            nnx.jit(lambda m, x: m(x))(layer, jnp.ones((2, 8, 12)))


@pytest.mark.parametrize("name", list(HIDDEN_LAYERS))
def test_every_other_layer_checks_rank_and_hidden_size(mesh_2x4, name):
    """E12 and E48-E51 on every layer taking activations, at trace time: under jit, and
    before any shape error from inside JAX; the right shape passes."""
    what = HIDDEN_LAYERS[name][1]
    with jax.set_mesh(mesh_2x4):
        layer = _hidden_32(name)
        with pytest.raises(ValueError, match=rf"^{name} expects input of shape \[batch, seq, "
                                             r"32\], got rank 2 shape \(8, 32\); reshape"):
            layer(jnp.ones((8, 32)))
        with pytest.raises(ValueError, match=rf"^{name}: input feature size 16 \(shape "
                                             rf"\(2, 8, 16\)\) does not match {what}=32"):
            nnx.jit(lambda m, x: m(x))(layer, jnp.ones((2, 8, 16)))
        out = nnx.eval_shape(lambda m, x: m(x), layer, jnp.ones((2, 8, 32)))
    assert out.shape[:2] == (2, 8)


@pytest.mark.parametrize("call", [
    lambda p: sp_jax.LayerNorm(32, parallel=p, rngs=nnx.Rngs(0))(jnp.ones((2, 8, 32))),
    lambda p: sp_jax.Dropout(0.5, parallel=p)(jnp.ones((2, 8, 32)), rngs=nnx.Rngs(0)),
    lambda p: sp_jax.parallel_cross_entropy(jnp.zeros((2, 8, 64)), np.zeros((2, 8), np.int32),
                                            parallel=p),
], ids=["norm", "dropout", "cross_entropy"])
def test_dict_parallel_is_a_type_error_everywhere(mesh_2x4, call):
    """E07 where the parallel config is first used at the call."""
    with jax.set_mesh(mesh_2x4), pytest.raises(TypeError, match=r"parallel=\{'recompute_"
                                                              r"allgather': True\} must be a"):
        call({"recompute_allgather": True})


def test_errors_raise_at_trace_time_under_jit(mesh_2x4):
    with jax.set_mesh(mesh_2x4):
        layer = sp_jax.RowSequenceParallelLinear(16, 16, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="sequence length=6"):
            nnx.jit(lambda m, x: m(x))(layer, jnp.ones((2, 6, 16)))


def test_features_checked_at_first_call_when_built_without_mesh(mesh_2x4):
    layer = sp_jax.ColumnParallelLinear(16, 30, rngs=nnx.Rngs(0))  # no mesh: no check yet
    with jax.set_mesh(mesh_2x4):
        with pytest.raises(ValueError, match="out_features=30"):
            layer(jnp.ones((2, 8, 16)))


def test_out_of_range_ids_and_labels_give_nan_under_jit(mesh_2x4):
    """Inside jit the values cannot be inspected: the loss becomes NaN, never wrong."""
    tokens = np.zeros((2, 16), np.int32)
    bad_tokens = tokens.copy()
    bad_tokens[1, 3] = 64
    bad_labels = tokens.copy()
    bad_labels[0, 5] = 70
    with jax.set_mesh(mesh_2x4):
        model = _gpt()
        loss = nnx.jit(lambda m, t, y: m.loss(t, y))
        assert np.isfinite(float(loss(model, tokens, tokens)))
        assert np.isnan(float(loss(model, bad_tokens, tokens)))
        assert np.isnan(float(loss(model, tokens, bad_labels)))
        ignored = tokens.copy()
        ignored[0, 5] = -100
        assert np.isfinite(float(loss(model, tokens, ignored)))


def test_op_shape_errors():
    with pytest.raises(ValueError, match="must equal the kernel's input dimension 8"):
        sp_jax.ops.matmul(jnp.ones((2, 4)), jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="seq_dim must not be the feature"):
        sp_jax.ops.column_sequence_parallel_matmul(
            jnp.ones((2, 4, 8)), jnp.ones((8, 3)), axis_name="tensor", seq_dim=-1)
    with pytest.raises(ValueError, match=r"bias must have shape \(3,\)"):
        sp_jax.ops.column_sequence_parallel_matmul(
            jnp.ones((2, 4, 8)), jnp.ones((8, 3)), jnp.ones(4), axis_name="tensor")


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_bad_feature_arguments(value):
    with pytest.raises(ValueError, match=f"in_features={value!r}"):
        sp_jax.ColumnParallelLinear(value, 16, rngs=nnx.Rngs(0))
