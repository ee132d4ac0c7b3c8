"""The benchmark (``benchmarks/``): its GSPMD baseline computes what sp_jax's block computes
with the library's layout, collectives get their roles, and a quick run writes the report,
the JSON and the plots."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import to_host
from conftest import HAS_CUDA_PLUGIN
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from benchmarks.baseline import GspmdBlock, constrain, copy_weights, param_specs
from benchmarks.collectives import role
from sp_jax.analysis import parse_collectives
from sp_jax.models import Block, GPTConfig

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
        assert kernel.sharding.spec == P(None, "tensor")
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


def test_gspmd_baseline_takes_every_parameter_spec_from_the_layout(mesh_2x4):
    """Same specs as sp_jax's block, and a layout with other axis names is followed."""
    cfg = GPTConfig(vocab_size=64, max_seq_len=S, num_layers=1, num_heads=A, hidden=H)
    with jax.set_mesh(mesh_2x4):
        sp_block = nnx.eval_shape(lambda: Block(cfg, sp_jax.ParallelConfig(),
                                                rngs=nnx.Rngs(0)))
    sp_specs = nnx.get_partition_spec(nnx.state(sp_block, nnx.Param))
    base = nnx.eval_shape(lambda: GspmdBlock(H, A, rngs=nnx.Rngs(0)))
    flat = dict(jax.tree.leaves_with_path(param_specs(base), is_leaf=lambda x: isinstance(x, P)))
    assert flat == dict(jax.tree.leaves_with_path(sp_specs, is_leaf=lambda x: isinstance(x, P)))
    assert flat and all(isinstance(s, P) for s in flat.values())

    layout = sp_jax.Layout(data_axes=("dp",), tensor_axis="tp")
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        other = nnx.eval_shape(lambda: GspmdBlock(H, A, layout=layout, rngs=nnx.Rngs(0)))
    specs = param_specs(other)
    assert specs["attention"]["qkv"]["kernel"] == layout.column_kernel == P(None, "tp")
    assert specs["attention"]["out"]["kernel"] == layout.row_kernel == P("tp", None)
    assert specs["mlp"]["up"]["bias"] == layout.column_bias == P("tp")
    assert specs["mlp"]["down"]["bias"] == layout.row_bias
    # the activations follow it too: the block's output is pinned to layout.sp
    graphdef, params = nnx.split(other)
    x = jax.ShapeDtypeStruct((B, S, H), jnp.float32)
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)).lower(params, x).compile()
    assert layout.sp == P("dp", "tp", None)
    assert compiled.output_shardings.is_equivalent_to(NamedSharding(mesh, layout.sp), 3)
    assert not compiled.output_shardings.is_equivalent_to(NamedSharding(mesh, layout.tp), 3)


def test_gspmd_baseline_rejects_explicit_mesh(mesh_2x4):
    with jax.set_mesh(mesh_2x4), pytest.raises(ValueError, match="Auto axes"):
        constrain(jnp.ones((B, S, H)), P("data", "tensor", None))


