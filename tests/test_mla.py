"""Multi-head latent attention (``attention="mla"``, :mod:`sp_jax.layers.mla`): the layer
against transformers' ``DeepseekV3Attention`` (golden fixtures of
``scripts/make_mla_fixtures.py``: outputs and gradients, with and without
``q_lora_rank``, interleaved rotary weights), unsharded and on (data, tensor) and (data,
context, tensor) meshes with ring and Ulysses attention; a DeepSeek-V3-shaped GPT's
logits and greedy tokens against transformers'; training and generation sharded as on
one device; the latent cache's layout; DeepSeek's softmax scale."""

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import copy_weights, param_values, to_host, train_gpt
from conftest import requires_cuda_plugin
from flax import nnx
from jax.sharding import AxisType

import sp_jax
from sp_jax.attention import sequence_order
from sp_jax.layers import (
    AttentionConfig,
    LatentCache,
    MultiHeadLatentAttention,
    deinterleave_rope,
    mla_softmax_scale,
)
from sp_jax.models import GPT, GPTConfig, generate
from sp_jax.models.decode import prefill

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "mla"
SHAPE = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
# the layouts: (data, context, tensor) sizes and the context-parallel mode
MESHES = {"one": ((1, 1, 1), None), "data_tensor": ((2, 1, 4), None),
          "ring": ((2, 2, 2), "ring"), "ulysses": ((1, 2, 2), "ulysses")}


def _mesh(data, context, tensor):
    return jax.make_mesh((data, context, tensor), ("data", "context", "tensor"),
                         axis_types=(AxisType.Explicit,) * 3,
                         devices=jax.devices()[: data * context * tensor])


def _parallel(mode):
    if mode is None:
        return sp_jax.ParallelConfig()
    return sp_jax.ParallelConfig(context_axis="context", context_parallel=mode)


def _attention_values(w, prefix, interleave, q_lora):
    """sp_jax's attention parameters from transformers' ``w/<prefix>...`` weights."""
    def t(name):
        return np.asarray(w[prefix + name + ".weight"]).T

    qk, p, r = 12, 4, 16
    fix = (lambda k, width: deinterleave_rope(k, width, p)) if interleave else (
        lambda k, width: k)
    qkv = {"kv_a_kernel": fix(t("kv_a_proj_with_mqa"), r + p),
           "kv_a_norm": np.asarray(w[prefix + "kv_a_layernorm.weight"]),
           "kv_b_kernel": t("kv_b_proj")}
    if q_lora:
        qkv.update(q_a_kernel=t("q_a_proj"), q_a_norm=np.asarray(w[prefix + "q_a_layernorm"
                                                                   ".weight"]),
                   q_b_kernel=fix(t("q_b_proj"), qk))
    else:
        qkv["q_kernel"] = fix(t("q_proj"), qk)
    return {"qkv": qkv, "out": {"kernel": t("o_proj")}}


def _fixture(name):
    d = np.load(FIXTURES / f"attention_{name}.npz")
    return {k: d[k] for k in d.files}


def _layer_out_and_grads(name, mesh_name):
    d = _fixture(name)
    q_lora = name == "qlora"
    cfg = AttentionConfig(32, 4, rotary=True, norm="rmsnorm", norm_epsilon=1e-6,
                          out_bias=False, attention="mla", attention_block_q=4,
                          attention_block_k=4, q_lora_rank=12 if q_lora else None, **SHAPE)
    sizes, mode = MESHES[mesh_name]
    w = {k[2:]: v for k, v in d.items() if k.startswith("w/")}
    values = {**_attention_values(w, "attn.", q_lora, q_lora),
              "norm": {"scale": w["norm.weight"]}}
    mesh = _mesh(*sizes)
    # the sequence held in ring attention's zigzag order (None: the natural order)
    order = sequence_order(_parallel(mode), mesh, 16)
    held = slice(None) if order is None else order
    with jax.set_mesh(mesh):
        layer = MultiHeadLatentAttention(cfg, parallel=_parallel(mode), rngs=nnx.Rngs(0))
        copy_weights(layer, values)

        def f(layer, x, cot):
            def loss(m, x):
                y = m(x)
                return jnp.sum(y * cot), y
            (_, y), (g_layer, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
                layer, x)
            return y, g_x, nnx.to_pure_dict(nnx.state(g_layer, nnx.Param))

        y, g_x, grads = to_host(nnx.jit(f)(layer, jnp.asarray(d["x"][:, held]),
                                           jnp.asarray(d["cotangent"][:, held])))
    d["y"], d["grad/x"] = d["y"][:, held], d["grad/x"][:, held]
    return d, w, (y, g_x, grads)


