"""Structural facts that must not regress: activation bytes vs the paper's formula,
Megatron's collective counts, and async backward collectives in XLA:GPU's H100 HLO."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import h100_block_stack, without_jax_plugins
from conftest import make_mesh, requires_cuda_plugin
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax.analysis import (
    COLLECTIVE_KINDS,
    CollectiveStats,
    PeakBreakdown,
    activation_bytes_formula,
    collective_stats,
    compile_for_gpu,
    gpu_mesh,
    parse_collectives,
    peak_breakdown,
    saved_residuals,
)
from sp_jax.models import Block, GPTConfig

# --------------------------------------------------------------------------------------
# The formula
# --------------------------------------------------------------------------------------


def test_formula_matches_the_paper():
    s, b, h, a, t = 2048, 1, 4096, 32, 8
    sbh = s * b * h
    assert activation_bytes_formula(s, b, h, a, 1, "none") == sbh * (34 + 5 * a * s / h)
    # SP divides everything by t; TP alone leaves the 10*sbh of LN/dropout/inputs
    assert activation_bytes_formula(s, b, h, a, t, "tp_sp") == pytest.approx(
        activation_bytes_formula(s, b, h, a, 1, "none") / t)
    assert activation_bytes_formula(s, b, h, a, t, "tp") == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert activation_bytes_formula(s, b, h, a, t, "tp_sp_selective") == sbh / t * 34
    assert activation_bytes_formula(s, b, h, a, t, "full") == 2 * sbh
    # Table 2 of the paper, GPT-3 175B-like layer at t=8: 114 MiB with TP+SP
    assert activation_bytes_formula(s, b, h, a, t, "tp_sp") / 2**20 == pytest.approx(114.0)
    with pytest.raises(ValueError, match="mode='sp'"):
        activation_bytes_formula(s, b, h, a, t, "sp")
    with pytest.raises(ValueError, match="t=0"):
        activation_bytes_formula(s, b, h, a, 0)


# --------------------------------------------------------------------------------------
# Activation bytes of a real-size layer (abstract evaluation: nothing is computed)
# --------------------------------------------------------------------------------------

H, A, S, B, T = 4096, 32, 2048, 1, 8


def _layer_activation_bytes(recompute):
    """Per-device bytes of one GPT layer's saved activations (parameters excluded)."""
    mesh = make_mesh(1, T)
    cfg = GPTConfig(vocab_size=256, max_seq_len=S, num_layers=1, num_heads=A, hidden=H,
                    dtype=jnp.bfloat16)
    parallel = sp_jax.ParallelConfig(recompute_allgather=recompute, data_axis=None)
    with jax.set_mesh(mesh):
        block = nnx.eval_shape(lambda: Block(cfg, parallel, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(block)
        x = jax.ShapeDtypeStruct((B, S, H), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P(None, "tensor", None)))
        residuals = saved_residuals(lambda p, x: nnx.merge(graphdef, p)(x), params, x)
    param_blocks = {(tuple(p.sharding.shard_shape(p.shape)), np.dtype(p.dtype))
                    for p in jax.tree.leaves(params)}
    return sum(r.device_bytes for r in residuals
               if (r.device_shape, r.dtype) not in param_blocks)


@pytest.mark.slow
def test_layer_activations_within_the_papers_tp_sp_figure():
    formula = activation_bytes_formula(S, B, H, A, T, "tp_sp")
    save, recompute = _layer_activation_bytes(False), _layer_activation_bytes(True)
    assert recompute <= formula
    # no s x s term: at most the paper's *selective* figure plus the out-projection copy
    selective = activation_bytes_formula(S, B, H, A, T, "tp_sp_selective")
    assert recompute <= selective + S * B * H * 2 // T
    # save mode keeps the two gathered [b, s, h] bf16 inputs instead of their shards
    gathered = 2 * S * B * H * 2
    assert save - recompute == gathered * (T - 1) // T


# --------------------------------------------------------------------------------------
# Collectives per layer (CPU compile, 8 simulated devices)
# --------------------------------------------------------------------------------------

h_small, s_small = 64, 32


def _compiled_layer_grad(recompute):
    """(compiled grad of one layer on a data=2 x tensor=4 mesh, per-device param shapes)."""
    mesh = make_mesh(2, 4)
    cfg = GPTConfig(vocab_size=256, max_seq_len=s_small, num_layers=1, num_heads=4,
                    hidden=h_small)
    parallel = sp_jax.ParallelConfig(recompute_allgather=recompute)
    with jax.set_mesh(mesh):
        block = Block(cfg, parallel, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(block)
        x = jax.reshard(jnp.ones((4, s_small, h_small)), P("data", "tensor", None))

        def loss(p, x):
            return jnp.sum(nnx.merge(graphdef, p)(x) ** 2)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    shapes = {tuple(p.sharding.shard_shape(p.shape)) for p in jax.tree.leaves(params)}
    return compiled, shapes


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [False, True])
def test_collectives_per_layer_equal_megatrons(recompute):
    stats = collective_stats(_compiled_layer_grad(recompute)[0])
    # forward: 2 all-gathers (qkv, up) + 2 reduce-scatters (out, down);
    # backward: 2 reduce-scatters (dx of qkv, up) + 2 all-gathers (dy of out, down),
    # plus 2 re-gathers of the inputs with recompute_allgather.
    assert stats.operands["all-gather"] == 4 + (2 if recompute else 0)
    assert stats.operands["reduce-scatter"] == 4
    assert stats.operands["collective-permute"] == 0
    assert stats.operands["all-to-all"] == 0


@pytest.mark.slow
def test_no_all_reduce_of_activations():
    """Every all-reduced array is one device's block of a parameter gradient (the
    data-parallel sum, and the norms' replicated scales/biases): no activation."""
    compiled, param_shapes = _compiled_layer_grad(True)
    reduced = []
    for line in compiled.as_text().splitlines():
        if re.search(r" all-reduce(-start)?\(", line):
            result = line.split(" = ", 1)[1].split(" all-reduce", 1)[0]
            reduced += [tuple(int(d) for d in dims.split(",") if d)
                        for dims in re.findall(r"f32\[([\d,]*)\]", result)]
    assert reduced, "the parameters' data-parallel gradients are all-reduced"
    assert set(reduced) <= param_shapes, set(reduced) - param_shapes


# A hand-written HLO text: every number below is counted by hand. An async all-gather of
# two arrays with one fusion scheduled inside it, an all-reduce of a concatenation (XLA:GPU's
# combiner; the two arrays are what it moves), a synchronous reduce-scatter from backward.
HLO_TEXT = "\n".join([
    "HloModule m",
    '  %ag = bf16[8,4]{1,0} all-gather(bf16[2,4]{1,0} %p), dimensions={0}, '
    'metadata={op_name="jit(f)/jvp()/shard_map/all_gather"}',
    "  %ags = ((bf16[2,4]{1,0}, f32[2]{0}), (bf16[8,4]{1,0}, f32[8]{0})) "
    "all-gather-start(bf16[2,4]{1,0} %p, f32[2]{0} %q), dimensions={0}, "
    'backend_config={"collective_backend_config":{"is_sync":false}}',
    "  %fus = f32[8]{0} fusion(f32[2]{0} %q), kind=kLoop",
    "  %gte = f32[8]{0} get-tuple-element(%fus), index=0",
    "  %agd = (bf16[8,4]{1,0}, f32[8]{0}) all-gather-done(%ags)",
    "  %a = f32[4]{0} parameter(0)",
    "  %b = f32[8]{0} parameter(1)",
    "  %wrapped_concatenate = f32[12]{0} fusion(%a, /*index=1*/%b), kind=kLoop",
    "  %ars = f32[12]{0} all-reduce-start(%wrapped_concatenate), to_apply=%add, "
    'backend_config={"collective_backend_config":{"is_sync":true}}',
    "  %ard = f32[12]{0} all-reduce-done(%ars)",
    "  ROOT %rs = bf16[2,4]{1,0} reduce-scatter(bf16[8,4]{1,0} %g), dimensions={0}, "
    'metadata={op_name="jit(f)/transpose(jvp())/shard_map/reduce_scatter"}',
])


@pytest.mark.slow
def test_parse_collectives_and_collective_stats_count_alike():
    ag, ags, ar, rs = parse_collectives(HLO_TEXT)
    assert (ag.kind, ag.phase, ag.arrays, ag.bytes, ag.is_async) == (
        "all-gather", "forward", [("bf16", (8, 4))], 64, False)
    assert ags.arrays == [("bf16", (8, 4)), ("f32", (8,))]  # results, not operands
    assert (ags.bytes, ags.is_async, ags.overlapped_ops, ags.phase) == (96, True, 1, "unknown")
    assert ar.arrays == [("f32", (4,)), ("f32", (8,))] and ar.bytes == 48
    assert not ar.is_async  # is_sync true
    assert (rs.kind, rs.phase, rs.bytes, rs.operands) == ("reduce-scatter", "backward", 16, 1)

    stats = collective_stats(HLO_TEXT)
    assert set(stats.ops) == set(COLLECTIVE_KINDS)
    assert stats.ops == {"all-gather": 2, "reduce-scatter": 1, "all-reduce": 1,
                         "collective-permute": 0, "all-to-all": 0, "ragged-all-to-all": 0}
    assert stats.operands["all-gather"] == 3 and stats.operands["all-reduce"] == 2
    assert stats.bytes["all-gather"] == 160 and stats.bytes["all-reduce"] == 48
    assert stats.async_ops == {**dict.fromkeys(COLLECTIVE_KINDS, 0), "all-gather": 1}
    assert stats == CollectiveStats.of(parse_collectives(HLO_TEXT))


@pytest.mark.slow
def test_parse_collectives_of_a_compiled_layer():
    """On XLA:CPU's HLO of one layer (Megatron's counts, see above), the per-instruction
    view sums to the per-kind counts, and every collective has its phase and issuer."""
    compiled, _ = _compiled_layer_grad(True)
    ops = parse_collectives(compiled)
    stats = collective_stats(compiled.as_text())
    for kind in COLLECTIVE_KINDS:
        mine = [c for c in ops if c.kind == kind]
        assert stats.ops[kind] == len(mine)
        assert stats.operands[kind] == sum(c.operands for c in mine)
        assert stats.bytes[kind] == sum(c.bytes for c in mine)
    gathers = [c for c in ops if c.kind == "all-gather"]
    assert sum(c.operands for c in gathers if c.phase == "forward") == 2
    assert sum(c.operands for c in gathers if c.phase == "backward") == 4  # 2 dy + 2 re-gathers
    assert all(c.functions for c in gathers), [c.op_name for c in gathers]


LIVE_RANGE_TEXT = """\
HloLiveRange (max 9):
  InstructionSequence:
    0:p
  BufferLiveRange:
    p{}:0-9
    ag{}:1-3
    ag{1}:1-6
    dot.1{}:4-9
    t{}:2-5
  Live ranges at 5 (peak):
    p{}: 262144 bytes (cumulative: 262144 bytes)
  Peak usage: whatever XLA prints before the breakdown
  Stack trace breakdown for peak usage: 5 242 880 bytes
    main.0_spmd (100.0%, total: 5 242 880 bytes, current: 0 bytes, remaining: 5 242 880 bytes)
      ├── x (5.0%, total: 262 144 bytes, current: 262 144 bytes, remaining: 0 bytes)
      ├── jit(f)/transpose(jvp())/dot_general (45.0%, total: 2 359 296 bytes, current: 1 bytes)
      │   └── jit(f)/transpose(jvp())/inner (5.0%, total: 262 144 bytes, current: 1 bytes)
      └── w (10.0%, total: 2 621 440 bytes, current: 524 288 bytes, remaining: 262 144 bytes)
"""
LIVE_RANGE_HLO = """\
  %p = bf16[64,1024]{1,0} parameter(0), metadata={op_name="x"}
  %ag = (bf16[8,1024]{1,0}, bf16[64,1024]{1,0}) all-gather-start(%p), metadata={op_name=\
"jit(f)/transpose(jvp())/all_gather"}
  %t = (f32[4]{0}, f32[4]{0}) tuple(%a, %b)
  %dot.1 = f32[1024,1024]{1,0} dot(%p, %p), metadata={op_name="jit(f)/jvp()/dot_general"}
"""


def test_peak_breakdown_reads_the_top_level_entries_and_live_ranges():
    peak = peak_breakdown(LIVE_RANGE_TEXT)
    assert peak == PeakBreakdown(peak_bytes=5_242_880, entries=[
        ("w", 2_621_440), ("jit(f)/transpose(jvp())/dot_general", 2_359_296), ("x", 262_144)],
        peak_position=5)
    assert peak.as_dict() == {"peak_bytes": 5_242_880, "entries": [
        ["w", 2_621_440], ["jit(f)/transpose(jvp())/dot_general", 2_359_296],
        ["x", 262_144]], "peak_position": 5}
    assert peak_breakdown("no peak section here") is None
    buffers = {b.name: b for b in peak_breakdown(LIVE_RANGE_TEXT, LIVE_RANGE_HLO).buffers}
    # a tuple as a whole (ag{}, t{}) holds no memory of its own
    assert set(buffers) == {"p{}", "ag{1}", "dot.1{}"}
    gathered = buffers["ag{1}"]
    assert (gathered.shape, gathered.bytes, gathered.start, gathered.end) == (
        "bf16[64,1024]", 64 * 1024 * 2, 1, 6)
    assert gathered.backward and not buffers["dot.1{}"].backward
    live = peak_breakdown(LIVE_RANGE_TEXT, LIVE_RANGE_HLO).live_at(5)
    assert sorted(b.name for b in live) == ["ag{1}", "dot.1{}", "p{}"]


# --------------------------------------------------------------------------------------
# XLA:GPU, 8 x H100 (deviceless compile)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def h100_reports():
    cfg = GPTConfig(vocab_size=256, max_seq_len=512, num_layers=2, num_heads=8, hidden=512,
                    dtype=jnp.bfloat16)
    reports = {}
    for recompute in (False, True):
        parallel = sp_jax.ParallelConfig(recompute_allgather=recompute, data_axis=None,
                                         wgrad_dtype=jnp.float32)
        with jax.set_mesh(gpu_mesh((8,), ("tensor",))):
            blocks = nnx.eval_shape(
                lambda p=parallel: nnx.List([Block(cfg, p, rngs=nnx.Rngs(i)) for i in range(2)]))
            graphdef, params = nnx.split(blocks)
        x = jax.ShapeDtypeStruct((1, 512, 512), jnp.bfloat16, sharding=P(None, "tensor", None))

        def grad(params, x, graphdef=graphdef):
            def loss(p, x):
                for block in nnx.merge(graphdef, p):
                    x = block(x)
                return jnp.sum(x.astype(jnp.float32) ** 2)

            return jax.grad(loss, argnums=(0, 1))(params, x)

        reports[recompute] = compile_for_gpu(grad, params, x, mesh_shape=(8,),
                                             axis_names=("tensor",))
    return reports


def _starts(hlo, scope):
    """is_sync flags of the collective starts whose op_name contains ``scope``."""
    out = []
    for line in hlo.splitlines():
        if re.search(r"-start(\.\d+)? = ", line) and f"/{scope}/" in line:
            out.append('"is_sync":false' in line)
    return out


@pytest.mark.slow
@requires_cuda_plugin
def test_h100_backward_dx_reduce_scatter_and_regather_are_async(h100_reports):
    save, rec = h100_reports[False], h100_reports[True]
    assert rec.collectives.ops["reduce-scatter"] == save.collectives.ops["reduce-scatter"] > 0
    for report in (save, rec):
        dx = _starts(report.hlo, "sp_dx_reduce_scatter")
        assert len(dx) == 4 and all(dx), dx  # 2 layers x (qkv, up)
    regather = _starts(rec.hlo, "sp_regather")
    assert len(regather) == 4 and all(regather), regather
    assert _starts(save.hlo, "sp_regather") == []
    assert rec.collectives.async_ops["all-gather"] > save.collectives.async_ops["all-gather"]


@pytest.mark.slow
@requires_cuda_plugin
def test_h100_peak_memory_recompute_below_save(h100_reports):
    save, rec = h100_reports[False], h100_reports[True]
    assert rec.peak_bytes < save.peak_bytes
    assert rec.peak_bytes == (rec.temp_bytes + rec.argument_bytes + rec.output_bytes
                              - rec.alias_bytes)
    assert "H100" in str(gpu_mesh((8,), ("tensor",)).devices.flat[0].device_kind)


def test_compile_for_gpu_errors():
    with pytest.raises(ValueError, match="Unknown GPU target 'a100'"):
        compile_for_gpu(lambda x: x, jnp.ones(4), mesh_shape=(8,), axis_names=("t",),
                        target="a100")
    with pytest.raises(ValueError, match="differ in length"):
        gpu_mesh((2, 4), ("tensor",))


def test_compile_for_gpu_without_the_plugin_says_how_to_install(monkeypatch):
    import importlib.util

    from sp_jax.analysis import gpu

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                        if name == "jax_plugins.xla_cuda12" else real_find_spec(name, *a))
    _gpu_mesh_says_how_to_install(gpu)