def test_collective_roles_from_the_issuing_functions():
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
        '  %head = bf16[2,4]{1,0} reduce-scatter(bf16[8,4]{1,0} %g), dimensions={0}, '
        'metadata={op_name="jit(f)/transpose(jvp())/shard_map/reduce_scatter" '
        'stack_frame_id=4}',
        '',
        'FunctionNames',
        '1 "_csp_matmul_fwd"',
        '2 "column_sequence_parallel_matmul"',
        '3 "GPT.padded_logits.<locals>.lm_head"',
        'FileLocations',
        '1 {file_name_id=1 function_name_id=1 line=1}',
        '2 {file_name_id=1 function_name_id=2 line=2}',
        '3 {file_name_id=1 function_name_id=3 line=3}',
        'StackFrames',
        # as XLA prints them: the parent of frame k is frame parent_frame_id - 1
        '1 {file_location_id=1 parent_frame_id=3}',
        '2 {file_location_id=2 parent_frame_id=1}',
        '3 {file_location_id=3 parent_frame_id=0}',
        '4 {file_location_id=2 parent_frame_id=4}',
    ])
    ag, ar, rs, head = parse_collectives(text)
    assert (ag.kind, ag.phase, ag.bytes, ag.is_async) == ("all-gather", "forward", 64, False)
    assert ag.functions == ["_csp_matmul_fwd", "column_sequence_parallel_matmul"]
    assert role(ag) == "block: column input all-gather"
    assert ar.arrays == [("f32", (4,)), ("f32", (8,))] and ar.is_async
    assert ar.overlapped_ops == 1 and ar.phase == "unknown"
    assert role(ar) == "block: all-reduce (XLA)"
    assert rs.phase == "backward" and role(rs) == "block: column dx reduce-scatter"
    assert head.functions == ["column_sequence_parallel_matmul",
                              "GPT.padded_logits.<locals>.lm_head"]
    assert role(head) == "LM head: column dx reduce-scatter"


def test_out_is_required():
    from benchmarks.run import main

    with pytest.raises(SystemExit):
        main(["--quick"])


TARGET_IDS = ["memory_recompute", "memory_save", "collective_count",
              "no_activation_all_reduce", "h100_async", "h100_peak", "stack_peak",
              "stack_temp", "stack_growth", "stack_long", "stack_save", "cm_rings",
              "cm_memory", "cpu_time_sp_save", "cpu_time_sp_recompute",
              "cpu_gpt_tiny_float32", "context_long_compile", "context_activation_scaling",
              "context_communication", "context_ring_balance", "context_cpu_attention_time"]
STATUS = {True: "met", False: "**not met**", None: "not measured"}


