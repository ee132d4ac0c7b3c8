"""The memory planner (``sp_jax.analysis.plan``, ``python -m sp_jax.plan``): its parameter
and optimizer bytes equal the analytic values, its activation figure is the compiled
step's, sharding over data shrinks what it should, and the command line prints the table."""

import dataclasses
import math

import jax
import pytest
from _util import without_jax_plugins
from conftest import requires_cuda_plugin

from sp_jax.analysis.plan import (
    MODELS,
    ModelShape,
    PlanOption,
    PlanRow,
    candidates,
    format_table,
    plan,
)

TINY = ModelShape("tiny", hidden=256, layers=2, heads=8, vocab=512, seq=256)


def test_parameter_count_of_the_presets():
    # GPT blocks with a 4h MLP: 12 h^2 per layer dominates
    assert 6.4e9 < MODELS["7b"].params < 6.7e9
    assert 64e9 < MODELS["70b"].params < 66e9
    assert 1.2e9 < MODELS["1.3b"].params < 1.4e9
    assert 0.12e9 < MODELS["gpt2-small"].params < 0.17e9


def test_candidates():
    seventy = candidates(MODELS["70b"], 64)
    assert {(o.data, o.context, o.tensor) for o in seventy} == {(8, 1, 8)}
    assert {(o.fsdp, o.remat) for o in seventy} == {(False, True), (True, False), (True, True)}
    long = candidates(MODELS["7b"].replace(seq=131072), 64)
    assert all(o.context > 1 and o.tensor == 8 for o in long)
    small = candidates(MODELS["7b"], 8)
    assert (8, 1, 1) in {(o.data, o.context, o.tensor) for o in small}
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        plan("gpt5", 8)
    with pytest.raises(ValueError, match="do not use 8 GPUs"):
        plan(TINY, 8, options=[PlanOption(2, 1, 2, fsdp=True, remat=False)], progress=False)


@pytest.fixture(scope="module")
def small():
    """``benchmarks.plan.small_check(TINY)``: the plan of data 2 x tensor 4 sharded over
    data, and the same step compiled for the 8 simulated CPU devices."""
    from benchmarks.plan import small_check

    return small_check(TINY)


def _row(d: dict) -> PlanRow:
    fields = {f.name for f in dataclasses.fields(PlanRow)}
    return PlanRow(**{k: v for k, v in d.items() if k in fields} | {
        "option": PlanOption(**d["option"])})


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


@requires_cuda_plugin
def test_activation_figure_is_the_compiled_temp_on_cpu_too(small):
    """The plan's activation figure (deviceless H100 compile) against the same training
    step compiled for the 8 simulated CPU devices (``benchmarks.plan.small_check``, which
    ``make bench`` reports): within 10%."""
    check = small
    acts = check["row"]["activation_bytes"]
    assert math.isclose(acts, check["cpu_activation_bytes"], rel_tol=0.10), check


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
