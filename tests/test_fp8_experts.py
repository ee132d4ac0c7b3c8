"""FP8 experts: the grouped GEMMs of a mixture of experts in FP8 (the dense layers'
recipe around ``ragged_dot``) against a NumPy / ml_dtypes reference of the same
arithmetic, a sharded FP8 mixture-of-experts GPT against the unsharded one, and the
cuBLASLt FP8 GEMMs of the experts in a deviceless H100 compile."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _util import check_fp8_drift, h100_block_stack, train_gpt
from conftest import make_mesh, requires_cuda_plugin
from jax.sharding import AxisType
from test_gpt import _batches

import sp_jax
from sp_jax.models import GPTConfig
from sp_jax.ops.fp8 import Fp8Gemm, Fp8Spec
from sp_jax.ops.moe import grouped_ffn

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


# --- the NumPy / ml_dtypes reference ---------------------------------------------------

def _qdq(x, fmt, basis):
    """``x`` quantised to ``fmt`` with the scale of amax ``basis`` (saturating), back in
    fp32."""
    big = np.float32(ml_dtypes.finfo(fmt).max)
    scale = np.float32(basis) * np.float32(1.0 / float(big)) if basis > 0 else np.float32(1)
    q = np.clip(x.astype(np.float32) / scale, -big, big).astype(fmt)
    return q.astype(np.float32) * scale


def _per_group(sizes, f):
    """``f(g, rows of group g)`` concatenated over the groups."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [f(g, slice(starts[g], starts[g + 1])) for g in range(len(sizes))]


def np_fp8_ffn(x, sizes, w_up, w_down, dy, histories=None):
    """y, dx, dw_up, dw_down and each GEMM's amaxes (input, kernel, output gradient) of
    ``relu(x_g @ w_up[g]) @ w_down[g]`` per group in FP8 (e4m3 rows and weights, e5m2
    output gradients, whole-tensor scales, or from ``histories`` [2, 3, n]); rows past
    ``sum(sizes)`` are zero and count in no amax."""
    n = int(np.sum(sizes))
    x = np.where(np.arange(len(x))[:, None] < n, x, 0).astype(np.float32)
    dy = np.where(np.arange(len(dy))[:, None] < n, dy, 0).astype(np.float32)

    def basis(gemm, role, t):
        return np.abs(t).max() if histories is None else histories[gemm][role].max()

    def grouped(a, w):  # [rows, k] x [G, k, m] -> [rows, m]
        out = np.zeros((len(a), w.shape[2]), np.float32)
        for g, rows in enumerate(_per_group(sizes, lambda g, r: r)):
            out[rows] = a[rows] @ w[g]
        return out

    def wgrad(a, d):  # [rows, k] x [rows, m] -> [G, k, m]
        return np.stack(_per_group(sizes, lambda g, r: a[r].T @ d[r]))

    xq, wuq = _qdq(x, E4M3, basis(0, 0, x)), _qdq(w_up, E4M3, basis(0, 1, w_up))
    up = grouped(xq, wuq)
    a = np.maximum(up, 0)
    aq, wdq = _qdq(a, E4M3, basis(1, 0, a)), _qdq(w_down, E4M3, basis(1, 1, w_down))
    y = grouped(aq, wdq)
    dyq = _qdq(dy, E5M2, basis(1, 2, dy))
    da = grouped(dyq, np.swapaxes(wdq, 1, 2))
    dup = da * (up > 0)
    dupq = _qdq(dup, E5M2, basis(0, 2, dup))
    dx = grouped(dupq, np.swapaxes(wuq, 1, 2))
    amaxes = np.array([[np.abs(t).max() for t in ts] for ts in ((x, w_up, dup),
                                                                  (a, w_down, dy))])
    return y, dx, wgrad(xq, dupq), wgrad(aq, dyq), amaxes