@pytest.mark.parametrize("name,mesh_name", [  # the fast tier: q_lora on every mesh
    pytest.param(name, mesh, marks=[pytest.mark.slow] if name == "direct" and mesh != "one"
                 else []) for mesh in MESHES for name in ("qlora", "direct")])
def test_layer_matches_transformers(name, mesh_name):
    """``x + attention(norm(x))`` and the gradients of the input and of every weight equal
    transformers' ``DeepseekV3Attention`` (fp32, 1e-5), on one device and sharded."""
    d, w, (y, g_x, grads) = _layer_out_and_grads(name, mesh_name)
    np.testing.assert_allclose(y, d["y"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_x, d["grad/x"], rtol=1e-5, atol=1e-5)
    q_lora = name == "qlora"
    want = _attention_values({k[5:]: v for k, v in d.items() if k.startswith("grad/")},
                             "attn.", q_lora, q_lora)
    want["norm"] = {"scale": d["grad/norm.weight"]}
    _close(grads, want)


def _close(got, want):
    """Each leaf equal to 1e-5 of its largest entry (fp32 summation orders differ)."""
    jax.tree.map(lambda g, w: np.testing.assert_allclose(
        g, w, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(w).max()))), got, want)


def test_softmax_scale_equals_transformers():
    """:func:`mla_softmax_scale` equals transformers' ``yarn_apply_mscale``."""
    rows = json.loads((FIXTURES / "mscale.json").read_text())
    for row in rows:
        np.testing.assert_allclose(mla_softmax_scale(row["qk_head_dim"], row["rope"]),
                                   row["scale"], rtol=1e-12)


def test_config_checks():
    """The MLA fields are checked at construction, naming the field and the fix."""
    base = dict(vocab_size=64, max_seq_len=32, num_layers=2, num_heads=4, hidden=32,
                positions="rotary", norm="rmsnorm")
    with pytest.raises(ValueError, match="GPTConfig.kv_lora_rank=None must be a positive int"):
        GPTConfig(**base, attention="mla")
    with pytest.raises(ValueError, match="qk_rope_head_dim=3 must be even"):
        GPTConfig(**base, attention="mla", **{**SHAPE, "qk_rope_head_dim": 3})
    with pytest.raises(ValueError, match=r"\['kv_lora_rank'\] are multi-head latent"):
        GPTConfig(**base, kv_lora_rank=16)
    with pytest.raises(ValueError, match="qkv_bias and qk_norm"):
        MultiHeadLatentAttention(AttentionConfig(32, 4, attention="mla", qkv_bias=True,
                                                 **SHAPE), rngs=nnx.Rngs(0))


# -- the model ---------------------------------------------------------------------------

V = 64
MODEL = dict(vocab_size=V, max_seq_len=64, num_layers=2, num_heads=4, hidden=32,
             mlp_hidden=48, positions="rotary", norm="rmsnorm", norm_epsilon=1e-6,
             mlp_activation="swiglu", mlp_bias=False, out_bias=False, tie_embeddings=False,
             attention="mla", q_lora_rank=12, attention_block_q=4, attention_block_k=4,
             **SHAPE)


def _model_values(cfg):
    """sp_jax's GPT parameters from the fixture's transformers DeepseekV3ForCausalLM."""
    d = np.load(FIXTURES / "model.npz")
    w = {k[2:]: d[k] for k in d.files if k.startswith("w/")}
    blocks = []
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        gate, up = w[pre + "mlp.gate_proj.weight"].T, w[pre + "mlp.up_proj.weight"].T
        blocks.append({
            "attention": {**_attention_values(w, pre + "self_attn.", True, True),
                          "norm": {"scale": w[pre + "input_layernorm.weight"]}},
            "mlp": {"norm": {"scale": w[pre + "post_attention_layernorm.weight"]},
                    "up": {"kernel": np.stack([gate, up], -1).reshape(32, -1)},
                    "down": {"kernel": w[pre + "mlp.down_proj.weight"].T}}})
    values = {"blocks": jax.tree.map(lambda *a: np.stack(a), *blocks) if cfg.scan_layers
              else dict(enumerate(blocks)),
              "embed": {"embedding": w["model.embed_tokens.weight"]},
              "final_norm": {"scale": w["model.norm.weight"]},
              "head": {"embedding": w["lm_head.weight"]}}
    return d, values


