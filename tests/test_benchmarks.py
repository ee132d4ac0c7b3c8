"""The benchmark (``benchmarks/``): its GSPMD baseline computes what sp_jax's block computes
with the library's layout, collectives get their roles, and a quick run writes the report,
the JSON and the plots."""

import json
import re
from pathlib import Path

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
from benchmarks.section import status
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


@pytest.mark.slow
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


@pytest.mark.slow
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
ZERO1_TITLE = '## ZeRO-1 on 8 x H100 (`ParallelConfig(fsdp="optimizer")`)'
GENERATION_TARGETS = ["generation_cpu_ratio", "generation_h100_memory",
                      "generation_collectives"]


@pytest.mark.slow
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
    # the report is a function of the JSON alone: rendered again from it, the same bytes
    from benchmarks.render import render_document

    assert render_document(data, tmp_path / "docs") == md

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
    # the pipeline, packed-documents, generation, FSDP, ZeRO-1 and mixture-of-experts
    # sections sit after the long-context one and before the planner's (none in a quick
    # run, nor the recorded sections)
    heads = [line for line in md.splitlines() if line.startswith("## ")]
    pipe = heads.index("## Pipeline parallelism")
    assert heads[pipe - 1:pipe + 7] == ["## Long context: a context mesh axis",
                                        "## Pipeline parallelism", "## Packed documents",
                                        "## Generation", "## FSDP on 8 x H100",
                                        ZERO1_TITLE, "## Mixture of experts", "## Run"]
    assert data["recorded"] == [] and "*Recorded, not measured" not in md
    # mixture of experts (benchmarks/moe.py): the ragged all-to-alls carry the analytic bytes
    moe = {t["id"]: t for t in data["moe"]["targets"]}
    assert moe["moe_a2a_2_2_1_2"]["met"] is True
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
    # generation (benchmarks/generation.py): its targets in its section; without the CUDA
    # plugin its H100 targets are not measured, with it they hold at any shape
    gen = data["generation"]
    assert [t["id"] for t in gen["targets"]] == GENERATION_TARGETS
    for t in gen["targets"]:
        assert f"| {t['target']} | {t['measured']} |" in md
    assert all(r["sp_jax"]["tokens_per_s"] > 0 for r in gen["cpu"]["rows"])
    for t in gen["targets"][1:]:
        assert t["met"] is (True if HAS_CUDA_PLUGIN else None), t
    # FSDP (benchmarks/fsdp.py): with the CUDA plugin its memory target and the gathers'
    # dtype hold at any shape (which gathers XLA schedules async is its cost model's
    # choice, shape-dependent: `make bench` checks it at full size)
    fsdp = data["fsdp"]
    if HAS_CUDA_PLUGIN:
        assert fsdp["targets"][0]["met"] is True, fsdp["targets"]
        assert all(r["fsdp"]["bwd_gather_dtypes"] == ["bf16"] for r in fsdp["rows"])
        for t in fsdp["targets"]:
            assert f"| {t['target']} | {t['measured']} | {status(t['met'])} |" in md
    else:
        assert "error" in fsdp
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