def _ints(rng, shape, amax):
    """Integers in [-amax, amax], ``amax`` present: with amax 14 (e4m3: 448 / 32) or 7
    (e5m2: 57344 / 2**13) the scales are powers of two and every value is exact in FP8,
    so every product before the outputs is exact in fp32 whatever the summation order
    (the intermediate quantisations then see the same values in both)."""
    t = rng.integers(-amax, amax + 1, size=shape).astype(np.float32)
    t.flat[0] = amax
    return t


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_grouped_ffn_equals_numpy_fp8_reference(scaling):
    """The FP8 grouped FFN (up GEMM, relu, down GEMM; a group with no rows, rows past
    the groups holding large values that must enter no amax) and its gradients against
    the NumPy reference; with delayed scaling the histories scale (the rows saturate)
    and their cotangent is this step's amaxes."""
    rng = np.random.default_rng(0)
    rows, h, f, sizes = 24, 8, 16, np.array([5, 0, 9, 6], np.int32)
    x = _ints(rng, (rows, h), 14)
    x[sizes.sum():] = 100.0  # in no group
    w_up, w_down = _ints(rng, (4, h, f), 14), _ints(rng, (4, f, h), 14)
    dy = _ints(rng, (rows, h), 7)
    spec = Fp8Spec(sp_jax.Fp8Recipe(scaling, 4), ())
    histories = None
    if scaling == "delayed":  # rows: input, kernel, output gradient; columns: steps
        histories = np.array([[[7, 1, 0, 2], [28, 3, 0, 0], [500, 0, 9, 0]],
                              [[900, 0, 0, 0], [2, 14, 1, 0], [14, 0, 3, 0]]], np.float32)

    def loss(x, w_up, w_down, hist):
        y = grouped_ffn(x, jnp.asarray(sizes), w_up, w_down, jax.nn.relu, gemm=Fp8Gemm(spec),
                        gemm_states=(None, None) if hist is None else (hist[0], hist[1]))
        return jnp.sum(y * dy), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        x, w_up, w_down, None if histories is None else jnp.asarray(histories))
    ref = np_fp8_ffn(x, sizes, w_up, w_down, dy, histories)
    for name, got, want in zip(("y", "dx", "dw_up", "dw_down"), (y, *grads[:3]), ref[:4],
                               strict=True):
        got = np.asarray(got)
        assert got.shape == want.shape, name
        err = np.max(np.abs(got - want)) / np.max(np.abs(want))
        assert err <= 1e-6, (name, scaling, err)
    if scaling == "delayed":
        cot = np.asarray(grads[3])
        np.testing.assert_array_equal(cot[..., 0], ref[4])
        assert not cot[..., 1:].any()


# --- the model: sharded FP8 experts vs unsharded -----------------------------------------

MOE_MODEL = dict(vocab_size=64, max_seq_len=16, num_layers=2, num_heads=4, num_kv_heads=2,
                 hidden=32, mlp_hidden=48, num_experts=4, experts_per_token=2,
                 moe_mlp_hidden=16, router_aux_loss_coef=0.05, router_z_loss_coef=0.01)
MOE_MESHES = {  # (stage, data, expert, context, tensor), ParallelConfig options, model options
    "data2_expert2_tensor2": ((1, 2, 2, 1, 2), dict(expert_axis="expert"), {}),
    # the histories stacked [layers, 3, n] with the scanned layers; expert weights sharded
    # over the data axis too
    "data2_expert2_tensor2_scan_fsdp": ((1, 2, 2, 1, 2), dict(expert_axis="expert", fsdp=True),
                                        dict(scan_layers=True)),
    # the experts' histories held by their stage, rolled with the maximum over the
    # micro-batches (2: the reference runs the same two)
    "stage2_expert2_tensor2_1f1b": ((2, 1, 2, 1, 2), dict(
        expert_axis="expert", pipeline_axis="stage", pipeline_microbatches=2,
        pipeline_schedule="1f1b"), dict(scan_layers=True)),
}
_UNSHARDED: dict = {}


def _moe_run(scaling, mesh_name, unsharded=False, steps=3):
    shape, options, model = MOE_MESHES[mesh_name]
    cfg = GPTConfig.llama("llama-tiny", **MOE_MODEL, **model,
                          fp8=sp_jax.Fp8Recipe(scaling, 4))
    batches = _batches(cfg.vocab_size, steps=steps, micro=options.get("pipeline_microbatches", 1))
    if unsharded:  # the reference: the same model on one device
        return train_gpt(cfg, sp_jax.ParallelConfig(), make_mesh(1, 1), batches)
    mesh = jax.make_mesh(shape, ("stage", "data", "expert", "context", "tensor"),
                         axis_types=(AxisType.Explicit,) * 5,
                         devices=jax.devices()[: int(np.prod(shape))])
    return train_gpt(cfg, sp_jax.ParallelConfig(**options), mesh, batches)