def _check_names(model, values):
    got = jax.tree.map(np.shape, param_values(model))
    want = jax.tree.map(np.shape, values)
    assert got == want, (got, want)


@pytest.mark.parametrize("mesh_name", ["one", pytest.param("ring", marks=pytest.mark.slow),
                                       pytest.param("ulysses", marks=pytest.mark.slow)])
def test_model_logits_and_greedy_tokens_equal_transformers(mesh_name):
    """A 2-layer DeepSeek-V3-shaped GPT (MLA with ``q_lora_rank``, interleaved rotary
    weights, dense SwiGLU MLPs) holding the fixture's weights: its logits equal
    transformers' ``DeepseekV3ForCausalLM`` (1e-5 of the largest) and greedy generation
    (absorbed decode over the latent cache, split over the context axis when there is
    one) gives transformers' tokens."""
    sizes, mode = MESHES[mesh_name]
    cfg = GPTConfig(**MODEL, scan_layers=mode == "ring")
    d, values = _model_values(cfg)
    with jax.set_mesh(_mesh(*sizes)):
        model = GPT(cfg, parallel=_parallel(mode), rngs=nnx.Rngs(0))
        _check_names(model, values)
        copy_weights(model, values)
        model.eval()
        logits = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(d["input_ids"])))
        np.testing.assert_allclose(logits, d["logits"], rtol=0,
                                   atol=1e-5 * np.abs(d["logits"]).max())
        prompts = [d[f"gen_prompt_{i}"].tolist() for i in range(3)]
        got = generate(model, prompts, max_new_tokens=12).tokens
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(got[i]), d[f"gen_tokens_{i}"])


@pytest.mark.parametrize("mesh_name", [pytest.param("one", marks=pytest.mark.slow), "ring"])
def test_expanded_decode_equals_absorbed(mesh_name):
    """``mla_absorb=False`` (each step up-projects the cached latent into per-head keys
    and values) gives the absorbed decode's logits (fp32, 1e-5 of the largest) and both
    the forward's over the whole sequence; the cache is the latent either way. On the
    ring mesh the cache is split over the context axis, the heads over the tensor axis."""
    from _util import cache_and_forward_logits
    sizes, mode = MESHES[mesh_name]
    rng = np.random.default_rng(3)
    full = rng.integers(0, V, (2, 16)).astype(np.int32)
    lengths, steps = np.array([3, 6]), 5
    got = {}
    for absorb in (True, False):
        cfg = GPTConfig(**MODEL, scan_layers=True, mla_absorb=absorb)
        _, values = _model_values(cfg)
        with jax.set_mesh(_mesh(*sizes)):
            model = copy_weights(GPT(cfg, parallel=_parallel(mode), rngs=nnx.Rngs(0)),
                                 values)
            model.eval()
            got[absorb] = cache_and_forward_logits(model, full, lengths, steps)
    forward = got[True][1][np.arange(2), lengths + steps - 1]
    scale = np.abs(forward).max()
    for absorb in (True, False):
        np.testing.assert_allclose(got[absorb][0], forward, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(got[False][0], got[True][0], rtol=0, atol=1e-5 * scale)
    with pytest.raises(ValueError, match="mla_absorb=False must be True or False, and False "
                                         "only with attention='mla'"):
        GPTConfig(vocab_size=V, max_seq_len=8, num_layers=1, num_heads=4, hidden=32,
                  mla_absorb=False)


def _loss_and_grads(cfg, parallel, mesh, values, tokens, labels):
    with jax.set_mesh(mesh):
        model = copy_weights(GPT(cfg, parallel=parallel, rngs=nnx.Rngs(1)), values)
        loss, grads = nnx.jit(nnx.value_and_grad(lambda m, t, y: m.loss(t, y)))(
            model, tokens, labels)
        return float(loss), to_host(nnx.to_pure_dict(nnx.state(grads)))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["data_tensor", "ring", "ulysses"])