def test_quick_run_writes_report(tmp_path):
    pytest.importorskip("matplotlib")  # the report's plots: the examples extra
    from benchmarks.run import main

    results = main(["--quick", "--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["BENCHMARKS.md", "docs"]
    md = (tmp_path / "BENCHMARKS.md").read_text()
    data = json.loads((tmp_path / "docs" / "bench.json").read_text())
    assert data == json.loads(json.dumps(results, default=str))
    for name in ("bench_memory_vs_t.png", "bench_memory_vs_s.png", "bench_context_memory.png"):
        png = (tmp_path / "docs" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000

    # the target table: every target once, its verdict in the report
    assert [t["id"] for t in data["targets"]] == TARGET_IDS
    met = sum(t["met"] is True for t in data["targets"])
    assert f"{met} of {len(TARGET_IDS)} met in this run." in md
    for i, t in enumerate(data["targets"], 1):
        assert f"| {i} | {t['target']} | {t['measured']} | {STATUS[t['met']]} |" in md
    by_id = {t["id"]: t for t in data["targets"]}
    # the structural targets hold at any shape
    for tid in ("memory_recompute", "memory_save", "collective_count",
                "no_activation_all_reduce", "context_activation_scaling",
                "context_ring_balance"):
        assert by_id[tid]["met"] is True, by_id[tid]
    # timing verdicts follow the measured ratios (their values are noise at this size)
    ratios = data["step_time"]["ratio_to_reference"]
    assert ratios["gspmd"] == 1.0
    for v in ("sp_save", "sp_recompute"):
        assert by_id[f"cpu_time_{v}"]["met"] is (ratios[v] <= 1.0)
        assert by_id[f"cpu_time_{v}"]["measured"].startswith(f"{ratios[v]:.2f}x")
    gpt_run = data["gpt_step_time"][0]
    assert gpt_run["first_loss"]["sp_jax"] == pytest.approx(gpt_run["first_loss"]["gspmd"],
                                                          rel=1e-5)  # same model, weights
    assert by_id["cpu_gpt_tiny_float32"]["met"] is (
        gpt_run["ratio_to_reference"]["sp_jax"] <= 1.0)
    assert "## CPU: the whole GPT training step" in md
    assert "## Long context: a context mesh axis" in md
    # the pipeline and packed-documents sections sit after the long-context one and before
    # the planner's (none in a quick run)
    heads = [line for line in md.splitlines() if line.startswith("## ")]
    pipe = heads.index("## Pipeline parallelism")
    assert heads[pipe - 1:pipe + 3] == ["## Long context: a context mesh axis",
                                        "## Pipeline parallelism", "## Packed documents",
                                        "## Run"]
    # packed documents (benchmarks/text.py): its targets in its section; the kernel skips
    # exactly the block products of other documents at any shape
    text = data["text"]
    assert [t["id"] for t in text["targets"]] == [
        "text_pipeline_rate", "text_first_fit_efficiency", "text_masked_attention_time",
        "text_masked_attention_temp"]
    for t in text["targets"]:
        assert f"| {t['target']} | {t['measured']} |" in md
    products = text["attention"]["block_products"]
    assert (products["masked"], products["unmasked"]) == (products["masked_formula"],
                                                          products["unmasked_formula"])
    assert text["efficiency"]["stdlib"]["concat"]["efficiency"] == 1.0
    assert ("error" not in text["attention"]["gpu"]) is HAS_CUDA_PLUGIN
    if HAS_CUDA_PLUGIN:
        # the structural memory and overlap targets hold at any shape (which collectives
        # get compute to overlap is the scheduler's cost-model decision, shape-dependent:
        # tests/test_analysis.py checks it at a moderate shape, `make bench` at full size)
        for tid in ("h100_peak", "stack_peak", "stack_growth", "stack_save", "cm_rings",
                    "context_long_compile", "context_communication"):
            assert by_id[tid]["met"] is True, by_id[tid]
        assert by_id["stack_long"]["met"] is None  # the quick run has one sequence length
        assert "## Multi-layer stacks on 8 x H100" in md
        gpt = data["gpu"]["gpt"]
        for v in ("sp_save", "sp_recompute"):
            peak = gpt[v]["peak_live"]
            assert 0 < peak["peak_bytes"] <= gpt[v]["memory"]["peak_bytes"]
            assert sum(b for _, b in peak["entries"]) == peak["peak_bytes"]
            roles = {o["role"] for o in gpt[v]["ops"]}
            assert "LM head: column dx reduce-scatter" in roles, roles
        assert set(data["gpu"]) == {"block", "gpt"}  # no attention-barrier probe
        # the pipeline benchmark (benchmarks/pipeline.py): one compile per schedule at M=8
        pl = data["pipeline"]
        assert [(r["kind"], r["microbatches"], r["repeats"]) for r in pl["records"]] == [
            ("gpipe", 8, 1), ("1f1b", 8, 1)]
        for t in pl["targets"]:
            assert f"| {t['target']} | {t['measured']} |" in md
        # ticks, activation bytes and what crosses stages hold at any shape
        assert all(t["met"] is True for t in pl["targets"][-3:]), pl["targets"]
        assert pl["layer_scan_residuals"]["bytes"] > 0
    else:
        for tid in ("h100_async", "h100_peak", "stack_peak", "cm_rings"):
            assert by_id[tid]["met"] is None
            assert by_id[tid]["measured"].startswith("not measured")
        assert "error" in data["pipeline"]
        assert "## Pipeline parallelism\n\nNot measured: `" in md
    assert "barrier_probe" not in json.dumps(data) and "Diagnostic" not in md

    mem = data["memory"]["realistic"]
    for v in ("unsharded", "gspmd", "sp_save", "sp_recompute"):
        assert mem[v]["activation_bytes"] > 0
        assert sum(mem[v]["terms"].values()) == mem[v]["activation_bytes"]
        # every residual is attributed to the operation that produced it
        assert all(r["source"] for r in mem[v]["residuals"]), v
    assert set(data["step_time"]["ratio_to_reference"]) == {
        "unsharded", "gspmd", "sp_save", "sp_recompute"}
