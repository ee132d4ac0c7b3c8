"""Activations on the host (``ParallelConfig(offload_activations=True)``): what each layer
keeps for its backward pass (the linear rules' GEMM operands, attention's q, k, v, output
and log-sum-exp, the norms' inputs, a rematerialised block's input) waits in
``pinned_host`` memory between the passes. Training is bitwise the same as without it
(data x tensor, scanned layers, remat, a context axis, pipeline stages); a deviceless
H100 compile places the residuals in host memory (``S(5)``), inside the layer scan too;
a backend without host memory kinds is a ValueError naming it.

(XLA:CPU lowers the moves to no-ops, so on CPU the bitwise tests check that the rules
carry their residuals through the moves unchanged; the GPU compile checks the
placement.)"""

import re

import jax
import numpy as np
import pytest
from _util import assert_bitwise, slow_except, train_gpt
from conftest import make_mesh, requires_cuda_plugin
from flax import nnx

import sp_jax
import sp_jax.mesh
from sp_jax.analysis.checks import (
    STACK_FORMS,
    gpt_memory_report,
    offloaded_bytes_per_layer,
    per_layer_memory,
)
from sp_jax.layout import Layout
from sp_jax.models import GPT, GPTConfig

B, S, STEPS = 8, 16, 3
BASE = dict(vocab_size=64, max_seq_len=S, num_layers=2, num_heads=4, hidden=32)
AXES4 = ("stage", "data", "context", "tensor")


def _batches(micro=1, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, BASE["vocab_size"], size=(STEPS, B, S + 1)).astype(np.int32)
    return [{"tokens": t[:, :-1].reshape(micro, B // micro, S),
             "labels": t[:, 1:].reshape(micro, B // micro, S)} for t in tokens]


def _mesh(shape, axes):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, axes, devices=jax.devices()[:n])


CASES = {  # id: (mesh shape, axes, model options, parallel options, micro-batches)
    "2x4_recompute": ((2, 4), ("data", "tensor"), {}, {"recompute_allgather": True}, 1),
    "2x4_scan": ((2, 4), ("data", "tensor"), {"scan_layers": True, "positions": "rotary"},
                 {}, 1),
    "2x4_scan_remat_recompute": ((2, 4), ("data", "tensor"),
                                 {"scan_layers": True, "remat": True},
                                 {"recompute_allgather": True}, 2),
    "2x4_remat_unrolled_dropout": ((2, 4), ("data", "tensor"),
                                   {"remat": True, "dropout": 0.1}, {}, 1),
    "2x2x2_ring": ((2, 2, 2), ("data", "context", "tensor"), {"positions": "rotary"},
                   {"context_parallel": "ring"}, 1),
    "2x2x1x2_gpipe_scan": ((2, 2, 1, 2), AXES4, {"scan_layers": True, "num_layers": 4},
                           {"pipeline_axis": "stage", "pipeline_microbatches": 4}, 4),
    "2x2x1x2_1f1b_remat": ((2, 2, 1, 2), AXES4,
                           {"scan_layers": True, "num_layers": 4, "remat": True},
                           {"pipeline_axis": "stage", "pipeline_microbatches": 4,
                            "pipeline_schedule": "1f1b"}, 4),
}


@pytest.mark.parametrize("case", slow_except(CASES, "2x4_recompute"))
def test_offload_trains_bitwise_like_no_offload(case):
    shape, axes, model_kw, parallel_kw, micro = CASES[case]
    cfg = GPTConfig(**{**BASE, **model_kw})
    batches = _batches(micro)
    train = cfg.dropout > 0
    runs = [train_gpt(cfg, sp_jax.ParallelConfig(**parallel_kw, offload_activations=off),
                      _mesh(shape, axes), batches, train_mode=train) for off in (False, True)]
    (init0, losses0, params0, _), (init1, losses1, params1, _) = runs
    assert_bitwise(init0, init1)
    np.testing.assert_array_equal(losses1, losses0)
    assert_bitwise(params1, params0)
    assert losses0[-1] < losses0[0]


def test_config_and_backend_errors(monkeypatch):
    with pytest.raises(TypeError, match="offload_activations='yes' must be True or False"):
        sp_jax.ParallelConfig(offload_activations="yes")
    assert sp_jax.ParallelConfig(offload_activations=np.bool_(True)).offload_activations is True
    assert sp_jax.ParallelConfig.from_dict({"offload_activations": True}).offload_activations
    assert sp_jax.mesh.host_memory_supported("cpu")  # the tests run there
    monkeypatch.setattr(sp_jax.mesh, "host_memory_supported", lambda platform: False)
    parallel = sp_jax.ParallelConfig(offload_activations=True)
    with jax.set_mesh(make_mesh(2, 4)):
        with pytest.raises(ValueError, match=r"offload_activations=True\): the 'cpu' backend "
                                             "has no 'pinned_host' memory kind"):
            GPT(GPTConfig(**BASE), parallel=parallel, rngs=nnx.Rngs(0))
        # without the option nothing asks
        GPT(GPTConfig(**BASE), parallel=sp_jax.ParallelConfig(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("remat", [False, True])
def test_unrolled_layer_loop_computes_the_scan(remat):
    """The form a pipeline stage runs its layers in with the option on XLA:GPU (GPipe:
    ``layer_loop(..., unroll=True)``, each layer traced in turn) gives the scan's output
    and gradients (on CPU, where the stages themselves keep the scan)."""
    from sp_jax.models import Block
    from sp_jax.models.blocks import scan_blocks, stack_blocks

    cfg = GPTConfig(**{**BASE, "scan_layers": True, "remat": remat})
    parallel = sp_jax.ParallelConfig(offload_activations=True)
    with jax.set_mesh(make_mesh(2, 4)):
        stacked = stack_blocks([Block(cfg, parallel, rngs=nnx.Rngs(i)) for i in range(3)])
        graphdef, state = nnx.split(stacked)
        x = jax.random.normal(jax.random.key(1), (B, S, BASE["hidden"]))
        x = jax.sharding.reshard(x, Layout.of(parallel).sp)

        def loss(state, x, unroll):
            y, _ = scan_blocks(nnx.merge(graphdef, state), x, None, remat, unroll=unroll)
            return jax.numpy.mean(jax.numpy.square(y)), y

        got = [jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True),
                       static_argnums=2)(state, x, unroll) for unroll in (False, True)]
    (l0, y0), g0 = got[0]
    (l1, y1), g1 = got[1]
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g0)
    assert float(jax.numpy.max(jax.numpy.abs(y1 - x))) > 0  # the layers did something


def _while_bodies(hlo: str) -> dict[str, str]:
    """The text of every computation a ``while`` runs as its body, by name."""
    names = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo))
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s", block)
        if m and m.group(1) in names:
            comps[m.group(1)] = block
    return comps