@pytest.mark.parametrize("q_lora", [12, None])
def test_training_sharded_equals_one_device(mesh_name, q_lora):
    """The loss and gradients of a batch, then 3 AdamW steps, on ``mesh_name`` equal the
    same parameters' on one device."""
    sizes, mode = MESHES[mesh_name]
    cfg = GPTConfig(**{**MODEL, "q_lora_rank": q_lora}, scan_layers=mode == "ring")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, (3, 4, 17)).astype(np.int32)
    batches = [{"tokens": t[None, :, :-1], "labels": t[None, :, 1:]} for t in tokens]
    single = sp_jax.ParallelConfig(data_axis=None)
    init, ref_losses, ref_params, _ = train_gpt(cfg, single, _mesh(1, 1, 1), batches,
                                                tx=optax.adamw(3e-3, eps=1e-5))
    parallel = _parallel(mode)
    ref = _loss_and_grads(cfg, single, _mesh(1, 1, 1), init, batches[0]["tokens"][0],
                          batches[0]["labels"][0])
    got = _loss_and_grads(cfg, parallel, _mesh(*sizes), init, batches[0]["tokens"][0],
                          batches[0]["labels"][0])
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    chex.assert_trees_all_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    _, losses, params, _ = train_gpt(cfg, parallel, _mesh(*sizes), batches, init=init)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-5)


def test_latent_cache_layout():
    """The prefill's cache is a :class:`LatentCache`: the latent and the rotary key per
    token (``kv_lora_rank + qk_rope_head_dim`` values, not per-head keys and values),
    batch over the data axis, length over the context axis, whole over the tensor axis."""
    cfg = GPTConfig(**MODEL, scan_layers=True)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 16)), jnp.int32)
    with jax.set_mesh(_mesh(2, 2, 2)):
        model = GPT(cfg, parallel=_parallel("ring"), rngs=nnx.Rngs(0))
        model.eval()
        _, cache = nnx.jit(prefill, static_argnums=(3,))(model, tokens, jnp.full((2,), 3), 24)
    assert isinstance(cache, LatentCache)
    assert cache.latent.shape == (2, 2, 24, 16) and cache.k_rope.shape == (2, 2, 24, 4)
    for a in (cache.latent, cache.k_rope):
        assert jax.typeof(a).sharding.spec == jax.P(None, "data", "context", None)


# -- the latent ring ---------------------------------------------------------------------

@pytest.mark.parametrize("window,documents", [pytest.param(None, True, marks=pytest.mark.slow),
                                              (5, False),
                                              pytest.param(9, True, marks=pytest.mark.slow)])
def test_latent_ring_matches_blockwise(window, documents):
    """:func:`~sp_jax.attention.latent_ring_attention` on a context axis of 4 (zigzag
    order, the latent and rotary key travelling) equals blockwise attention over the
    whole sequence of the up-projected keys and values, with packed documents and
    sliding windows: the output and the gradients of q, the latent, the rotary key and
    the up projection (fp32)."""
    from sp_jax.attention import (
        blockwise_attention,
        expand_latent,
        latent_ring_attention,
        zigzag_order,
    )
    c, b, s, heads, nope, p, r, dv = 4, 2, 48, 2, 8, 4, 16, 6
    rng = np.random.default_rng(0)
    q, latent, k_rope = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in (
        (b, s, heads, nope + p), (b, s, r), (b, s, p)))
    kv_b = jnp.asarray(rng.normal(size=(r, heads * (nope + dv))) * 0.3, jnp.float32)
    do = jnp.asarray(rng.normal(size=(b, s, heads, dv)), jnp.float32)
    seg = jnp.asarray(np.sort(rng.integers(1, 4, (b, s)), axis=1), jnp.int32) \
        if documents else None
    kw = dict(block_q=2, block_k=3, sliding_window=window, scale=0.3)

    def dense(q, latent, k_rope, kv_b):
        k, v = expand_latent(latent, k_rope, kv_b, nope, heads)
        return blockwise_attention(q, k, v, segment_ids=seg, **kw)

    want, back = jax.vjp(dense, q, latent, k_rope, kv_b)
    want_grads = back(do)
    order = zigzag_order(s, c)
    mesh = jax.make_mesh((c,), ("context",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:c])
    spec = jax.P(None, "context")

    def per_device(q, latent, k_rope, kv_b, seg):
        return latent_ring_attention(q, latent, k_rope, kv_b, axis_name="context",
                                     segment_ids=seg, **kw)

    ring = jax.shard_map(per_device, mesh=mesh,
                         in_specs=(spec, spec, spec, jax.P(), None if seg is None else spec),
                         out_specs=spec)
    with jax.set_mesh(mesh):
        held = [jax.reshard(x[:, order], spec) for x in (q, latent, k_rope, do)]
        kv_b = jax.reshard(kv_b, jax.P())
        seg = None if seg is None else jax.reshard(seg[:, order], spec)
        out, back = jax.vjp(lambda q, lat, k, w: ring(q, lat, k, w, seg), *held[:3], kv_b)
        grads = to_host(jax.jit(back)(held[3]))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want)[:, order], rtol=1e-5,
                               atol=1e-5)
    for g, w, permuted in zip(grads, want_grads, (True, True, True, False), strict=True):
        w = np.asarray(w)[:, order] if permuted else np.asarray(w)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(w).max()))


