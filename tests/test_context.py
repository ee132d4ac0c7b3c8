"""A context mesh axis (``ParallelConfig(context_parallel="ring" | "ulysses")``): the GPT
trains exactly like the unsharded model on (data, context, tensor) meshes, with learned and
rotary positions, dropout, recompute, remat and scan; checkpoints move across context
sizes; bad layouts get clear errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import copy_weights, to_host, train_gpt
from flax import nnx
from jax.sharding import AxisType

import sp_jax
from sp_jax.models import GPT, GPTConfig

B, S, STEPS = 4, 48, 5
# Blocks of 4 tokens: with s=48 each context device holds an odd number of attention
# blocks (c=2: 24 tokens = 2 x 3 blocks per zigzag half; c=8: halves of 3 tokens, 1 block).
BASE = dict(vocab_size=64, max_seq_len=S, num_layers=1, num_heads=8, hidden=32,
            attention_block_q=4, attention_block_k=4)


def _mesh(data, context, tensor):
    return jax.make_mesh((data, context, tensor), ("data", "context", "tensor"),
                         axis_types=(AxisType.Explicit,) * 3,
                         devices=jax.devices()[: data * context * tensor])


def _batches(steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start = rng.integers(0, 64, size=(B, 1))
        stride = rng.integers(1, 4, size=(B, 1))
        tokens = ((start + stride * np.arange(S + 1)) % 64).astype(np.int32)
        out.append({"tokens": tokens[None, :, :-1], "labels": tokens[None, :, 1:]})
    return out


CASES = {  # id: (mesh, context_parallel, model options, parallel options)
    # grouped-query: 8 query heads over 4 key/value heads (2 per tensor shard), and
    # multi-query (one kv head, replicated over the tensor axis)
    "ring_2x2x2_rotary_mqa_recompute": ((2, 2, 2), "ring",
                                        {"positions": "rotary", "num_kv_heads": 1},
                                        {"recompute_allgather": True}),
    "ulysses_2x2x2_gqa": ((2, 2, 2), "ulysses", {"num_kv_heads": 4}, {}),
    "ring_1x4x2_scan_remat": ((1, 4, 2), "ring", {"scan_layers": True, "remat": True}, {}),
    "ulysses_1x4x2_dropout": ((1, 4, 2), "ulysses", {"dropout": 0.1, "attention_dropout": 0.1},
                              {}),
    "ring_1x8x1_dropout": ((1, 8, 1), "ring", {"dropout": 0.1, "attention_dropout": 0.1}, {}),
    # sliding windows over the zigzag chunks (12 tokens at context 2, 6 at context 4): a
    # window inside a chunk (the chunk before masked at its edge, farther ones skipped),
    # a window across chunk boundaries
    "ring_2x2x2_window_rotary_gqa": ((2, 2, 2), "ring", {"positions": "rotary",
                                                         "num_kv_heads": 4,
                                                         "sliding_window": 5}, {}),
    "ring_1x4x2_window_dropout": ((1, 4, 2), "ring", {"sliding_window": 7, "dropout": 0.1,
                                                      "attention_dropout": 0.1}, {}),
    # head_dim 16 apart from hidden / heads (32 / 8 = 4): q, k, v 128 wide
    "ring_2x2x2_head_dim16_rotary_gqa": ((2, 2, 2), "ring", {"positions": "rotary",
                                                             "num_kv_heads": 2,
                                                             "head_dim": 16}, {}),
    "ulysses_2x2x2_head_dim16_gqa": ((2, 2, 2), "ulysses", {"positions": "rotary",
                                                            "num_kv_heads": 4,
                                                            "head_dim": 16}, {}),
    # (Ulysses on a context of 8: tests/test_attention.py; rotary: the first case)
}


@pytest.fixture(scope="module")
def references():
    """The unsharded runs, one per model configuration (shared by the cases)."""
    cache = {}

    def get(model_kw):
        key = tuple(sorted(model_kw.items()))
        if key not in cache:
            cfg = GPTConfig(**{**BASE, **model_kw})
            cache[key] = train_gpt(cfg, sp_jax.ParallelConfig(data_axis=None), _mesh(1, 1, 1),
                                _batches(), train_mode=max(cfg.dropout, cfg.attention_dropout) > 0)
        return cache[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_gpt_with_a_context_axis_trains_like_unsharded(case, references):
    mesh_shape, mode, model_kw, parallel_kw = CASES[case]
    cfg = GPTConfig(**{**BASE, **model_kw})
    init, ref_losses, ref_params, _ = references(model_kw)
    parallel = sp_jax.ParallelConfig(context_parallel=mode, **parallel_kw)
    _, losses, params, _ = train_gpt(cfg, parallel, _mesh(*mesh_shape), _batches(), init=init,
                               train_mode=max(cfg.dropout, cfg.attention_dropout) > 0)
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_logits_and_hidden_states_come_back_in_the_input_order():
    """Ring attention holds the sequence in zigzag order inside the model; what the user
    gets back is in the order of the tokens given."""
    cfg = GPTConfig(**BASE)
    tokens = _batches(1)[0]["tokens"][0]
    with jax.set_mesh(_mesh(1, 1, 1)):
        ref = GPT(cfg, parallel=sp_jax.ParallelConfig(data_axis=None), rngs=nnx.Rngs(0))
        ref_logits = nnx.jit(lambda m, t: m(t))(ref, tokens)
        ref_hidden = nnx.jit(lambda m, t: m.hidden_states(t))(ref, tokens)
    with jax.set_mesh(_mesh(1, 4, 2)):
        model = GPT(cfg, parallel=sp_jax.ParallelConfig(data_axis=None, context_parallel="ring"),
                    rngs=nnx.Rngs(1))
        copy_weights(model, ref)
        logits = nnx.jit(lambda m, t: m(t))(model, tokens)
        hidden = nnx.jit(lambda m, t: m.hidden_states(t))(model, tokens)
    chex.assert_trees_all_close(to_host(logits), to_host(ref_logits), rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(to_host(hidden), to_host(ref_hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_checkpoint_moves_across_context_sizes(tmp_path):
    """Parameters do not depend on the context axis: saved on context=2, restored onto
    context=4 and onto no context axis, bitwise."""
    from sp_jax.checkpoint import abstract_like, restore_checkpoint, save_checkpoint

    cfg = GPTConfig(**BASE)
    with jax.set_mesh(_mesh(1, 2, 2)):
        model = GPT(cfg, parallel=sp_jax.ParallelConfig(context_parallel="ring"),
                    rngs=nnx.Rngs(3))
        saved = to_host(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        save_checkpoint(tmp_path / "ckpt", 1, nnx.state(model, nnx.Param))
    for mesh, parallel in (((1, 4, 2), sp_jax.ParallelConfig(context_parallel="ulysses")),
                           ((2, 1, 4), sp_jax.ParallelConfig())):
        with jax.set_mesh(_mesh(*mesh)):
            target = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(4))
            restored = restore_checkpoint(
                tmp_path / "ckpt", params_like=abstract_like(nnx.state(target, nnx.Param)))
        chex.assert_trees_all_equal(to_host(nnx.to_pure_dict(restored.params)), saved)


def test_errors():
    cfg = GPTConfig(**BASE)
    with pytest.raises(ValueError, match=r"context_parallel='rings' is not a known kind"):
        sp_jax.ParallelConfig(context_parallel="rings")
    with pytest.raises(ValueError, match="needs a mesh axis of its own"):
        sp_jax.ParallelConfig(context_parallel="ring", context_axis="tensor")
    with jax.set_mesh(_mesh(2, 1, 4)), pytest.raises(ValueError, match="context axis 'ctx'"):
        GPT(cfg, parallel=sp_jax.ParallelConfig(context_parallel="ring", context_axis="ctx"),
            rngs=nnx.Rngs(0))(np.zeros((2, S), np.int32))
    # Ulysses gives each context device whole heads: 8 heads over tensor 2 x context 8
    with jax.set_mesh(_mesh(1, 4, 2)), pytest.raises(ValueError, match="Ulysses"):
        GPT(GPTConfig(**{**BASE, "num_heads": 4}),
            parallel=sp_jax.ParallelConfig(context_parallel="ulysses"), rngs=nnx.Rngs(0))
    # ring splits the sequence into 2 x context chunks: 36 tokens split over 4 devices
    # (the SP layout), not into 8 chunks
    with jax.set_mesh(_mesh(1, 4, 1)), pytest.raises(ValueError, match="into 8 chunks"):
        model = GPT(cfg, parallel=sp_jax.ParallelConfig(context_parallel="ring"),
                    rngs=nnx.Rngs(0))
        model(np.zeros((1, 36), np.int32))
    # cuDNN's attention: an option of the local and Ulysses kernels, not of the ring
    with pytest.raises(ValueError, match="attention_implementation='flash'.*'xla'"):
        GPTConfig(**BASE, attention_implementation="flash")
    with jax.set_mesh(_mesh(1, 2, 2)), pytest.raises(ValueError, match="cannot run ring"):
        GPT(GPTConfig(**BASE, attention_implementation="cudnn", dtype=jnp.bfloat16),
            parallel=sp_jax.ParallelConfig(context_parallel="ring"), rngs=nnx.Rngs(0))
