"""``make gpu-check``'s script (scripts/gpu_check.py) on simulated CPU devices: every
variant trains from the same weights and is timed, the predicted peak is reported, the
GPU-only numbers are reported as not measured with their reason, the single-device caveat
appears exactly when tensor = 1, the trace is written, and the FP8 variants are reported
beside bf16 (no GPU flags on CPU). Plus its pure helpers (shape fitting, peak table, FLOPs
formula, the FP8 workers' flags)."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _util import script_env

from scripts.gpu_check import (
    FP8_VARIANTS,
    VARIANTS,
    ModelShape,
    _fp8_flags,
    _with_flags,
    fit_shape,
    markdown,
    model_flops,
    peak_bf16_flops,
)
from sp_jax.xla_flags import FP8_GPU_FLAGS

ROOT = Path(__file__).resolve().parents[1]
SINGLE_DEVICE = "there is no communication at all"


def _run(out: Path, *extra: str) -> tuple[dict, str]:
    """Runs the script as ``make gpu-check`` would, with ``--quick --platform cpu``; no
    device count in XLA_FLAGS, so it must set its own simulated devices."""
    env = script_env()
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.gpu_check", "--quick", "--platform", "cpu",
         "--out", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return (json.loads((out / "gpu_check.json").read_text()),
            (out / "gpu_check.md").read_text())


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """All six variants (four bf16, two FP8) at tensor = 4."""
    out = tmp_path_factory.mktemp("gpu_check_4")
    report, md = _run(out, "--devices", "4")
    return out, report, md


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One variant (the traced one) at tensor = 1: cheap, for the single-device caveat."""
    out = tmp_path_factory.mktemp("gpu_check_1")
    report, md = _run(out, "--devices", "1", "--variants", "sp_jax_cm")
    return out, report, md


def _tables(md: str) -> list[list[str]]:
    """The markdown tables, each as its rows (header first, no separator)."""
    tables, current = [], []
    for line in [*md.splitlines(), ""]:
        if line.startswith("| "):
            current.append(line)
        elif not line.startswith("|---") and current:
            tables.append(current)
            current = []
    return tables


def _rows(rows: list[str]) -> dict[str, list[str]]:
    return {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in rows[1:]}


def _table(md: str) -> dict[str, list[str]]:
    """The main markdown table's rows, by variant."""
    rows = _tables(md)[0]
    assert rows[0].split("|")[1:-1] == [
        " variant ", " tensor size ", " step ms ", " tokens/s ", " MFU ", " real peak MiB ",
        " predicted peak MiB ", " first loss "], rows[0]
    return _rows(rows)


def _fp8_table(md: str) -> dict[str, list[str]]:
    """The FP8 table's rows, by variant."""
    rows = _tables(md)[1]
    assert rows[0].split("|")[1:-1] == [
        " variant ", " scaling ", " tokens/s ", " vs bf16 sp_jax ", " MFU (of bf16 peak) ",
        " cuBLASLt FP8 GEMMs "], rows[0]
    return _rows(rows)


@pytest.mark.slow
def test_every_variant_timed_on_its_devices(four):
    _, report, _ = four
    assert report["ok"] and report["platform"] == "cpu" and report["tensor"] == 4
    # the script simulated its own devices (XLA_FLAGS was unset)
    assert "--xla_force_host_platform_device_count=4" in report["xla_flags"]
    assert tuple(report["variants"]) == VARIANTS
    assert set(FP8_VARIANTS) < set(VARIANTS)
    tokens = report["shape"]["batch"] * report["shape"]["seq"]
    for name, r in report["variants"].items():
        assert "error" not in r, r.get("error")
        assert r["devices"] == (1 if name == "unsharded" else 4), name
        assert len(r["step_s_samples"]) == report["settings"]["steps"]
        assert all(t > 0 for t in r["step_s_samples"]), name
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0, name
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s"]), name


@pytest.mark.slow
def test_variants_start_from_the_same_weights(four):
    _, report, _ = four
    runs = report["variants"].values()
    assert len({r["params"] for r in runs}) == 1
    losses = {r["variant"]: r["first_loss"] for r in runs}
    assert all(math.isfinite(x) for x in losses.values())
    bf16 = [x for name, x in losses.items() if name not in FP8_VARIANTS]
    # same weights and batch: equal up to bf16 rounding (other seeds differ by far more)
    assert max(bf16) - min(bf16) < 0.01, losses
    # FP8 projections: close to bf16 at the same weights (e4m3 keeps 3 mantissa bits)
    for name in FP8_VARIANTS:
        assert abs(losses[name] - losses["sp_jax"]) < 0.05, losses
    # and every variant trained: the loss moved after the optimizer steps
    for r in runs:
        assert r["last_loss"] < r["first_loss"], r["variant"]