@pytest.mark.parametrize("latent,gpu", [
    (True, False), pytest.param(False, False, marks=pytest.mark.slow),
    pytest.param(True, True, marks=[requires_cuda_plugin, pytest.mark.slow])])
def test_latent_ring_moves_latent_bytes(latent, gpu):
    """What the ring moves over the context axis, in the compiled program (c = 4): the
    latent ring sends each chunk's ``r + p`` values a token (forward ``(c - 1) / c`` of
    the sequence's ``L`` bytes; backward the same again, fp32 gradient accumulators for
    the same steps, and their return home cast to the gradient's dtype, ``L / c``); the
    ring of the up-projected keys and values ``heads x (nope + p + d_v)`` a token the same
    way. Read from the collective-permutes of the compiled program: XLA:CPU on 8
    simulated devices in fp32 (it computes bf16 in fp32), and a deviceless H100 compile
    in bf16."""
    from sp_jax.analysis import compile_for_gpu, parse_collectives
    from sp_jax.attention import expand_latent, latent_ring_attention, ring_attention
    c, s, heads, nope, p, r, dv = 4, 64, 4, 8, 4, 16, 6
    dtype = jnp.bfloat16 if gpu else jnp.float32
    mesh = jax.make_mesh((c,), ("context",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:c])
    spec = jax.P(None, "context")

    def attend(q, lat, k_rope, kv_b):
        if latent:
            return latent_ring_attention(q, lat, k_rope, kv_b, axis_name="context",
                                         block_q=4, block_k=4)
        k, v = expand_latent(lat, k_rope, kv_b, nope, heads)
        return ring_attention(q, k, v, axis_name="context", block_q=4, block_k=4)

    def grads(*args):
        ring = jax.shard_map(attend, in_specs=(spec, spec, spec, jax.P()), out_specs=spec)
        return jax.grad(lambda *a: jnp.sum(ring(*a).astype(jnp.float32) ** 2),
                        argnums=(0, 1, 2, 3))(*args)

    shapes = (((1, s, heads, nope + p), spec), ((1, s, r), spec), ((1, s, p), spec),
              ((r, heads * (nope + dv)), jax.P()))
    if gpu:
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sp) for shape, sp in shapes]
        hlo = compile_for_gpu(grads, *args, mesh_shape=(c,), axis_names=("context",)).hlo
    else:
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, sp))
                for shape, sp in shapes]
        with jax.set_mesh(mesh):
            hlo = jax.jit(grads).lower(*args).compile().as_text()
    moved = {"forward": 0, "backward": 0}
    for col in parse_collectives(hlo):
        if col.kind == "collective-permute":
            moved[col.phase] += col.bytes
    width = (r + p) if latent else heads * (nope + p + dv)
    whole, whole_f32 = s * width * jnp.dtype(dtype).itemsize, s * width * 4
    assert moved == {"forward": whole * (c - 1) // c,
                     "backward": (whole + whole_f32) * (c - 1) // c + whole // c}