def _gpu_mesh_says_how_to_install(gpu) -> None:
    """gpu_mesh raises the install hint (the topology cache cleared around it)."""
    gpu._topology.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"pip install --no-deps jax-cuda12-plugin=="):
            gpu_mesh((8,), ("tensor",))
    finally:
        gpu._topology.cache_clear()


def test_no_jax_plugins_package_at_all_is_a_missing_plugin(monkeypatch):
    """A plain install has no ``jax_plugins`` package: looking up the plugin must not
    raise ModuleNotFoundError for the parent but say the plugin is missing."""
    from sp_jax.analysis import cuda_plugin_available, gpu

    without_jax_plugins(monkeypatch)
    assert cuda_plugin_available() is False
    _gpu_mesh_says_how_to_install(gpu)


@requires_cuda_plugin
def test_h100_tp_column_dx_all_reduce_is_async():
    """mp_async_allreduce for the plain TP layers: the dx all-reduce entering the TP
    region runs concurrently with other work in backward (is_sync false)."""
    h, s = 1024, 1024
    parallel = sp_jax.ParallelConfig(data_axis=None)
    with jax.set_mesh(gpu_mesh((8,), ("tensor",))):
        layers = nnx.eval_shape(lambda: nnx.List([m for i in range(2) for m in (
            sp_jax.ColumnParallelLinear(h, 4 * h, parallel=parallel, dtype=jnp.bfloat16,
                                        rngs=nnx.Rngs(i)),
            sp_jax.RowParallelLinear(4 * h, h, parallel=parallel, dtype=jnp.bfloat16,
                                     rngs=nnx.Rngs(i)))]))
        graphdef, params = nnx.split(layers)
    x = jax.ShapeDtypeStruct((1, s, h), jnp.bfloat16, sharding=P())

    def grad(params, x):
        def loss(p, x):
            m = nnx.merge(graphdef, p)
            for i in (0, 2):
                x = x + m[i + 1](jax.nn.gelu(m[i](x)))
            return jnp.sum(x.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    report = compile_for_gpu(grad, params, x, mesh_shape=(8,), axis_names=("tensor",))
    dx = _starts(report.hlo, "tp_dx_all_reduce")
    assert len(dx) == 2 and all(dx), dx


@pytest.mark.slow
@requires_cuda_plugin
def test_compile_for_gpu_reports_what_is_live_at_the_peak(tmp_path):
    x = jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=P(None, "tensor"))
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=P("tensor", None))

    def grad(x, w):
        return jax.grad(lambda x, w: jnp.sum(jnp.tanh(x @ w) ** 2), argnums=(0, 1))(x, w)

    kw = dict(mesh_shape=(8,), axis_names=("tensor",), axis_types=jax.sharding.AxisType.Auto)
    plain = compile_for_gpu(grad, x, w, **kw)
    assert plain.peak_live is None and plain.as_dict()["peak_live"] is None
    report = compile_for_gpu(grad, x, w, live_buffers=True, **kw)
    peak = report.peak_live
    assert 0 < peak.peak_bytes <= report.peak_bytes == plain.peak_bytes
    sizes = [b for _, b in peak.entries]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) == peak.peak_bytes
    assert {"x", "w"} <= {name for name, _ in peak.entries}  # the arguments, by name
    assert report.as_dict()["peak_live"] == peak.as_dict()
    # a dump directory of the caller's is used and kept
    kept = compile_for_gpu(grad, x, w, live_buffers=True,
                           compiler_options={"xla_dump_to": str(tmp_path)}, **kw)
    assert kept.peak_live == peak
    assert list(tmp_path.glob("*after_optimizations-live-range.txt"))


