"""The memory planner (``sp_jax.analysis.plan``, ``python -m sp_jax.plan``): its parameter
and optimizer bytes equal the analytic values, its activation figure is the compiled
step's, sharding over data shrinks what it should, and the command line prints the table."""

import dataclasses
import math

import jax
import pytest
from _util import slow_except, without_jax_plugins
from conftest import requires_cuda_plugin

from sp_jax.analysis.plan import (
    MODELS,
    ModelShape,
    PlanOption,
    PlanRow,
    candidates,
    format_table,
    pipeline_stage_counts,
    plan,
)

TINY = ModelShape("tiny", hidden=256, layers=2, heads=8, vocab=512, seq=256)


def test_parameter_count_of_the_presets():
    # GPT blocks with a 4h MLP: 12 h^2 per layer dominates
    assert 6.4e9 < MODELS["7b"].params < 6.7e9
    assert 64e9 < MODELS["70b"].params < 66e9
    assert 174e9 < MODELS["gpt3-175b"].params < 176e9
    assert 1.2e9 < MODELS["1.3b"].params < 1.4e9
    assert 0.12e9 < MODELS["gpt2-small"].params < 0.17e9


def test_candidates():
    seventy = candidates(MODELS["70b"], 64)
    flat = [o for o in seventy if not o.pipelined]
    assert {(o.data, o.context, o.tensor) for o in flat} == {(8, 1, 8)}
    assert {(o.fsdp, o.remat) for o in flat} == {(False, True), (True, False), (True, True)}
    long = candidates(MODELS["7b"].replace(seq=131072), 64)
    assert all(o.context > 1 and o.tensor == 8 for o in long if not o.pipelined)
    small = candidates(MODELS["7b"], 8)
    assert (8, 1, 1) in {(o.data, o.context, o.tensor) for o in small}
    # Pipelines: the stage axis over the hosts beyond one tensor group (none on one host),
    # the two largest stage counts dividing the layers, 1F1B with 4 micro-batches a stage
    assert not any(o.pipelined for o in small)
    piped = [o for o in seventy if o.pipelined]
    assert {o.mesh_shape for o in piped} == {(4, 2, 1, 8), (8, 1, 1, 8)}
    assert all(o.axis_names == ("stage", "data", "context", "tensor") and o.gpus == 64
               and o.pipeline_schedule == "1f1b" and o.micro_batches == 4 * o.stages
               for o in piped)
    assert {(o.stages, o.fsdp, o.remat) for o in piped} == {
        (4, False, False), (4, False, True), (4, True, True), (8, False, False),
        (8, False, True)}  # sharding over data only where there is a data axis
    assert "4x2x1x8 recompute_allgather+remat+1f1b (4 stages, M=16, bubble 16%)" in [
        o.label for o in piped]
    assert {o.mesh_shape for o in candidates(MODELS["gpt3-175b"], 128) if o.pipelined} == {
        (8, 2, 1, 8), (16, 1, 1, 8)}
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        plan("gpt5", 8)
    with pytest.raises(ValueError, match="do not use 8 GPUs"):
        plan(TINY, 8, options=[PlanOption(2, 1, 2, fsdp=True, remat=False)], progress=False)


@pytest.fixture(scope="module")
def small():
    """``benchmarks.plan.small_check(TINY)``: the plan of data 2 x tensor 4 sharded over
    data, and the same step compiled for the 8 simulated CPU devices."""
    from sp_jax.analysis.checks import plan_cpu_check as small_check

    return small_check(TINY)


def _row(d: dict) -> PlanRow:
    fields = {f.name for f in dataclasses.fields(PlanRow)}
    return PlanRow(**{k: v for k, v in d.items() if k in fields} | {
        "option": PlanOption(**d["option"])})


@pytest.mark.slow
@requires_cuda_plugin
def test_plan_bytes_match_analytic_and_sharding_over_data_shrinks_them(small):
    (replicated,) = plan(TINY, 8, options=[PlanOption(2, 1, 4, fsdp=False, remat=False)],
                         progress=False)
    sharded = _row(small["row"])
    assert sharded.option == PlanOption(2, 1, 4, fsdp=True, remat=False)
    rows = [replicated, sharded]
    assert not any(r.error for r in rows), [r.error for r in rows]
    for r in rows:
        # fp32 parameters; AdamW: two fp32 moments + a count
        assert r.param_bytes == pytest.approx(r.formula_param_bytes, rel=0.01)
        assert r.opt_bytes == pytest.approx(2 * r.param_bytes, rel=0.01)
        assert r.peak_bytes > r.param_bytes + r.opt_bytes and r.fits
        assert r.activation_bytes > 0 and r.collective_bytes > 0
    # sharding over data=2 halves the kernels' and tables' share (norms, biases stay)
    assert sharded.param_bytes < 0.55 * replicated.param_bytes
    assert sharded.peak_bytes < replicated.peak_bytes
    table = format_table(TINY, rows)
    assert "2x1x4 recompute_allgather+fsdp" in table and "| yes |" in table


@pytest.mark.slow
@requires_cuda_plugin
def test_activation_figure_is_the_compiled_temp_on_cpu_too(small):
    """The plan's activation figure (deviceless H100 compile) against the same training
    step compiled for the 8 simulated CPU devices (``benchmarks.plan.small_check``, which
    ``make bench`` reports): within 20%. The GPU program runs the fsdp weight gathers and
    gradient reduce-scatters asynchronously, overlapped with the GEMMs, so some of their
    buffers are alive together; XLA:CPU runs every collective synchronously. At this tiny
    size, where the weights are as large as the activations, that is measured at +15%
    (7.42 MB against 6.45; 6.90 before the backward gathers became bf16 and async)."""
    check = small
    acts = check["row"]["activation_bytes"]
    assert math.isclose(acts, check["cpu_activation_bytes"], rel_tol=0.20), check