def _generation_results(mismatch: bool, combined: bool) -> dict:
    """Fabricated results of ``benchmarks.generation.run_generation``: transformers
    measured (batch 1 and 8), a deviceless compile of 2 layers whose layer loop XLA
    runs one layer per trip (``combined``: two all-reduces merged into one of twice the bytes)."""
    from benchmarks.generation import FULL

    def timing(s):
        return {"tokens_per_s": 64 / s, "median_s": s, "quartiles_s": [s, s]}

    rows = [{"batch": b, "mesh": mesh, "first_call_s": [3.0], "transformers_first_call_s": [],
             "sp_jax": timing(0.1), "transformers": timing(0.2), "ratio": 2.0,
             "round_ratios": [1.9, 2.1, 1.8, 2.2],
             "tokens": {"equal": not mismatch, "fraction": 0.75 if mismatch else 1.0,
                        "first_difference": [0, 48] if mismatch else None}}
            for b, mesh in ((1, "1,8"), (8, "2,4"), (8, "1,1"))]
    rows[-1].update(reference=True, sp_jax=timing(0.05), ratio=4.0)
    ar = {"kind": "all-reduce", "arrays": [["bf16", [8, 1, 64]]], "bytes": 1024,
          "async": True, "overlapped_ops": 0, "groups": [list(range(8))], "op_name": ""}
    collectives = [dict(ar, computation="main", runs=1, bytes=2048) if combined else
                   dict(ar, computation="body", runs=2) for _ in range(2)]
    collectives += [dict(ar, computation="main", runs=1),
                    dict(ar, kind="all-gather", arrays=[["bf16", [8, 256]]], bytes=4096,
                         computation="main", runs=1)]
    analytic = {"parameters": [{"name": "embed/embedding", "shape": [256, 64],
                                "dtype": "bfloat16", "split": True, "bytes": 4096}],
                "parameter_bytes": 4096, "cache_bytes": 65536, "kv_local": 1, "head_dim": 8}
    gpu = {"config": {"preset": "llama-tiny", "layers": 2, "hidden": 64, "heads": 8,
                      "kv_heads": 8, "mlp_hidden": 160, "vocab": 256, "dtype": "bfloat16"},
           "tensor": 8, "batch": 8, "cache_tokens": 128, "compile_s": 1.0,
           "argument_bytes": 69700, "output_bytes": 73728, "temp_bytes": 100,
           "alias_bytes": 65536, "peak_bytes": 77992, "analytic": analytic,
           "collectives": collectives, "hlo_ops": {},
           "expected": {"all-reduce": {"ops": 5, "bytes": 5 * 1024},
                        "all-gather": {"ops": 1, "bytes": 4096}}}
    cpu = {"threads": 2, "parameters": 1_000_000, "rows": rows,
           "transformers_versions": {"torch": "2.x", "transformers": "5.x", "threads": 2},
           "config": {"preset": "llama-tiny", "layers": 4, "hidden": 256, "heads": 8,
                      "kv_heads": 2, "mlp_hidden": 768, "vocab": 4096, "dtype": "float32"}}
    return {"bench": FULL.as_dict(), "cpu": cpu, "gpu": gpu,
            "meta": {"date": "today", "jax": "0", "cpu_count": 2, "runtime_s": 1.0}}


@pytest.mark.slow
@pytest.mark.parametrize("mismatch,combined", [(False, False), (True, True)])
def test_generation_section_from_results(mismatch, combined):
    """The generation section's verdicts and tables (transformers measured, the H100
    compile present: what a run with torch and the CUDA plugin renders), from fabricated
    results: the ratio reported, the memory within 5% of analytic, combined all-reduces
    accepted when they move the expected bytes; a run without transformers or the plugin
    reports them as not measured."""
    from benchmarks.generation import evaluate_targets
    from benchmarks.render.generation import render_markdown

    res = _generation_results(mismatch, combined)
    res["targets"] = targets = evaluate_targets(res)
    assert [t["id"] for t in targets] == GENERATION_TARGETS
    assert [t["met"] for t in targets] == [True, True, True]
    assert "batch 1 (1 x 8): 2.00x (640 vs 320 tokens/s)" in targets[0]["measured"]
    assert ("greedy tokens differ" in targets[0]["measured"]) is mismatch
    assert targets[2]["measured"].startswith(
        f"all-reduce {3 if combined else 5} / 5 per token, 5.0 KiB / 5.0 KiB")
    md = render_markdown(res)
    assert md.startswith("## Generation\n")
    assert "| 8 | 2 x 4 | 640 | 100 (100 - 100) | 320 | 200 (200 - 200) | **2.00x** |" in md
    assert ("first difference at row 0, token 48" in md) is mismatch
    assert "| 8 | 1 x 1 (reference) | 1,280 |" in md  # not in the targets
    assert "batch 8: 1,280 tokens/s on 1 x 1, 4.00x transformers, 2.0x its 2 x 4 rate" in md
    assert ("XLA combined some of them" in md) is combined
    assert ("2 in the body of the layer loop, which runs 2 times (one layer per trip)"
            in md) is not combined
    for t in targets:
        assert f"| {t['target']} | {t['measured']} | PASS |" in md

    res["gpu"]["argument_bytes"] = 2 * 69632  # twice the analytic: a miss
    res["gpu"]["collectives"][-1]["bytes"] = 8192  # the logits gathered in fp32: a miss
    assert [t["met"] for t in evaluate_targets(res)] == [True, False, False]

    for row in res["cpu"]["rows"]:
        row.update(transformers={"error": "no Python with torch"}, ratio=None,
                   round_ratios=None, tokens=None)
    res["gpu"] = {"error": "no CUDA PJRT plugin"}
    res["targets"] = targets = evaluate_targets(res)
    assert [t["met"] for t in targets] == [None, None, None]
    assert targets[0]["measured"].startswith("not measured: no Python with torch (batch 1:")
    md = render_markdown(res)
    assert "transformers not measured: `no Python with torch`." in md
    assert md.rstrip().endswith("Not measured: `no CUDA PJRT plugin`.")