@pytest.mark.slow
@requires_cuda_plugin
@pytest.mark.parametrize("recompute", [False, True], ids=["save", "recompute"])
def test_h100_no_gathered_activation_outlives_its_layers_backward(recompute):
    """In XLA's buffer live ranges of a compiled multi-layer step, every gathered
    ``[b, s, h]`` buffer of the backward pass (a row layer's dy, a column layer's
    re-gathered input) dies within one layer's backward, and as many are alive at once
    with 4 layers as with 2: none waits for a weight-gradient GEMM at the end."""
    s, h = 512, 256
    concurrent = {}
    for layers in (2, 4):
        live = h100_block_stack(layers, h=h, s=s, recompute=recompute,
                                live_buffers=True).peak_live
        backward = [b for b in live.buffers if b.backward]
        per_layer = (max(b.end for b in backward) - min(b.start for b in backward)) / layers
        gathered = [b for b in backward if b.shape.startswith("bf16[")
                    and b.shape.rstrip("]").split("[")[1].split(",")[-2:] == [str(s), str(h)]]
        assert len(gathered) >= 2 * layers, [b.name for b in gathered]  # 2 dy per layer
        longest = max(gathered, key=lambda b: b.end - b.start)
        assert longest.end - longest.start < per_layer, (longest, per_layer)
        ends = sorted((b.start, b.end) for b in gathered)
        concurrent[layers] = max(sum(a <= t_ <= b for a, b in ends) for t_, _ in ends)
    assert concurrent[4] == concurrent[2] <= 3, concurrent