def _histories(params):
    """Every amax history of the experts ``[3, n]``, by layer (scanned layers: the
    stacked ``[layers, 3, n]`` split)."""
    blocks = params["blocks"]
    if "mlp" in blocks:  # scanned: one block of stacked values
        blocks = {i: jax.tree.map(lambda v, i=i: v[i], blocks)
                  for i in range(MOE_MODEL["num_layers"])}
    return {(i, name): np.asarray(block["mlp"][name])
            for i, block in blocks.items()
            for name in ("experts_up_fp8_history", "experts_down_fp8_history")}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MOE_MESHES))
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_sharded_fp8_experts_first_step_equals_unsharded(scaling, mesh_name):
    """An FP8 mixture-of-experts GPT (llama-tiny, 4 experts, top 2) on (data 2, expert 2,
    tensor 2), or in two 1F1B pipeline stages (expert 2, tensor 2), against the same model
    on one device (the same micro-batches): the first step's loss within 4e-4
    relative (later steps reported: FP8 turns other reduction orders' fp32 rounding into
    whole-quantum flips); with delayed scaling the experts' amax histories, rolled once
    per step, equal the unsharded model's."""
    reference = (scaling, bool(MOE_MESHES[mesh_name][2]),
                 MOE_MESHES[mesh_name][1].get("pipeline_microbatches", 1))
    if reference not in _UNSHARDED:
        _UNSHARDED[reference] = _moe_run(scaling, mesh_name, unsharded=True)
    _, ref, ref_params, _ = _UNSHARDED[reference]
    _, losses, params, _ = _moe_run(scaling, mesh_name)
    check_fp8_drift(losses, ref, f"experts {scaling} {mesh_name} vs unsharded")
    if scaling == "delayed":
        got, want = _histories(params), _histories(ref_params)
        assert got.keys() == want.keys() and got
        for key, h in got.items():
            assert np.all(h[:, :3] > 0) and not h[:, 3:].any(), key  # 3 steps rolled in
            print(key, np.max(np.abs(h - want[key]) / np.maximum(want[key], 1e-30)))
            np.testing.assert_allclose(h, want[key], rtol=1e-4, err_msg=str(key))


# --- HLO: the experts' GEMMs are cuBLASLt FP8 GEMMs ---------------------------------------

def _fp8_gemms(hlo: str) -> dict[str, int]:
    """The ``__cublas$lt$matmul$f8`` custom calls of an optimized HLO text, counted by
    where they come from: the experts' ``ragged_dot_general`` or another product."""
    calls = re.findall(r'custom_call_target="__cublas\$lt\$matmul\$f8"[^\n]*', hlo)
    ragged = sum("ragged_dot_general" in c for c in calls)
    return {"experts": ragged, "other": len(calls) - ragged}


@pytest.mark.slow
@requires_cuda_plugin
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_h100_fp8_experts_are_cublaslt_fp8_gemms(scaling):
    """Deviceless 8 x H100 compile (tensor 8, bf16) of the gradients through 2 FP8
    mixture-of-experts Blocks. One expert per device: each layer's 2 grouped GEMMs run
    forward, dgrad and wgrad as cuBLASLt FP8 GEMMs (6 per layer, beside the attention
    projections' 6), given xla_gpu_enable_triton_gemm=false. Several (4): the experts'
    GEMMs are the routed rows' tile loops (no masked product over every expert), none an
    FP8 GEMM; without FP8 the experts run none."""
    from sp_jax.xla_flags import FP8_COMPILER_OPTIONS

    fp8 = dict(fp8=sp_jax.Fp8Recipe(scaling, 4), compiler_options=FP8_COMPILER_OPTIONS)
    one = dict(num_experts=1, experts_per_token=1, moe_mlp_hidden=128)
    assert _fp8_gemms(h100_block_stack(2, **fp8, **one).hlo) == {"experts": 2 * 6,
                                                                  "other": 2 * 6}
    moe = dict(num_experts=4, experts_per_token=2, moe_mlp_hidden=128)
    rep = h100_block_stack(2, **fp8, **moe)
    assert _fp8_gemms(rep.hlo) == {"experts": 0, "other": 2 * 6}
    assert "ragged_dot" not in rep.hlo and " while(" in rep.hlo
    plain = h100_block_stack(1, compiler_options=FP8_COMPILER_OPTIONS, **moe)
    assert _fp8_gemms(plain.hlo) == {"experts": 0, "other": 0}
