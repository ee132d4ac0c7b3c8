"""The benchmark: its GSPMD baseline computes what sp_jax's block computes, and a quick run
writes the report, the JSON and the plots."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import to_host
from flax import nnx

import sp_jax
from sp_jax.bench.baseline import GspmdBlock, constrain, copy_weights
from sp_jax.bench.hlo import parse_collectives
from sp_jax.models.gpt import Block, GPTConfig

TOL = dict(rtol=1e-5, atol=1e-5)
B, S, H, A = 4, 16, 32, 8


def _loss(model, x, probe):
    return jnp.sum(jnp.sin(model(x)) * probe)


def _sp_block(mesh, recompute, seed=0):
    cfg = GPTConfig(vocab_size=64, max_seq_len=S, num_layers=1, num_heads=A, hidden=H)
    with jax.set_mesh(mesh):
        return Block(cfg, sp_jax.ParallelConfig(recompute_allgather=recompute),
                     rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("recompute", [False, True], ids=["save", "recompute"])
def test_gspmd_baseline_equals_sp_block(mesh_2x4, mesh_2x4_auto, recompute):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, S, H)).astype(np.float32)
    probe = rng.normal(size=(B, S, H)).astype(np.float32)
    sp_block = _sp_block(mesh_2x4, recompute)
    with jax.set_mesh(mesh_2x4):
        sp_loss, (sp_grads, sp_dx) = nnx.jit(nnx.value_and_grad(_loss, argnums=(0, 1)))(
            sp_block, x, probe)
    with jax.set_mesh(mesh_2x4_auto):
        base = GspmdBlock(H, A, rngs=nnx.Rngs(1))  # different init: weights are copied
        copy_weights(base, sp_block)
        base_loss, (base_grads, base_dx) = nnx.jit(nnx.value_and_grad(_loss, argnums=(0, 1)))(
            base, x, probe)
        kernel = base.attention.qkv.kernel[...]
        assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    # and the unsharded twin (no mesh: constraints skipped) from the same weights
    plain = copy_weights(GspmdBlock(H, A, rngs=nnx.Rngs(2)), sp_block)
    ref_loss, (ref_grads, ref_dx) = nnx.value_and_grad(_loss, argnums=(0, 1))(plain, x, probe)

    def pure(g):
        return to_host(nnx.to_pure_dict(nnx.state(g, nnx.Param)))

    for loss, grads, dx in ((base_loss, base_grads, base_dx), (ref_loss, ref_grads, ref_dx)):
        chex.assert_trees_all_close(to_host(loss), to_host(sp_loss), **TOL)
        chex.assert_trees_all_close(pure(grads), pure(sp_grads), **TOL)
        chex.assert_trees_all_close(to_host(dx), to_host(sp_dx), **TOL)
    assert jax.tree.structure(pure(base_grads)) == jax.tree.structure(pure(sp_grads))


def test_gspmd_baseline_rejects_explicit_mesh(mesh_2x4):
    with jax.set_mesh(mesh_2x4), pytest.raises(ValueError, match="Auto axes"):
        constrain(jnp.ones((B, S, H)), jax.sharding.PartitionSpec("data", "tensor", None))


def test_hlo_parser_phases_roles_and_combined_all_reduce():
    text = "\n".join([
        'HloModule m',
        '  %ag = bf16[8,4]{1,0} all-gather(bf16[2,4]{1,0} %p), dimensions={0}, '
        'metadata={op_name="jit(f)/jvp()/shard_map/all_gather" stack_frame_id=1}',
        '  %c = f32[12]{0} fusion(f32[4]{0} %a, f32[8]{0} %b), kind=kLoop, '
        'calls=%wrapped_concatenate_computation',
        '  %wrapped_concatenate = f32[12]{0} fusion(%a, /*index=1*/%b), kind=kLoop',
        '  %a = f32[4]{0} parameter(0)',
        '  %b = f32[8]{0} parameter(1)',
        '  %ars = f32[12]{0} all-reduce-start(%wrapped_concatenate), to_apply=%add, '
        'backend_config={"collective_backend_config":{"is_sync":false}}',
        '  %work = f32[12]{0} fusion(%a), kind=kLoop',
        '  %ard = f32[12]{0} all-reduce-done(%ars)',
        '  %rs = bf16[2,4]{1,0} reduce-scatter(bf16[8,4]{1,0} %g), dimensions={0}, '
        'metadata={op_name="jit(f)/transpose(jvp())/shard_map/reduce_scatter" '
        'stack_frame_id=2}',
        '',
        'FunctionNames',
        '1 "_csp_matmul_fwd"',
        '2 "column_sequence_parallel_matmul"',
        'FileLocations',
        '1 {file_name_id=1 function_name_id=1 line=1}',
        '2 {file_name_id=1 function_name_id=2 line=2}',
        'StackFrames',
        # as XLA prints them: the parent of frame k is frame parent_frame_id - 1
        '1 {file_location_id=1 parent_frame_id=3}',
        '2 {file_location_id=2 parent_frame_id=1}',
    ])
    from sp_jax.bench.collectives import role

    ag, ar, rs = parse_collectives(text)
    assert (ag.kind, ag.phase, ag.bytes, ag.is_async) == ("all-gather", "forward", 64, False)
    assert ag.functions == ["_csp_matmul_fwd", "column_sequence_parallel_matmul"]
    assert role(ag) == "block: column input all-gather"
    assert ar.arrays == [("f32", (4,)), ("f32", (8,))] and ar.is_async
    assert ar.overlapped_ops == 1 and ar.phase == "unknown"
    assert rs.phase == "backward" and role(rs) == "block: column dx reduce-scatter"


def test_quick_run_writes_report(tmp_path):
    from sp_jax.bench import main

    results = main(["--quick", "--out", str(tmp_path)])
    md = (tmp_path / "BENCHMARKS.md").read_text()
    data = json.loads((tmp_path / "docs" / "bench.json").read_text())
    for name in ("bench_memory_vs_t.png", "bench_memory_vs_s.png"):
        png = (tmp_path / "docs" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert "## Targets" in md and "| # | target | measured | status |" in md
    assert len(data["targets"]) == len(results["targets"]) >= 8
    assert all(t["met"] in (True, False, None) for t in data["targets"])
    # the structural targets hold at any shape
    by_id = {t["id"]: t for t in data["targets"]}
    for tid in ("memory_save", "collective_count", "no_activation_all_reduce"):
        assert by_id[tid]["met"] is True, by_id[tid]
    mem = data["memory"]["realistic"]
    for v in ("unsharded", "gspmd", "sp_save", "sp_recompute"):
        assert mem[v]["activation_bytes"] > 0
        assert sum(mem[v]["terms"].values()) == mem[v]["activation_bytes"]
    assert set(data["step_time"]["ratio_to_reference"]) == {
        "unsharded", "gspmd", "sp_save", "sp_recompute"}