@pytest.mark.slow
def test_predicted_peak_is_memory_analysis_of_the_step(four):
    _, report, _ = four
    v = report["variants"]
    for name, r in v.items():
        parts = r["predicted"]
        assert parts["argument"] > 0 and parts["temp"] > 0, name
        assert r["predicted_peak_bytes"] == (parts["temp"] + parts["argument"]
                                             + parts["output"] - parts["alias"]), name
        # arguments hold at least this device's fp32 parameters and two AdamW moments
        assert parts["argument"] >= 3 * 4 * r["params"] / r["devices"] * 0.9, name
    # splitting over 4 devices needs less per device than one device holding everything
    for name in ("sp_jax", "sp_jax_cm", "gspmd"):
        assert v[name]["predicted_peak_bytes"] < v["unsharded"]["predicted_peak_bytes"], name


@pytest.mark.slow
def test_gpu_only_numbers_not_measured_on_cpu(four):
    _, report, md = four
    rows = _table(md)
    assert set(rows) == set(VARIANTS)
    for name, r in report["variants"].items():
        assert r["real_peak_bytes"] is None, name
        assert r["real_peak_note"].startswith("not measured") and "memory_stats()" in \
            r["real_peak_note"], r["real_peak_note"]
        assert r["mfu"] is None and r["mfu_note"].startswith("not measured"), r["mfu_note"]
        tensor, step_ms, tokens_s, mfu, real, predicted, loss = rows[name]
        assert (mfu, real) == ("not measured", "not measured"), rows[name]
        assert int(tensor) == r["devices"]
        assert float(step_ms) == pytest.approx(r["step_ms"], abs=0.01)
        assert float(predicted) == pytest.approx(r["predicted_peak_bytes"] / 2**20, abs=0.01)
        assert float(loss) == pytest.approx(r["first_loss"], abs=1e-4)
    assert "memory_stats() is None on cpu" in md and "no peak bf16 FLOP/s for a CPU" in md


@pytest.mark.slow
def test_model_flops_agree_with_xla_count(four):
    _, report, _ = four
    for name, r in report["variants"].items():
        xla = r["xla_flops_per_device"] * r["devices"]
        # XLA also counts the optimizer, norms, softmax and the recomputed GELU
        assert 0.9 < xla / r["flops_per_step"] < 1.5, (name, xla, r["flops_per_step"])


@pytest.mark.slow
def test_trace_written_for_collective_matmul(four, one):
    for out, report, md in (four, one):
        trace = report["trace"]
        assert trace["variant"] == "sp_jax_cm" and trace["steps"] > 0 and trace["error"] is None
        assert any(f.endswith(".xplane.pb") for f in trace["files"]), trace["files"]
        for f in trace["files"]:
            assert (out / f).is_file() and (out / f).stat().st_size > 0, f
            assert f.startswith("trace/"), f
        assert f"in `{out / 'trace'}`" in md


@pytest.mark.slow
def test_single_device_caveat_only_at_tensor_1(four, one):
    _, report4, md4 = four
    _, report1, md1 = one
    assert report1["tensor"] == 1 and list(report1["variants"]) == ["sp_jax_cm"]
    assert report1["variants"]["sp_jax_cm"]["devices"] == 1
    assert any(SINGLE_DEVICE in c and "collective matmul" in c.lower()
               for c in report1["caveats"]), report1["caveats"]
    assert SINGLE_DEVICE in md1 and "What this run cannot measure" in md1
    assert not any(SINGLE_DEVICE in c for c in report4["caveats"])
    assert SINGLE_DEVICE not in md4


def test_fit_shape():
    shape = ModelShape(hidden=4096, heads=32, layers=8, seq=2048, vocab=32768, batch=8)
    assert fit_shape(shape, 8) == (shape, [])
    fitted, notes = fit_shape(shape, 6)
    assert (fitted.heads, fitted.hidden, fitted.seq) == (36, 36 * 128, 2046)
    assert len(notes) == 2 and "heads 32 -> 36" in notes[0] and "seq 2048 -> 2046" in notes[1]
    with pytest.raises(ValueError, match="hidden=100 must be divisible by heads=3"):
        ModelShape(hidden=100, heads=3, layers=1, seq=8, vocab=8, batch=1)


def test_peak_table():
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert peak_bf16_flops("NVIDIA H200")[0] == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe")[0] == 756e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB")[0] == 312e12
    for kind in ("Tesla V100-SXM2-16GB", "NVIDIA H100 NVL"):
        peak, why = peak_bf16_flops(kind)
        assert peak is None and why.startswith("not measured") and kind in why


def test_model_flops_formula():
    # hand count: 6 * P * T + 12 * L * h * s * T
    shape = ModelShape(hidden=8, heads=2, layers=3, seq=4, vocab=16, batch=5)
    assert model_flops(shape, 1000) == 6 * 1000 * 20 + 12 * 3 * 8 * 4 * 20


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--quick", "--devices", "9"], r"--devices 9 must be in 1\.\.8"),
    ([], r"sized for GPUs; on CPU run with --quick"),  # the full shapes on CPU: refused
], ids=["too-many-devices", "full-shapes-on-cpu"])
def test_bad_arguments_fail_clearly(tmp_path, args, message):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.gpu_check", "--platform", "cpu", *args,
         "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.slow