@pytest.mark.slow
def test_causal_attention_matches_autodiff_and_keeps_no_score_matrix():
    from benchmarks.superseded import causal_attention
    from sp_jax.analysis import saved_residuals

    rng = np.random.default_rng(8)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32) for _ in range(3))
    probe = jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32)

    def plain(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    chex.assert_trees_all_close(causal_attention(q, k, v), plain(q, k, v), rtol=1e-5,
                                atol=1e-5)
    grads = jax.grad(lambda *a: jnp.sum(causal_attention(*a) * probe), argnums=(0, 1, 2))
    plain_grads = jax.grad(lambda *a: jnp.sum(plain(*a) * probe), argnums=(0, 1, 2))
    chex.assert_trees_all_close(grads(q, k, v), plain_grads(q, k, v), rtol=1e-5, atol=1e-5)
    # residuals: q, k, v, out and the [b, heads, s] log-sum-exp; nothing of size s x s
    shapes = [r.shape for r in saved_residuals(causal_attention, q, k, v)]
    assert (2, 4, 16) in shapes
    assert not any(s[-2:] == (16, 16) for s in shapes)


RENDERED_AS_COMMITTED = ("Activation memory per layer and device", "Collectives per layer",
                         "8 x H100: peak memory and async collectives (deviceless compile)",
                         "CPU step time", "CPU: the whole GPT training step",
                         "Long context: a context mesh axis", "On a real GPU (`make gpu-check`)")


def test_committed_results_render_as_committed():
    """The renderer fed the committed results (docs/bench.json, the last full run) gives
    BENCHMARKS.md's sections of that run as committed (the sections re-measured on their
    own and spliced in are not in docs/bench.json: ``python -m benchmarks.check_render``
    shows them)."""
    from benchmarks.render import render_document

    root = Path(__file__).resolve().parents[1]
    rendered = render_document(json.loads((root / "docs" / "bench.json").read_text()),
                               root / "docs")

    def sections(text: str) -> dict[str, str]:
        return {b.split("\n", 1)[0]: b.strip() for b in ("\n" + text).split("\n## ")[1:]}

    committed, ours = sections((root / "BENCHMARKS.md").read_text()), sections(rendered)
    for title in RENDERED_AS_COMMITTED:
        assert ours[title] == committed[title], title


def test_recorded_sections_say_when_and_how_and_nothing_is_left_out():
    """What ``make bench`` does not measure is recorded in docs/bench_recorded.json, each
    entry with when, how, where and why, placed after a section of the document; the
    report renders each (its provenance line, then its text) after that section, and
    every section of the committed BENCHMARKS.md is either the run's or recorded."""
    from benchmarks.records import RECORDED_FIELDS, load_recorded
    from benchmarks.render import SECTIONS, render_document
    from benchmarks.run import RECORDED

    root = Path(__file__).resolve().parents[1]
    entries = load_recorded(RECORDED)
    keys = [e["key"] for e in entries]
    assert len(set(keys)) == len(keys) > 10
    for i, e in enumerate(entries):
        assert set(e) == set(RECORDED_FIELDS), e["key"]
        assert e["after"] in {k for k, _ in SECTIONS} | set(keys[:i]), e["key"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", e["date"]) and e["command"] and e["why"]
        assert e["heading"] is None or re.fullmatch(r"#{2,3} \S.*", e["heading"])
    res = json.loads((root / "docs" / "bench.json").read_text()) | {"recorded": entries}
    md = render_document(res, root / "docs")
    at = [md.index(f"measured on {e['date']} with `{e['command']}`") for e in entries]
    for e, i in zip(entries, at, strict=True):
        assert md.index(e["markdown"]) > i
    with pytest.raises(ValueError, match="follow no section"):
        render_document(res | {"recorded": [{**entries[0], "after": "nowhere"}]},
                        root / "docs")
    # each "## " section of the committed document: rendered from a run's results (those
    # not in the committed docs/bench.json: the run's own sections) or recorded
    own = {"## Pipeline parallelism", "## Packed documents", "## Generation",
           "## FSDP on 8 x H100", ZERO1_TITLE,
           "## Mixture of experts", "## FP8"}
    heads = {line for line in md.splitlines() if line.startswith("## ")}
    committed = {line for line in (root / "BENCHMARKS.md").read_text().splitlines()
                 if line.startswith("## ")}
    assert committed - heads <= own, committed - heads - own