@requires_cuda_plugin
@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
def test_h100_residuals_live_in_host_memory_inside_the_layer_scan(remat):
    """A deviceless 8 x H100 compile of a scanned GPT's gradient: with the option the
    scan's stacked residuals are host buffers (``S(5)``) written and read inside the
    forward and backward while bodies, ``memory_analysis`` counts host bytes, and the
    device's temporary bytes shrink; without it there is no host buffer."""
    from sp_jax.analysis.checks import scanned_stack_report

    got = {off: scanned_stack_report(layers=4, hidden=256, seq=1024, heads=8, tensor=8,
                                     remat=remat, offload=off) for off in (False, True)}
    assert "S(5)" not in got[False]["hlo"] and got[False]["host_temp_bytes"] == 0
    hlo = got[True]["hlo"]
    bodies = _while_bodies(hlo)
    assert sum("S(5)" in text for text in bodies.values()) >= 2, sorted(bodies)
    assert got[True]["host_temp_bytes"] > 0
    assert got[True]["temp_bytes"] < got[False]["temp_bytes"]


# -- the memory options' H100 effect in every form of the layers ------------------------------
# Deviceless 8 x H100 compiles of a GPT's gradients (sp_jax.analysis.checks.gpt_memory_report,
# per_layer_memory): per-layer device temp growth and host bytes from 2 and 4 layers, with
# and without the option, shared by the tests below (one module fixture). h=256, s=1024:
# the smallest shape at which one layer's fp32 kernels (0.375 MiB per device) and its
# residuals (0.8 MiB) stand well above the allocator's noise (a few KiB).

H100_SHAPE = dict(hidden=256, seq=1024, heads=8, tensor=8)


@pytest.fixture(scope="module")
def per_layer():
    cache = {}

    def get(form, offload):
        if (form, offload) not in cache:
            cache[form, offload] = per_layer_memory(form, offload=offload, **H100_SHAPE)
        return cache[form, offload]

    return get


@requires_cuda_plugin
def test_h100_offload_moves_the_residuals_of_an_unrolled_stack_with_a_data_axis():
    """The fast tier's check (one compile, a quarter of the shape below): an unrolled
    2-layer GPT with a data axis, the form that moved nothing before, places each layer's
    residuals in host memory (``S(5)``), the analytic size per layer; what else goes
    (the loss head's residuals) stays under a quarter of a layer's. The device effect of
    every form is checked in the slow tier below."""
    shape = dict(hidden=128, seq=512, heads=8, tensor=8)
    got = gpt_memory_report(layers=2, offload=True, **shape, **STACK_FORMS["unrolled, data axis"])
    analytic = sum(offloaded_bytes_per_layer(**shape).values())
    assert "S(5)" in got["hlo"]
    assert 2 * analytic <= got["host_temp_bytes"] <= 2.25 * analytic, (got["host_temp_bytes"],
                                                                       analytic)