def test_fp8_rows_beside_bf16(four):
    _, report, md = four
    v = report["variants"]
    base = v["sp_jax"]["tokens_per_s"]
    fp8 = _fp8_table(md)
    assert set(fp8) == set(FP8_VARIANTS)
    assert report["fp8"]["variants"] == list(FP8_VARIANTS)
    # CPU: none of the GPU flags (XLA:GPU's, for cuBLASLt FP8 GEMMs)
    assert report["fp8"]["xla_flags"] == []
    for name, scaling in FP8_VARIANTS.items():
        r = v[name]
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, name
        assert r["fp8_scaling"] == scaling
        assert r["tokens_per_s_vs_bf16"] == pytest.approx(r["tokens_per_s"] / base), name
        assert r["fp8_gemms"] == "n/a" and r["fp8_gemms_note"].startswith("n/a"), r
        assert not any(f.name in r["xla_flags"] for f in FP8_GPU_FLAGS), r["xla_flags"]
        # the delayed recipe keeps amax histories, and they are not counted as parameters
        assert (r["fp8_history_values"] > 0) == (scaling == "delayed"), name
        row_scaling, tokens_s, ratio, mfu, gemms = fp8[name]
        assert row_scaling == scaling and mfu == "not measured" and gemms == "n/a", fp8[name]
        assert float(tokens_s.replace(",", "")) == pytest.approx(r["tokens_per_s"], abs=1)
        assert ratio == f"{r['tokens_per_s_vs_bf16']:.2f}x"
    assert "MFU is quoted against the dense bf16 peak" in md
    assert any("FP8 variants on CPU" in c for c in report["caveats"])


@pytest.mark.slow
def test_fp8_on_gpu_shows_mfu_and_gemm_count(four):
    """The FP8 rows as a GPU run fills them in (numbers set by hand on the CPU report)."""
    _, report, _ = four
    report = json.loads(json.dumps(report))
    report["fp8"]["xla_flags"] = [f.flag for f in FP8_GPU_FLAGS]
    for r in report["variants"].values():
        r["mfu"] = 0.41
    v = report["variants"]
    v["sp_jax_fp8_current"].update(mfu=0.62, fp8_gemms=24, tokens_per_s_vs_bf16=1.51)
    v["sp_jax_fp8_delayed"].update(tokens_per_s_vs_bf16=None)
    fp8 = _fp8_table(markdown(report))
    assert fp8["sp_jax_fp8_current"][2:] == ["1.51x", "62.0%", "24"]
    assert fp8["sp_jax_fp8_delayed"][2:4] == ["not measured", "41.0%"]
    assert "`--xla_gpu_enable_triton_gemm=false`" in markdown(report)


@pytest.mark.slow
def test_fp8_flags_only_on_gpu():
    assert _fp8_flags("cpu") == []
    assert _fp8_flags("gpu") == ["--xla_gpu_enable_triton_gemm=false"]
    flags = ["--xla_gpu_enable_triton_gemm=false"]
    assert _with_flags({"XLA_FLAGS": "--a=1"}, flags) == {
        "XLA_FLAGS": "--a=1 --xla_gpu_enable_triton_gemm=false"}
    # a value the user set is kept
    user = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    assert _with_flags(user, flags) == user
    assert _with_flags({}, []) == {}


@pytest.mark.slow
def test_cudnn_attention_compiled_deviceless_and_not_run_on_cpu(four):
    """The cuDNN variant is not run off a GPU (said so), and the step compiled deviceless
    for the run's H100s calls cuDNN's fused attention: a forward and a backward call a
    layer (or, without the CUDA plugin, a note saying why there is no count)."""
    from sp_jax.analysis import cuda_plugin_available

    _, report, md = four
    cudnn = report["cudnn"]
    assert "sp_jax_cudnn" not in report["variants"]
    assert cudnn["note"].startswith("not measured: cuDNN's attention runs on GPUs only")
    assert cudnn["expected_calls"] == 2 * report["shape"]["layers"]
    dl = cudnn["deviceless"]
    if cuda_plugin_available():
        assert dl["cudnn_calls"] == cudnn["expected_calls"] and dl["tensor"] == 4, dl
        assert f"{dl['cudnn_calls']} `__cudnn$fmha...` custom calls in the step compiled " \
               "deviceless for 4 H100(s)" in md
    else:
        assert dl["cudnn_calls"] is None and dl["note"].startswith("not measured"), dl
    # on a GPU: the real step's count, speed and first loss against sp_jax's kernel
    gpu = json.loads(json.dumps(report))
    gpu["cudnn"].update(cudnn_calls=2, tokens_per_s_vs_xla=1.25, first_loss_difference=0.002)
    assert ("2 `__cudnn$fmha...` custom calls in the compiled step, tokens/s 1.25x those "
            "of `sp_jax` (sp_jax's blockwise kernel), first loss +0.0020 from it") in \
        markdown(gpu)