@pytest.mark.slow
@requires_cuda_plugin
def test_command_line_prints_the_table(capsys):
    from sp_jax.plan import main

    assert main(["--hidden", "128", "--layers", "1", "--heads", "4", "--vocab", "256",
                 "--seq", "128", "--gpus", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out  # (which layouts it compiles: test_candidates)
    assert out.startswith("custom: h=128, 1 layers") and "MiB per GPU" in out
    assert "| 1x1x1 recompute_allgather+remat | 1 |" in out
    assert "| 1x1x1 recompute_allgather | 1 |" in out


def _grad_temp(layers: int, fsdp: bool) -> int:
    """XLA temp of the loss gradient (no optimizer: the gradients are outputs) of TINY
    with ``layers`` scanned, rematerialised layers on 2 x 4 H100s."""
    from flax import nnx

    import sp_jax
    from sp_jax import Layout
    from sp_jax.analysis import compile_for_gpu, gpu_mesh
    from sp_jax.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=TINY.vocab, max_seq_len=TINY.seq, num_layers=layers,
                    num_heads=TINY.heads, hidden=TINY.hidden, positions="rotary",
                    dtype=jax.numpy.bfloat16, scan_layers=True, remat=True)
    parallel = sp_jax.ParallelConfig(fsdp=fsdp, recompute_allgather=True,
                                     wgrad_dtype=jax.numpy.float32)
    with jax.set_mesh(gpu_mesh((4, 2), ("data", "tensor"))):
        model = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((4, TINY.seq), jax.numpy.int32,
                                  sharding=Layout.of(parallel).tokens)

    def grads(params, rest, tokens):
        return jax.grad(lambda p: nnx.merge(graphdef, p, rest).loss(tokens, tokens))(params)

    return compile_for_gpu(grads, params, rest, tokens, mesh_shape=(4, 2),
                           axis_names=("data", "tensor")).temp_bytes


@pytest.mark.slow
@requires_cuda_plugin
def test_only_one_layers_gathered_weights_stay_alive_with_scan_and_remat():
    """Sharded over data with scanned, rematerialised layers, the gradient's temp grows
    per layer (4 -> 8 layers, data 4 x tensor 2) by far less than one layer's gathered
    weights: the other layers' gathered weights are not kept. (What it grows by: each
    layer's input and a bf16 copy of the layer's weight *shard*, 1/4 of the gathered
    weights, that XLA converts before the gather.)"""
    h, t = TINY.hidden, 2
    growth = (_grad_temp(8, True) - _grad_temp(4, True)) / 4
    one_layer_weights = 12 * h * h // t * 2  # q, k, v, out + MLP kernels, bf16, gathered
    assert 0 <= growth < one_layer_weights / 3, (growth, one_layer_weights)


def test_xla_does_not_fit_lines_are_kept_out_and_explained():
    """What XLA:GPU prints when a layout's arguments exceed its scheduler's memory limit is
    matched whole (so it can be kept off stderr) and explained under the table, with the
    limit, for the rows it concerns."""
    from sp_jax.analysis.plan import XLA_DOES_NOT_FIT

    lines = ["E1201 13:29:45.617483    1920 gpu_hlo_schedule.cc:968] The byte size of "
             "input/output arguments (97081328021) exceeds the base limit (67954383257). "
             "This indicates an error in the calculation!",
             "W1201 13:29:46.126931    1920 hlo_rematerialization.cc:3231] Can't reduce "
             "memory use below 90.41GiB (97081295253 bytes) by rematerialization; only "
             "reduced to 152.08GiB (163298513209 bytes), down from 152.08GiB (163298595645 "
             "bytes) originally"]
    assert all(any(p.fullmatch(line) for p in XLA_DOES_NOT_FIT) for line in lines)
    assert not any(p.fullmatch("E1201 something else went wrong") for p in XLA_DOES_NOT_FIT)
    model = MODELS["70b"]
    fits, too_big = (PlanRow(PlanOption(8, 1, 8, fsdp=f, remat=True), 8, 1, 1, 1, 1,
                             2**30 * (20 if f else 150), f, 1, 1.0, 1.0, 1.0,
                             xla_notes=() if f else tuple(lines)) for f in (True, False))
    table = format_table(model, [too_big, fits])
    assert "XLA:GPU warned while compiling 8x1x8 recompute_allgather+remat:" in table
    assert "scheduler plans with (63.3 GiB)" in table and table.count("XLA:GPU warned") == 1
    assert "8x1x8 recompute_allgather+fsdp+remat:" not in table


def test_command_line_without_the_plugin_is_one_error_line(monkeypatch, capsys):
    """A plain install (no CUDA plugin, not even a jax_plugins package): the planner ends
    with one line saying how to install it, exit status 1, no traceback."""
    from sp_jax.analysis import gpu
    from sp_jax.plan import main

    without_jax_plugins(monkeypatch)
    gpu._topology.cache_clear()
    try:
        assert main(["--model", "7b", "--gpus", "8", "--no-progress"]) == 1
    finally:
        gpu._topology.cache_clear()
    err = capsys.readouterr().err
    assert err.startswith("error: Deviceless GPU compilation needs the CUDA PJRT plugin")
    assert "pip install '.[gpu-aot]'" in err and "Traceback" not in err


def test_sharding_over_data_only_where_the_data_size_divides_the_hidden_size():
    """7B on 6 GPUs: tensor 2 x data 3, and 3 does not divide h=4096: no fsdp layout is
    proposed (it could not be built), the replicated ones are."""
    options = candidates(MODELS["7b"], 6)
    assert options and all((o.data, o.tensor) == (3, 2) and not o.fsdp for o in options)
    assert any(o.fsdp for o in candidates(MODELS["7b"], 8))


def test_help_has_the_whole_description(capsys):
    from sp_jax.plan import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0
    assert "from deviceless XLA:GPU compiles of the real training step (no GPU needed)." in out


def test_pipelined_candidates_on_request_and_their_errors():
    """Stage counts and micro-batches on request; a batch sets M (one sequence per
    micro-batch and data shard); long sequences keep a context axis inside each stage;
    impossible requests are ValueErrors naming the value and what would work."""
    seventy = MODELS["70b"]
    assert pipeline_stage_counts(seventy, 64) == [2, 4, 8]
    (two,) = {o.mesh_shape for o in candidates(seventy, 64, stages=[2]) if o.pipelined}
    assert two == (2, 4, 1, 8)
    assert not any(o.pipelined for o in candidates(seventy, 64, stages=[1]))
    assert {o.micro_batches for o in candidates(seventy, 64, microbatches=6) if o.pipelined} \
        == {6}
    by_batch = {o.stages: o.micro_batches for o in candidates(seventy, 64, batch=64)
                if o.pipelined}
    assert by_batch == {4: 32, 8: 64}  # batch / data
    long = [o for o in candidates(MODELS["7b"].replace(seq=131072), 64) if o.pipelined]
    assert (4, 1, 2, 8) in {o.mesh_shape for o in long}
    assert all(o.context_parallel == "ring" for o in long if o.context > 1)
    with pytest.raises(ValueError, match=r"stages=3 does not divide the 80 layers of 70b.*"
                                         r"use one of \[2, 4, 8\]"):
        candidates(seventy, 64, stages=[3])
    with pytest.raises(ValueError, match=r"stages=16 does not divide the 8 GPU groups beyond "
                                         r"the tensor size 8 of 64 GPUs"):
        candidates(seventy, 64, stages=[16])
    with pytest.raises(ValueError, match="microbatches=0 must be a positive int"):
        candidates(seventy, 64, microbatches=0)
    with pytest.raises(ValueError, match="stages=0 must be a positive int"):
        PlanOption(8, 1, 8, fsdp=False, remat=True, stages=0)
    with pytest.raises(ValueError, match="pipeline_schedule='zb' is not one of"):
        PlanOption(8, 1, 8, fsdp=False, remat=True, pipeline_schedule="zb")
    with pytest.raises(ValueError, match="with options given, set them in each PlanOption"):
        plan(TINY, 8, options=[PlanOption(8, 1, 1, fsdp=True, remat=True)], stages=[2],
             progress=False)
    piped = PlanOption(2, 1, 2, fsdp=False, remat=True, micro_batches=4, stages=2)
    with pytest.raises(ValueError, match=r"batch=6 does not split into 4 micro-batches over "
                                         r"data 2 of 2x2x1x2 .*use a multiple of 8 sequences"):
        plan(TINY, 8, options=[piped], batch=6, progress=False)


@pytest.mark.slow
def test_command_line_stage_count_errors_are_one_line(capsys):
    """``--stages`` the model cannot take: one error line naming the value and the stage
    counts that would work, exit status 1, before any compile."""
    from sp_jax.plan import main

    assert main(["--model", "70b", "--gpus", "64", "--stages", "3", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: plan: stages=3 does not divide the 80 layers of 70b")
    assert "use one of [2, 4, 8]" in err and "Traceback" not in err


@pytest.mark.slow
def test_formula_of_a_pipelined_layout():
    """The analytic columns of a pipelined row: the layers' parameters over the stages
    too (the vocabulary table on every stage); 1F1B's activations: 2P - 1 stage inputs
    and one micro-batch through the stage's layers."""
    from sp_jax.analysis.plan import layout_formula

    model = MODELS["70b"]
    flat = PlanOption(1, 1, 8, fsdp=False, remat=True)
    piped = dataclasses.replace(flat, stages=8, micro_batches=32)
    p_flat, a_flat = layout_formula(model, flat, 1)
    p_piped, a_piped = layout_formula(model, piped, 32)
    table = 4 * -(-model.vocab // 8) * 8 * model.hidden / 8
    assert p_piped - table == pytest.approx((p_flat - table) / 8, rel=1e-3)
    sbh = model.seq * model.hidden / 8  # b = 32 / (1 x 32) = 1
    assert a_piped == pytest.approx((80 // 8) * 2 * sbh + 34 * sbh + (2 * 8 - 1) * 2 * sbh)
    assert a_flat == pytest.approx(80 * 2 * sbh + 34 * sbh)
    gpipe = dataclasses.replace(piped, pipeline_schedule="gpipe", remat=False)
    assert layout_formula(model, gpipe, 32)[1] == pytest.approx(32 * 10 * 34 * sbh)
    # GPT-3's vocabulary (50257) does not divide over tensor 8: the library splits that
    # table's features over tensor and not over data; the compiled bytes per device were
    # 5775366144 (16x1x8, fsdp) and 5748529152 (8 stages x data 2 x tensor 8, fsdp)
    gpt3 = MODELS["gpt3-175b"]
    assert layout_formula(gpt3, PlanOption(16, 1, 8, fsdp=True, remat=True), 16)[0] == 5775366144
    assert layout_formula(gpt3, PlanOption(2, 1, 8, fsdp=True, remat=True, micro_batches=32,
                                     stages=8), 64)[0] == 5748529152


HLO = """\
%body.1 (p: f32[8]) -> f32[8] {
  %all-gather-start = (f32[4], f32[8]) all-gather-start(f32[4] %p), dimensions={0}
  %all-gather-done = f32[8] all-gather-done((f32[4], f32[8]) %all-gather-start)
  ROOT %r = f32[8] reduce-scatter(f32[8] %all-gather-done), dimensions={0}
}

%branch.1 (q: f32[8]) -> f32[8] {
  %w = f32[8] while(%q), condition=%c, body=%body.1, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %cp = f32[8] collective-permute(f32[8] %w), source_target_pairs={{0,1},{1,0}}
}

%tick (t: f32[8]) -> f32[8] {
  ROOT %k = f32[8] conditional(%x, %t, %t), branch_computations={%branch.1, %branch.2}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %ar = f32[8] all-reduce(f32[8] %a), to_apply=%add
  %l = f32[8] while(%ar), condition=%c, body=%tick, backend_config={"known_trip_count":{"n":"3"}}
}
"""


@pytest.mark.slow
def test_collective_bytes_multiply_the_trip_counts_around_them():
    """Each collective counts as often as the loops around it iterate (a conditional's
    branch as if taken every time): the all-gather and reduce-scatter of a 5-trip loop in
    a branch of a 3-trip loop 15 times, the permute in the branch 3 times, the entry's
    all-reduce once; 32 bytes each."""
    from sp_jax.analysis import parse_collectives
    from sp_jax.analysis.plan import collective_bytes

    kinds = [(c.kind, c.bytes) for c in parse_collectives(HLO)]
    assert kinds == [("all-gather", 32), ("reduce-scatter", 32), ("collective-permute", 32),
                     ("all-reduce", 32)]
    assert collective_bytes(HLO) == 32 * (15 + 15 + 3 + 1)


@pytest.mark.slow
def test_table_of_pipelined_rows_and_of_rows_that_do_not_fit():
    """A pipelined row names its stages, schedule, M and bubble under a header with the
    stage axis; when nothing fits the table says by how much the best layout misses; XLA's
    rematerialization warning alone is explained as such."""
    piped = PlanOption(1, 1, 8, fsdp=False, remat=True, micro_batches=32, stages=8)
    remat_line = ("W1201 17:15:39.679774   10713 hlo_rematerialization.cc:3231] Can't reduce "
                  "memory use below 61.27GiB (65784435199 bytes) by rematerialization; only "
                  "reduced to 61.65GiB (66193671927 bytes), down from 61.70GiB (66248845175 "
                  "bytes) originally")
    rows = [PlanRow(o, 32, 1, 1, 1, 1, 2**30 * peak, False, 1, 1.0, 1.0, 1.0,
                    xla_notes=notes)
            for o, peak, notes in ((PlanOption(8, 1, 8, fsdp=True, remat=True), 90, ()),
                                   (piped, 80, (remat_line,)))]
    table = format_table(MODELS["70b"], rows)
    assert "XLA:GPU's rematerialization could not bring its estimate of the memory of " \
        "8x1x1x8 recompute_allgather+remat+1f1b (8 stages, M=32, bubble 18%) under the " \
        "limit its scheduler plans with (61.3 GiB)" in table
    assert "XLA:GPU warned" not in table  # (the arguments' line: its own sentence)
    assert "| layout ([stages x] data x context x tensor, options) |" in table
    assert "| 8x1x1x8 recompute_allgather+remat+1f1b (8 stages, M=32, bubble 18%) | 32 |" \
        in table
    assert "No layout fits in 80 GB: the best, 8x1x1x8 recompute_allgather+remat+1f1b " \
        "(8 stages, M=32, bubble 18%), needs 80.0 GiB, 5.5 GiB too many." in table
    assert "Pipelined rows: mesh stages x data x context x tensor" in table
    flat = format_table(MODELS["70b"], rows[:1])
    assert "| layout (data x context x tensor, options) |" in flat
    assert "Pipelined rows" not in flat


@pytest.mark.slow
@requires_cuda_plugin
def test_pipelined_layout_compiles_with_the_analytic_parameter_bytes():
    """One pipelined row compiled (data 2 x stages 2 x tensor 2, 1F1B of 4 micro-batches
    on 8 H100s): parameters = the formula (the layers over the stages), AdamW's moments
    twice that, the batch M x data sequences, collectives counted, fits."""
    option = PlanOption(2, 1, 2, fsdp=False, remat=True, micro_batches=4, stages=2)
    (row,) = plan(TINY, 8, options=[option], progress=False)
    assert not row.error, row.error
    assert row.batch == 8 and row.fits
    assert row.param_bytes == pytest.approx(row.formula_param_bytes, rel=0.01)
    assert row.opt_bytes == pytest.approx(2 * row.param_bytes, rel=0.01)
    assert row.activation_bytes > 0 and row.collective_bytes > 0
    assert "| 2x2x1x2 recompute_allgather+remat+1f1b (2 stages, M=4, bubble 20%) | 8 |" in \
        format_table(TINY, [row])


HEAD_DIM_SHAPES = {  # heads x head_dim apart from hidden: wider, narrower; experts
    "gpt_wider": ModelShape("wide", hidden=64, layers=2, heads=4, vocab=256, seq=64,
                            head_dim=32),
    "gpt_narrower": ModelShape("narrow", hidden=64, layers=2, heads=8, vocab=256, seq=64,
                               mlp_hidden=96, head_dim=4),
    "moe": ModelShape("moe", hidden=64, layers=2, heads=8, vocab=256, seq=64, kv_heads=2,
                      experts=4, moe_mlp_hidden=32, head_dim=16),
    # Qwen3-MoE's q/k norms, DeepSeek's shared expert, several experts per device
    "moe_qk_norm_shared": ModelShape("moe2", hidden=64, layers=2, heads=8, vocab=256, seq=64,
                                     kv_heads=2, experts=16, experts_per_token=4,
                                     moe_mlp_hidden=16, head_dim=16, qk_norm=True,
                                     shared_experts=1),
}


@pytest.mark.parametrize("name", slow_except(list(HEAD_DIM_SHAPES), "moe"))
def test_head_dim_sizes_the_planners_parameters_as_the_model(name):
    """``ModelShape(head_dim=...)``: the parameter count is the model's (its
    ``gpt_config``, the one the planner compiles), and the analytic per-device parameter
    bytes of data 2 x tensor 4 (experts: expert 4 x tensor 2) sharded over data are the
    model's on 8 CPU devices (1%, as the compiled plan's check); the activation formula
    grows with the q/k/v width, and a head_dim of hidden / heads changes nothing."""
    from flax import nnx

    from sp_jax import ParallelConfig
    from sp_jax.analysis.plan import _device_bytes, layout_formula
    from sp_jax.models import GPT

    shape = HEAD_DIM_SHAPES[name]
    cfg = shape.gpt_config()
    assert cfg.attention_config().head_dim == shape.head_dim
    # the planner's layouts: experts over an expert axis (data x expert x context x tensor)
    option = PlanOption(1, 1, 2, fsdp=True, remat=False, expert=4) if shape.moe else \
        PlanOption(2, 1, 4, fsdp=True, remat=False)
    parallel = ParallelConfig(fsdp=True, recompute_allgather=True,
                              expert_axis="expert" if shape.moe else None)
    with jax.set_mesh(jax.make_mesh(option.mesh_shape, option.axis_names)):
        model = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        params = nnx.state(model, nnx.Param)
    assert shape.params == sum(x.size for x in jax.tree.leaves(params))
    batch = 2 * option.batch_shards
    formula_params, acts = layout_formula(shape, option, batch)
    assert _device_bytes(params) == pytest.approx(formula_params, rel=0.01)
    derived = shape.replace(head_dim=None)
    same = shape.replace(head_dim=shape.hidden // shape.heads)
    assert layout_formula(same, option, batch) == layout_formula(derived, option, batch)
    assert same.params == derived.params
    wider = shape.attention > shape.hidden
    assert (acts > layout_formula(derived, option, batch)[1]) == wider
    assert (shape.params > derived.params) == wider


def test_command_line_head_dim(monkeypatch, capsys):
    """``--head-dim`` reaches the planned ModelShape (a preset's overridden, or a custom
    shape whose heads do not divide its hidden size) and the table's heading; without it
    such heads are one usage error naming the flags."""
    import importlib

    from sp_jax.plan import main

    planner = importlib.import_module("sp_jax.analysis.plan")  # (the package's plan: a function)

    seen = []
    monkeypatch.setattr(planner, "plan", lambda model, gpus, **kw: seen.append(model) or [])
    assert main(["--model", "7b", "--head-dim", "256", "--gpus", "8", "--no-progress"]) == 0
    assert seen[-1] == MODELS["7b"].replace(head_dim=256)
    assert main(["--hidden", "40", "--layers", "1", "--heads", "3", "--vocab", "64",
                 "--seq", "32", "--head-dim", "16", "--gpus", "1", "--no-progress"]) == 0
    assert (seen[-1].head_dim, seen[-1].attention) == (16, 48)
    assert "h=40, 1 layers, 3 heads of 16," in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--hidden", "40", "--layers", "1", "--heads", "3", "--vocab", "64", "--seq",
              "32", "--gpus", "1"])
    assert "--heads 3 must divide --hidden 40 (or give --head-dim)" in capsys.readouterr().err


# --- the memory options (issue 41): formulas, no compiles ---------------------------------

BYTES_PER_PARAM_BY_HAND = [
    # (weights + gradients, optimizer on the device, host) bytes per parameter, data 8,
    # by hand: fp32 master 4 + fp32 gradients 4, moments 8 (bf16: 4)
    (False, "fp32", "off", (8, 8, 0)),
    ("optimizer", "fp32", "off", (8, 1, 0)),          # ZeRO-1: moments / 8
    ("full", "fp32", "off", (1, 1, 0)),               # everything / 8
    (False, "bf16", "off", (8, 4, 0)),
    ("optimizer", "bf16", "off", (8, 0.5, 0)),
    ("full", "bf16", "off", (1, 0.5, 0)),
    (False, "fp32", "optimizer", (8, 0, 8)),          # moments on the host
    ("optimizer", "bf16", "optimizer", (8, 0, 0.5)),
    (False, "fp32", "optimizer+params", (6, 0, 12)),  # bf16 copy 2 + grads 4; host 4 + 8
    ("full", "fp32", "optimizer+params", (0.75, 0, 1.5)),
    ("full", "bf16", "optimizer+params", (0.75, 0, 1)),
]


def test_bytes_per_param_of_the_memory_options():
    from sp_jax.analysis.memory_options import MemoryOptions, bytes_per_param

    for fsdp, moments, offload, expected in BYTES_PER_PARAM_BY_HAND:
        for acts in (False, True):  # activation offload does not move parameter bytes
            got = bytes_per_param(MemoryOptions(fsdp, moments, offload, acts), 8)
            assert got == pytest.approx(expected), (fsdp, moments, offload)


def test_bytes_per_param_every_combination_conserves_the_state():
    from sp_jax.analysis.memory_options import (
        FSDP_MODES,
        MOMENTS,
        OFFLOADS,
        MemoryOptions,
        bytes_per_param,
    )

    for f in FSDP_MODES:
        for m in MOMENTS:
            for o in OFFLOADS:
                weights, opt, host = bytes_per_param(MemoryOptions(f, m, o), 4)
                full, state = (4 if f == "full" else 1), (4 if f else 1)
                copy = 2 / full if o == "optimizer+params" else 0  # the bf16 copy
                assert weights + opt + host == pytest.approx(
                    8 / full + (8 if m == "fp32" else 4) / state + copy)
                assert (host > 0) == (o != "off") and (opt == 0) == (o != "off")
    with pytest.raises(ValueError, match="fsdp='zero'"):
        MemoryOptions(fsdp="zero")
    with pytest.raises(ValueError, match="moments='fp8'"):
        MemoryOptions(moments="fp8")


def test_search_rows_add_up_and_activation_offload_moves_all_but_one_layer():
    from sp_jax.analysis.memory_options import MemoryOptions, search
    from sp_jax.analysis.plan import layout_formula

    model = MODELS["7b"]
    opts = [MemoryOptions(), MemoryOptions("full", "bf16", "optimizer", True)]
    rows = search(model, 8, options=opts)
    plain, packed = [r for r in rows if r.layout == PlanOption(8, 1, 1, False, True)]
    n_rep = layout_formula(model, plain.layout, plain.batch)[0] / 4
    n_full = layout_formula(model, dataclasses.replace(plain.layout, fsdp=True),
                            plain.batch)[0] / 4
    assert n_rep == pytest.approx(model.params, rel=1e-6)
    assert plain.weights_bytes == pytest.approx(8 * n_rep)
    assert plain.optimizer_bytes == pytest.approx(8 * n_rep) and plain.host_bytes == 0
    assert packed.weights_bytes == pytest.approx(8 * n_full)
    assert packed.optimizer_bytes == 0
    one_layer = layout_formula(model.replace(layers=1), plain.layout, plain.batch)[1]
    assert packed.activation_bytes == pytest.approx(one_layer)
    assert packed.host_bytes == pytest.approx(4 * n_full + plain.activation_bytes - one_layer)
    assert not plain.fits and packed.fits


def test_parse_bytes_and_the_presets_of_the_three_questions():
    from sp_jax.analysis.memory_options import parse_bytes

    assert parse_bytes("2TB") == 2e12 and parse_bytes("2048GiB") == 2048 * 2**30
    assert parse_bytes("2048") == 2048 * 2**30 and parse_bytes("1.5 tib") == 1.5 * 2**40
    with pytest.raises(ValueError, match="'lots' is not a size"):
        parse_bytes("lots")
    # Llama-3-70B: 70.55B, Llama-3.1-405B: 405.85B (Meta's model cards: 70B, 405B)
    assert 70.4e9 < MODELS["llama-3-70b"].params < 70.7e9
    assert 405.7e9 < MODELS["405b"].params < 406e9


def test_the_three_questions_by_formula():
    from sp_jax.analysis.memory_options import MemoryOptions, best, search

    for name, gpus in (("mixtral-8x7b", 8), ("llama-3-70b", 16), ("405b", 128),
                       ("qwen3-30b-a3b", 8)):
        rows = search(MODELS[name], gpus, reserve=15 * 2**30)
        top = best(rows)
        assert top is not None and top.fits, name
        assert top.host_bytes * min(gpus, 8) <= 2e12
        if name in ("mixtral-8x7b", "qwen3-30b-a3b"):  # the options are needed (issue 41)
            assert not any(r.fits for r in rows if r.options == MemoryOptions())
            assert top.options.offload != "off" or top.options.moments == "bf16"
    # Qwen3-30B-A3B (issue 43): by formula, experts over 4 x tensor 2 with bf16 moments and
    # no offload (the formula counts the routed rows, not XLA's masked ragged_dot)
    assert (top.layout.expert, top.layout.tensor, top.options.moments, top.options.offload) \
        == (4, 2, "bf16", "off")


def test_command_line_memory_options_prints_host_bytes(capsys):
    from sp_jax.plan import main

    assert main(["--model", "mixtral-8x7b", "--gpus", "8", "--memory-options",
                 "--host-memory-per-node", "2TB", "--device-reserve", "15GiB"]) == 0
    out = capsys.readouterr().out
    assert "| layout | options | weights + grads | optimizer | activations | device peak | " \
           "host | fits |" in out
    assert "host: 233 GiB per GPU" in out and "\nFits: " in out
    assert "offload opt" in out.split("\nFits: ")[1]
    # 1 GB of host memory per node: no offload fits, and none of the rest either
    assert main(["--model", "mixtral-8x7b", "--gpus", "8", "--memory-options",
                 "--host-memory-per-node", "1GB", "--device-reserve", "15GiB"]) == 0
    assert "\nNothing fits: " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "7b", "--gpus", "8", "--memory-options",
              "--host-memory-per-node", "plenty"])
    assert "'plenty' is not a size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--memory-options", "--host-memory-per-node SIZE", "--gpus-per-node",
                 "--device-reserve SIZE", "optimizer = ZeRO-1", "activation offload"):
        assert flag in out


# --- issue 50: the planner tells the truth by default ---------------------------------


def _example(name: str):
    """``examples/<name>.py`` as a module (its ``parse`` only: nothing runs)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_plan_flags", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name,gpus", [("mixtral-8x7b", 8), ("llama-3-70b", 16), ("405b", 128),
                                       ("70b", 64), ("qwen3-30b-a3b", 8), ("7b", 8),
                                       ("7b head_dim=256", 8),
                                       pytest.param("deepseek-v3", 224, marks=pytest.mark.slow),
                                       pytest.param("kimi-k2", 448, marks=pytest.mark.slow)])
def test_the_printed_command_parses_with_each_example_as_the_plan(name, gpus, tmp_path):
    """An answer is runnable as printed: the command lines of the formula's answer parse
    with examples/train_gpt.py's and finetune_hf.py's own argparse, into the mesh,
    batch, remat, sharding, moments and offloads of the plan (and train_gpt's preset
    into the plan's model sizes)."""
    import dataclasses
    import shlex

    from sp_jax.analysis.confirm import command_line
    from sp_jax.analysis.memory_options import MemoryOptions, best, search
    from sp_jax.training import cli

    name, _, head_dim = name.partition(" head_dim=")  # --head-dim given to the planner
    model = MODELS[name]
    if head_dim:
        model = dataclasses.replace(model, head_dim=int(head_dim))
    options = [MemoryOptions(f, m, o, a) for f in (False, "optimizer", "full")
               for m in ("fp32", "bf16") for o in ("off", "optimizer", "optimizer+params")
               for a in (False, True)]
    rows = search(model, gpus, options=options)
    picks = [best(rows)] + [r for r in rows if r.options == MemoryOptions(
        "full", "bf16", "optimizer+params", True)][:1]  # every offload flag, too
    (tmp_path / "config.json").write_text("{}")
    for row in picks:
        lay, opts = row.layout, row.options
        for script in ("train_gpt", "finetune_hf"):
            line = command_line(model, row, script)
            argv = shlex.split(line)
            assert argv[:2] == ["python", f"examples/{script}.py"]
            argv = [str(tmp_path) if a == "DIR" else a for a in argv[2:]]
            args = _example(script).parse(argv)
            assert args.mesh_shape == (lay.stages, lay.data, lay.expert, lay.context,
                                       lay.tensor), line
            assert args.batch_size == row.batch and args.precision == "bf16"
            assert args.micro_batches == lay.micro_batches and args.recompute_allgather
            assert cli.scan_layers(args)  # the planner compiles scanned layers
            assert args.remat == lay.remat and args.fsdp == opts.fsdp
            assert args.moments_dtype == opts.moments
            assert args.offload_optimizer == (opts.offload != "off")
            assert args.offload_params == (opts.offload == "optimizer+params")
            assert args.offload_activations == opts.offload_activations
            assert cli.parallel_config(args).offload_activations == opts.offload_activations
            if script == "train_gpt":
                cfg = cli.model_config(args)
                assert (cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.max_seq_len) == (
                    model.layers, model.hidden, model.heads, model.seq), line
                if model.kv_lora_rank:  # the preset is the architecture (MLA), not a stand-in
                    assert cfg.attention == "mla" and (
                        cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                        cfg.qk_rope_head_dim, cfg.v_head_dim) == (
                        model.q_lora_rank, model.kv_lora_rank, model.qk_nope_head_dim,
                        model.qk_rope_head_dim, model.v_head_dim), line
                    assert cfg.num_dense_layers == model.dense_layers, line
                else:
                    assert cfg.num_kv_heads == (model.kv_heads or model.heads)
                    assert (cfg.head_dim or cfg.hidden // cfg.num_heads) == model.head_size, \
                        line
                assert cfg.remat == lay.remat
                experts = model.experts if model.experts > 1 else 0
                assert cfg.num_experts == experts


def test_update_bytes_by_hand_and_the_reserve():
    """The formula's update term, by hand from Mixtral-8x7B's shape: the second buffer of
    experts_up's gradient accumulator ([L, E / ep, h, 2F / t]; a mixture's: 2 bytes per
    parameter, dense blocks' 4) in every sharded mode, with fp32 moments on the device
    also the leaf's new fp32 moment; every fp32 moment with fp32 moments offloaded; a
    second fp32 gradient copy of the reduced leaves replicated. A row fits
    with its device peak plus the reserve within 80 GB."""
    from sp_jax.analysis.memory_options import (
        DEFAULT_RESERVE,
        MemoryOptions,
        search,
        update_bytes,
    )
    from sp_jax.analysis.plan import H100_BYTES, layout_formula

    model = MODELS["mixtral-8x7b"]
    layout = PlanOption(1, 1, 2, fsdp=False, remat=True, expert=4)
    up = model.layers * (8 // 4) * model.hidden * 2 * 14336 // 2  # experts_up per GPU
    assert update_bytes(model, layout, MemoryOptions("optimizer", "bf16", "optimizer")) \
        == pytest.approx(2 * up)  # a mixture's accumulator: half its second buffer
    assert update_bytes(model, layout, MemoryOptions("full", "fp32")) == pytest.approx(6 * up)
    assert update_bytes(model, layout, MemoryOptions("optimizer", "bf16")) \
        == pytest.approx(2 * up)
    sharded = layout_formula(model, dataclasses.replace(layout, fsdp=True), 4)[0] / 4
    assert update_bytes(model, layout, MemoryOptions("full", "fp32", "optimizer")) \
        == pytest.approx(8 * sharded + 2 * up)
    # dense blocks on data 2 x tensor 8, fsdp: the MLP-up's gradient and state over data
    llama, dense = MODELS["llama-3-70b"], PlanOption(2, 1, 8, fsdp=False, remat=True)
    mlp_up = llama.layers * llama.hidden * 2 * llama.mlp / 8 / 2
    assert update_bytes(llama, dense, MemoryOptions("full", "bf16")) == pytest.approx(
        4 * mlp_up)
    assert update_bytes(llama, dense, MemoryOptions("full", "fp32")) == pytest.approx(
        8 * mlp_up)
    experts = 4 * model.layers * 8 * 3 * model.hidden * 14336 / (4 * 2)  # not reduced
    assert update_bytes(model, layout, MemoryOptions()) == pytest.approx(
        layout_formula(model, layout, 4)[0] - experts)
    rows = search(model, 8)
    assert {r.reserve for r in rows} == {DEFAULT_RESERVE} and DEFAULT_RESERVE == 4 * 2**30
    for r in rows:
        assert r.device_bytes == pytest.approx(r.weights_bytes + r.optimizer_bytes
                                               + r.activation_bytes + r.update_bytes)
        assert r.fits == (r.device_bytes + DEFAULT_RESERVE <= H100_BYTES
                          and r.host_bytes <= r.host_limit)
    # a peak between 80 GB - reserve and 80 GB: fits without a reserve, not with it
    tight = max((r for r in search(model, 8, reserve=0) if r.fits),
                key=lambda r: r.device_bytes)
    reserve = H100_BYTES - tight.device_bytes + 2**20
    assert not any(r.fits for r in search(model, 8, reserve=reserve) if
                   r.layout == tight.layout and r.options == tight.options)


def test_command_line_states_the_reserve_and_the_new_flags(capsys):
    from sp_jax.plan import main

    assert main(["--model", "mixtral-8x7b", "--gpus", "8", "--no-confirm"]) == 0
    out = capsys.readouterr().out
    assert "of it 4.0 GiB reserved (CUDA context, NCCL, fragmentation: --device-reserve): " \
           "fits = device peak <= 70.5 GiB" in out
    assert "\nFits: " in out and "+ 4.0 GiB reserve" in out.split("\nFits: ")[1]
    assert main(["--model", "mixtral-8x7b", "--gpus", "8", "--memory-options",
                 "--device-reserve", "6"]) == 0
    assert "fits = device peak <= 68.5 GiB" in capsys.readouterr().out
    for bad in (["--confirm-tries", "0"], ["--microbatches", "4"]):
        with pytest.raises(SystemExit):
            main(["--model", "7b", "--gpus", "8", *bad])
        assert "--" + bad[0].lstrip("-") in capsys.readouterr().err
    assert main(["--model", "7b", "--gpus", "8", "--stages", "3", "--no-confirm"]) == 1
    assert capsys.readouterr().err.startswith("error: plan: stages=3 does not divide")
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--no-memory-options", "--no-confirm", "--confirm-tries N",
                 "--memory-options", "--device-reserve SIZE", "(default 4GiB;"):
        assert flag in out
    for name in ("train_gpt", "finetune_hf"):
        with pytest.raises(SystemExit):
            _example(name).parse(["--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "--remat" in out and "--offload-activations" in out
    with pytest.raises(SystemExit):
        _example("train_gpt").parse(["--help"])
    assert "mixtral-8x7b: 32 layers" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
@requires_cuda_plugin
def test_formula_matches_the_compile_at_a_small_shape():
    """The formula against deviceless compiles of the whole step (h=1024, 16 layers, 8
    GPUs: data 4 x tensor 2, remat) with fsdp and fp32 or bf16 moments and with ZeRO-1 +
    bf16 moments + the optimizer offloaded: the host bytes are the offloaded moments
    (within 2%); what bf16 moments save is the formula's saving (within 10%: the moments
    and the update term); each device peak within 20% (measured 2026-12-07: 485, 364 and
    932 MiB compiled against 427, 315 and 1084 by formula: at this size XLA's other
    temporaries, a layer's gathered weights and the logits, weigh more than at scale, and
    ZeRO-1's gathered-parameters term is an upper bound)."""
    from sp_jax.analysis.memory_options import MemoryOptions, search
    from sp_jax.analysis.plan import H100_BYTES, plan_one

    model = ModelShape("small", hidden=1024, layers=16, heads=8, vocab=512, seq=256)
    opts = [MemoryOptions("full", "fp32"), MemoryOptions("full", "bf16"),
            MemoryOptions("optimizer", "bf16", "optimizer")]
    rows = {r.options: r for r in search(model, 8, options=opts)
            if (r.layout.data, r.layout.tensor, r.layout.stages, r.layout.remat)
            == (4, 2, 1, True)}
    assert list(rows) == opts
    got = {o: plan_one(model, r.layout, batch=r.batch, memory=o) for o, r in rows.items()}
    for o, row in rows.items():
        assert not got[o].error, got[o].error
        assert got[o].host_bytes == pytest.approx(row.host_bytes, rel=0.02), o
        assert got[o].peak_bytes == pytest.approx(row.device_bytes, rel=0.20), o
        assert got[o].peak_bytes + row.reserve <= H100_BYTES
    fp32, bf16 = opts[:2]
    assert got[fp32].peak_bytes - got[bf16].peak_bytes == pytest.approx(
        rows[fp32].device_bytes - rows[bf16].device_bytes, rel=0.10)


@pytest.mark.slow
@requires_cuda_plugin
def test_default_answer_is_confirmed_by_compile_and_printed_runnable(capsys):
    from sp_jax.plan import main

    assert main(["--hidden", "128", "--layers", "1", "--heads", "4", "--vocab", "256",
                 "--seq", "128", "--gpus", "2", "--no-progress", "--confirm-tries", "1"]) == 0
    out = capsys.readouterr().out
    assert "\nFits, confirmed by compile (the whole training step" in out
    assert "| yes, compiled |" in out and "GiB reserve = " in out
    line = out.split("Run it")[1].splitlines()[1].strip()
    assert line.startswith("python examples/train_gpt.py --preset gpt --layers 1 --hidden 128")
    import shlex
    args = _example("train_gpt").parse(shlex.split(line)[2:])
    assert args.mesh_shape[1] * args.mesh_shape[4] * args.mesh_shape[2] == 2


# Llama blocks whose MLP-up dominates (h=2048, 16 layers, MLP 8192, s=256): the update
# term is a fifth of the peak, and XLA is under no memory pressure (it keeps what its
# live ranges show: the gradient accumulator's second buffer, the new fp32 moments)
UPDATE_SHAPE = ModelShape("update", 2048, 16, 8, 4096, 256, 8192, kv_heads=2, experts=1,
                          experts_per_token=1)


@pytest.mark.slow
@requires_cuda_plugin
@pytest.mark.parametrize("fsdp,moments,offload", [
    ("full", "fp32", "off"), ("full", "bf16", "optimizer"), ("optimizer", "fp32", "off")])
def test_update_term_bounds_the_compiled_peak(fsdp, moments, offload):
    """The formula's device peak (state, gradients, activations and update_bytes) against
    a deviceless compile of the whole step on data 4 x tensor 2 with remat: never under it
    by more than 2%, never over by more than 6% (measured 2026-12-08, compiled / formula
    MiB: fsdp fp32 2371 / 2432, fsdp bf16 offloaded 1228 / 1231, ZeRO-1 fp32 6257 / 6168;
    the update term of 2026-12-07, one moment of the largest leaf, was 8% under with fsdp
    fp32)."""
    from sp_jax.analysis.memory_options import MemoryOptions, search
    from sp_jax.analysis.plan import plan_one

    opts = MemoryOptions(fsdp, moments, offload)
    row = next(r for r in search(UPDATE_SHAPE, 8, options=[opts])
               if (r.layout.data, r.layout.tensor, r.layout.remat) == (4, 2, True))
    got = plan_one(UPDATE_SHAPE, row.layout, batch=row.batch, memory=opts)
    assert not got.error, got.error
    assert row.update_bytes > 0.1 * got.peak_bytes  # the term matters at this shape
    assert -0.02 <= (row.device_bytes - got.peak_bytes) / got.peak_bytes <= 0.06, (
        got.peak_bytes / 2**20, row.device_bytes / 2**20)


MLA_SHAPES = {  # DeepSeek-V3's layers at test size: MLA, sigmoid routing, a dense first layer
    "q_lora": ModelShape("mla", hidden=64, layers=3, heads=4, vocab=256, seq=64,
                         mlp_hidden=96, experts=8, experts_per_token=2, moe_mlp_hidden=16,
                         shared_experts=1, sigmoid_router=True, dense_layers=1,
                         q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=12),
}
MLA_SHAPES["direct_q"] = MLA_SHAPES["q_lora"].replace(q_lora_rank=None, dense_layers=0)


@pytest.mark.parametrize("name", slow_except(list(MLA_SHAPES), "q_lora"))
def test_mla_shape_counts_the_models_parameters(name):
    """A ``ModelShape`` with multi-head latent attention and dense first layers: its
    parameter count is its ``gpt_config``'s model's (router biases included), and the
    analytic per-device parameter bytes of expert 4 x tensor 2 sharded over the batch
    axes are the model's on 8 CPU devices (1%); the presets: DeepSeek-V3 671.0B, Kimi K2
    1.03T."""
    from flax import nnx

    from sp_jax import ParallelConfig
    from sp_jax.analysis.plan import _device_bytes, layout_formula
    from sp_jax.models import GPT

    assert 670.5e9 < MODELS["deepseek-v3"].params < 671.5e9
    assert 1.02e12 < MODELS["kimi-k2"].params < 1.04e12
    shape = MLA_SHAPES[name]
    cfg = shape.gpt_config()
    assert cfg.attention == "mla" and cfg.num_dense_layers == shape.dense_layers
    option = PlanOption(1, 1, 2, fsdp=True, remat=False, expert=4)
    parallel = ParallelConfig(fsdp=True, recompute_allgather=True, expert_axis="expert")
    with jax.set_mesh(jax.make_mesh(option.mesh_shape, option.axis_names)):
        model = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        params = nnx.state(model, nnx.Param)
    assert shape.params == sum(x.size for x in jax.tree.leaves(params))
    formula_params, _ = layout_formula(shape, option, 2 * option.batch_shards)
    assert _device_bytes(params) == pytest.approx(formula_params, rel=0.01)


def test_moe_layouts_try_each_expert_axis_and_count_what_fsdp_adds():
    """The formula search tries every expert-axis size dividing the experts and the GPUs
    beyond tensor (a smaller axis: more experts a GPU, a smaller dropless receive buffer
    ``ep T min(k, E / ep)``), and with fsdp over data counts what the compiles hold
    beyond the formula's state for the experts (by hand: the fp32 copy of the stacked
    expert kernels XLA lays out hidden-major, ``4 x 3 h F E / (ep t data)`` a layer, and
    one layer's experts gathered in bf16, ``2 x 3 h F E / (ep t)``), also with activation
    offload. The fewest H100s: DeepSeek-V3 224 on expert 4 x data 28 x tensor 2, Kimi K2
    448 on expert 8 x data 28 x tensor 2 (BENCHMARKS.md, checked by slice compiles)."""
    from sp_jax.analysis.memory_options import MemoryOptions, best, layouts, search
    from sp_jax.analysis.plan import expert_fsdp_bytes

    model = MODELS["deepseek-v3"]
    axes = sorted({(o.expert, o.data) for o in layouts(model, 224) if o.tensor == 2})
    assert axes == [(1, 112), (2, 56), (4, 28), (8, 14), (16, 7)]
    option = PlanOption(14, 1, 2, fsdp=True, remat=True, expert=8)
    layer = 3 * 7168 * 2048 * 256 / (8 * 2)
    assert expert_fsdp_bytes(model, option) == pytest.approx(4 * layer / 14 * 58 + 2 * layer)
    assert expert_fsdp_bytes(model.replace(layers=2, dense_layers=1), option) == \
        pytest.approx(4 * layer / 14 + 2 * layer)
    assert expert_fsdp_bytes(model, PlanOption(1, 1, 2, fsdp=True, remat=True,
                                                expert=112)) == 0.0  # data 1
    opts = [MemoryOptions("full", "bf16", "optimizer", a) for a in (False, True)]
    kept, offloaded = (next(r for r in search(model, 224, options=[o])
                            if r.layout.expert == 8 and r.layout.tensor == 2 and r.layout.remat)
                       for o in opts)
    # offload moves the layers' bf16 inputs to the host (60 of 61: s h / t each), never
    # what fsdp adds
    moved = 60 * 2 * 4096 * 7168 / 2
    assert kept.activation_bytes - offloaded.activation_bytes == pytest.approx(moved)
    assert offloaded.host_bytes - kept.host_bytes == pytest.approx(moved)
    for name, want in (("deepseek-v3", (224, 4, 28, 2)), ("kimi-k2", (448, 8, 28, 2))):
        gpus, row = next((g, r) for g in range(8, 4097, 8)  # benchmarks/plan_fewest.py's
                         if (r := best(search(MODELS[name], g))) is not None)
        assert (gpus, row.layout.expert, row.layout.data, row.layout.tensor) == want, name


@pytest.mark.slow  # (the fast tier is full: make test-fast's budget)
def test_lora_rows_count_the_frozen_base_and_the_adapters_by_hand():
    """``--lora-rank`` / ``--base-dtype``: per GPU the frozen base at its format's bytes a
    kernel parameter (fp32 embedding and head), the adapters (as sp_jax holds them: one
    lora_a per fused kernel, lora_b rows over its columns) with fp32 gradients and
    moments; Llama-3-70B QLoRA fits one H100, bf16-base LoRA four (tensor 4), a plain
    LoRA (fp32 base) neither."""
    from sp_jax.analysis.memory_options import BASE_BYTES, MemoryOptions, best, lora_counts, search
    from sp_jax.analysis.plan import PlanOption
    from sp_jax.plan import main

    model = MODELS["llama-3-70b"].replace(seq=4096, lora_rank=16, base_dtype="nf4")
    h, a, f, r, kv = 8192, 8192, 28672, 16, 2 * 8 * 128
    layout = PlanOption(1, 1, 4, fsdp=False, remat=True)
    kernels, others, adapters, largest = lora_counts(model, layout)
    assert kernels == 80 * (h * a + h * kv + a * h + 3 * h * f) / 4
    assert others == 2 * 128256 * h / 4
    per_layer = (h * 3 * r + 3 * r * (a + kv) / 4 + a / 4 * r + r * h  # qkv, o
                 + h * 2 * r + 2 * r * 2 * f / 4 + f / 4 * r + r * h)  # gate/up, down
    assert adapters == 80 * per_layer and largest == 2 * h * f / 4
    row = next(r for r in search(model, 4, options=[MemoryOptions()])
               if r.layout.tensor == 4 and r.layout.remat)
    assert row.weights_bytes == BASE_BYTES["nf4"] * kernels + 4 * others + 8 * adapters
    assert row.optimizer_bytes == 8 * adapters and row.update_bytes == 2 * largest
    assert BASE_BYTES["nf4"] == 0.5 + 1 / 64 + 8 / 64 / 256
    assert best(search(model, 1)) is not None
    assert best(search(model.replace(base_dtype="bf16"), 4)) is not None
    assert best(search(model.replace(base_dtype="bf16"), 1)) is None
    assert best(search(model.replace(base_dtype=None), 4)).layout.tensor == 4 or \
        best(search(model.replace(base_dtype=None), 4)).options.fsdp == "full"
    with pytest.raises(SystemExit):
        main(["--model", "llama-3-70b", "--gpus", "1", "--base-dtype", "nf4"])
    with pytest.raises(ValueError, match="refuses LoRA with experts"):
        lora_counts(MODELS["mixtral-8x7b"].replace(lora_rank=8), layout)