def _held(kw: dict) -> int:
    """How many micro-batches' residuals of a layer a form keeps at once (its host bytes
    per layer over one micro-batch's): a stack without stages and 1F1B's backward one;
    GPipe's tick scan one per tick, ``M + P - 1`` with ``M = P`` micro-batches (an idle
    tick computes on zeros and keeps its residuals too)."""
    stages = kw.get("stages", 1)
    return 2 * stages - 1 if stages > 1 and kw.get("schedule", "gpipe") == "gpipe" else 1


@requires_cuda_plugin
@pytest.mark.slow
@pytest.mark.parametrize("form", list(STACK_FORMS))
def test_h100_offload_moves_the_residuals_in_every_form(form, per_layer):
    """Every form of the layers (unrolled, scanned, with and without a data axis, remat,
    pipeline stages under GPipe and 1F1B) sends each layer's residuals to the host, the
    analytic size per micro-batch it keeps, and keeps at most a quarter of the device
    growth, or (GPipe) loses from it at least the residuals it moved."""
    kw = STACK_FORMS[form]
    device, host = per_layer(form, False), per_layer(form, True)
    analytic = sum(offloaded_bytes_per_layer(
        hidden=H100_SHAPE["hidden"], seq=H100_SHAPE["seq"], heads=H100_SHAPE["heads"],
        tensor=H100_SHAPE["tensor"], remat=kw.get("remat", False)).values())
    held = _held(kw)
    print(form, "MiB per layer without, with:", device, host)  # shown by pytest -rP
    assert device["host_bytes"] == 0
    if kw.get("schedule") == "1f1b":
        # measured 1.93x: one micro-batch's host buffers in each of the two tick loops
        # that back-propagate (steady state, cool-down), each its own allocation
        assert 1.9 * analytic <= host["host_bytes"] <= 2.02 * analytic, host
    else:
        assert host["host_bytes"] == pytest.approx(held * analytic, rel=0.02), host
    if kw.get("stages", 1) > 1 and held > 1:
        # GPipe (h=256, s=1024, tensor 8, 2 and 4 layers per stage): 5.86 -> 2.97 MiB
        # per layer, the 2.46 of residuals (3 ticks) gone. What stays is no residual
        # of an activation: each tick keeps the layers' fp32 kernel shards (the linear
        # rules' custom-VJP residuals, 3 x 0.375 MiB; BENCHMARKS.md, "Pipeline
        # parallelism") and the stage's weight-gradient buffers, as without the option.
        assert host["growth_bytes"] <= device["growth_bytes"] - 0.9 * held * analytic, (
            device, host)
    elif not kw.get("remat") or device["growth_bytes"] >= analytic:  # each layer's kept
        # measured: unrolled 0.04 (cotangent_barrier), scanned and scanned remat 0 (from
        # 4 to 8 layers: per_layer_memory), 1F1B 1.27 -> 0.26 (0.20x)
        assert host["growth_bytes"] <= 0.25 * device["growth_bytes"], (device, host)
    else:  # it holds less (unrolled remat: 0.017 MiB per layer against a 0.0625 input)
        assert host["growth_bytes"] <= device["growth_bytes"] + analytic / 2, (device, host)


@requires_cuda_plugin
@pytest.mark.slow
def test_h100_no_scanned_stack_keeps_its_kernels(per_layer):
    """A scanned stack's device growth per layer is the same with a data axis of size 1
    as without one: no layer's kernels are kept as residuals of the scan (the cast to vary
    over the data axis happens inside each linear op). One layer's fp32 kernels are 0.375
    MiB per device here, what the growth held more before. With a data axis of size 2 the
    growth without the option holds 0.19 MiB per layer more (measured: the all-reduce of
    the layer-stacked weight gradients over the data axis, flattened fp32 buffers); with
    the option, which moves the residuals but never a kernel, nothing grows per layer, so
    no kernel copy is kept there either."""
    base = per_layer("scanned", False)["growth_bytes"]
    kernels = 12 * H100_SHAPE["hidden"] ** 2 * 4 / H100_SHAPE["tensor"]
    got = per_layer("scanned, data axis", False)["growth_bytes"]
    assert abs(got - base) <= 0.05 * kernels, (got, base)
    two = per_layer("scanned, data 2", True)["growth_bytes"]
    assert two <= 0.05 * kernels, two
