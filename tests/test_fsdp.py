"""Parameters sharded over the data axis (``ParallelConfig(fsdp=True)``): the GPT trains
exactly like the unsharded model (here with micro-batches, dropout, scan and a context
axis; tests/test_gpt.py runs fsdp on explicit and auto meshes, with collective matmul and
Llama-shaped models, against the same unsharded runs as the replicated layouts);
parameters and optimizer state take 1 / (data x tensor) of the bytes per device; the
compiled step reduce-scatters weight gradients over the data axis and all-reduces no full
weight gradient; checkpoints move between sharded and replicated layouts bitwise."""

import chex
import jax
import numpy as np
import optax
import pytest
from _util import assert_bitwise, restore_onto, slow_except, train_gpt
from conftest import make_mesh, requires_cuda_plugin
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax.analysis import parse_collectives
from sp_jax.checkpoint import abstract_like, restore_checkpoint, save_checkpoint
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import TrainStep

B, S, STEPS = 8, 16, 5
BASE = dict(vocab_size=64, max_seq_len=S, num_layers=2, num_heads=4, hidden=32)


def _batches(vocab, micro=1, steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start = rng.integers(0, vocab, size=(B, 1))
        stride = rng.integers(1, 4, size=(B, 1))
        tokens = ((start + stride * np.arange(S + 1)) % vocab).astype(np.int32)
        out.append({"tokens": tokens[:, :-1].reshape(micro, B // micro, S),
                    "labels": tokens[:, 1:].reshape(micro, B // micro, S)})
    return out


CASES = {  # id: ((data, tensor), model options, parallel options, micro-batches)
    "4x2_micro_recompute_dropout": ((4, 2), {"dropout": 0.1}, {"recompute_allgather": True},
                                    2),
    "2x4_scan_untied_rotary": ((2, 4), {"scan_layers": True, "remat": True,
                                        "tie_embeddings": False, "positions": "rotary"}, {},
                               2),
}


@pytest.mark.parametrize("case", slow_except(CASES, "2x4_scan_untied_rotary"))
def test_fsdp_trains_like_unsharded(case):
    (d, t), model_kw, parallel_kw, micro = CASES[case]
    cfg = GPTConfig(**{**BASE, **model_kw})
    batches = _batches(cfg.vocab_size, micro)
    train = cfg.dropout > 0
    init, losses, params, step = train_gpt(cfg, sp_jax.ParallelConfig(fsdp=True, **parallel_kw),
                                        make_mesh(d, t), batches, train_mode=train)
    # parameters and AdamW moments sharded over data x tensor where TP shards them
    ups = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(step.params)
           if "'up'" in jax.tree_util.keystr(path) and "kernel" in jax.tree_util.keystr(path)]
    assert ups and all(tuple(k.sharding.spec)[-2:] == ("data", "tensor") for k in ups), ups
    assert losses[-1] < losses[0]
    _, want_losses, want_params, _ = train_gpt(cfg, sp_jax.ParallelConfig(), make_mesh(1, 1),
                                            batches, init=init, train_mode=train)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(params, want_params, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fsdp_with_a_context_axis_trains_like_unsharded():
    cfg = GPTConfig(**{**BASE, "max_seq_len": 32, "positions": "rotary"})
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 64, size=(STEPS, 1, 4, 33)).astype(np.int32)
    batches = [{"tokens": x[..., :-1], "labels": x[..., 1:]} for x in tokens]
    mesh = jax.make_mesh((2, 2, 2), ("data", "context", "tensor"),
                         axis_types=(AxisType.Explicit,) * 3)
    init, losses, params, _ = train_gpt(
        cfg, sp_jax.ParallelConfig(fsdp=True, context_parallel="ring"), mesh, batches)
    _, ref_losses, ref_params, _ = train_gpt(cfg, sp_jax.ParallelConfig(), make_mesh(1, 1),
                                          batches, init=init)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-5)


def _device_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.slow
def test_state_bytes_and_gradient_collectives():
    """Per device: parameters + AdamW state of the kernels and tables = total / (d x t);
    the compiled step reduce-scatters weight gradients over data and all-reduces none."""
    cfg = GPTConfig(**{**BASE, "hidden": 64, "num_heads": 8})
    d, t = 2, 4
    batches = _batches(cfg.vocab_size, steps=1)
    _, _, _, step = train_gpt(cfg, sp_jax.ParallelConfig(fsdp=True), make_mesh(d, t), batches)
    # kernels and the vocabulary table; the learned position table stays replicated
    leaves = {jax.tree_util.keystr(k): v
              for k, v in jax.tree_util.tree_leaves_with_path(step.params)}
    kernels = {k: v for k, v in leaves.items() if v.ndim == 2 and "position" not in k}
    assert len(kernels) == 4 * cfg.num_layers + 1, sorted(kernels)
    total = sum(v.nbytes for v in kernels.values())
    per_device = sum(v.addressable_shards[0].data.nbytes for v in kernels.values())
    assert per_device * d * t == total
    shapes = {tuple(v.shape) for v in kernels.values()}
    moments = [leaf for leaf in jax.tree.leaves(step.opt_state)
               if tuple(getattr(leaf, "shape", ())) in shapes]
    assert len(moments) == 2 * len(kernels)  # AdamW mu and nu, sharded like the params
    assert sum(m.addressable_shards[0].data.nbytes for m in moments) * d * t == 2 * total

    mesh = make_mesh(d, t)
    with jax.set_mesh(mesh):
        batch = jax.device_put(batches[0], NamedSharding(mesh, P(None, "data", None)))
        hlo = step.compile(batch, jax.random.key(0)).as_text()
    collectives = parse_collectives(hlo)
    fsdp_rs = [c for c in collectives if "fsdp_wgrad_reduce_scatter" in c.op_name]
    # 4 kernels per layer + the tied table (embedding and LM head) over the data axis
    assert sum(c.operands for c in fsdp_rs) >= 4 * cfg.num_layers + 1
    full = {tuple(v.shape) for v in kernels.values()} | {
        tuple(v.shape[::-1]) for v in kernels.values()}
    for c in collectives:
        if c.kind == "all-reduce":
            for _, dims in c.arrays:
                assert tuple(dims) not in full, (c.op_name, c.arrays)
                assert int(np.prod(dims)) < 64 * 64 // (d * t) * 4, (c.op_name, c.arrays)


@pytest.mark.slow
def test_checkpoint_between_sharded_and_replicated(tmp_path):
    cfg = GPTConfig(**BASE)
    batches = _batches(cfg.vocab_size, steps=2)
    _, _, _, step = train_gpt(cfg, sp_jax.ParallelConfig(fsdp=True), make_mesh(2, 4), batches)
    params, opt_state = step.params, step.opt_state
    save_checkpoint(tmp_path / "a", 2, step.params, step.opt_state)
    for mesh, parallel in ((make_mesh(4, 2), sp_jax.ParallelConfig()),
                           (make_mesh(8, 1), sp_jax.ParallelConfig(fsdp=True))):
        restored = restore_onto(tmp_path / "a", cfg, parallel, mesh)
        assert_bitwise(restored.params, params)
        assert_bitwise(restored.opt_state, opt_state)
    # and back: the replicated run's checkpoint onto the sharded layout
    save_checkpoint(tmp_path / "b", 2, restored.params, restored.opt_state)
    with jax.set_mesh(make_mesh(2, 4)):
        sharded = TrainStep(GPT(cfg, parallel=sp_jax.ParallelConfig(fsdp=True),
                                rngs=nnx.Rngs(5)), optax.adamw(3e-3, eps=1e-5))
    back = restore_checkpoint(tmp_path / "b", params_like=abstract_like(sharded.params),
                              opt_state_like=abstract_like(sharded.opt_state))
    assert_bitwise(back.params, params)
    assert_bitwise(back.opt_state, opt_state)


def test_fsdp_errors():
    with pytest.raises(ValueError, match="fsdp=True.*data_axis=None"):
        sp_jax.ParallelConfig(fsdp=True, data_axis=None)
    with pytest.raises(ValueError, match="fsdp='yes' is not a known fsdp mode.*'optimizer'"):
        sp_jax.ParallelConfig(fsdp="yes")
    with jax.set_mesh(make_mesh(4, 2)), pytest.raises(ValueError, match=r"\(fsdp\).*in_features=6"):
        sp_jax.ColumnSequenceParallelLinear(6, 8, parallel=sp_jax.ParallelConfig(fsdp=True),
                                            rngs=nnx.Rngs(0))


@pytest.mark.slow
@requires_cuda_plugin
def test_h100_backward_gathers_move_bf16_and_each_weight_gradient_is_freed_in_its_op():
    """Deviceless 8 x H100 training step (AdamW, 2 layers, h=512, data 8): with fsdp the
    backward re-gathers every weight in the compute dtype (bf16, not the fp32 masters),
    and each full-size fp32 weight gradient is reduce-scattered in its own op's backward,
    so temp stays well below the replicated step's (before: the gradients waited for
    reduce-scatters XLA started at the end of the backward)."""
    from _util import FSDP_QUICK as QUICK

    from sp_jax.analysis.checks import fsdp_step_report as compile_step

    replicated = compile_step(QUICK, 8, 1, False, False)
    sharded = compile_step(QUICK, 8, 1, False, True)
    assert sharded["bwd_gathers"] == 4 * QUICK.layers + 1  # + the tied LM head
    assert sharded["bwd_gather_dtypes"] == ["bf16"]
    assert sharded["temp_mib"] <= 0.6 * replicated["temp_mib"], (sharded, replicated)
