"""``make gpu-check``'s script (benchmarks/gpu_check.py) on simulated CPU devices: every
variant trains from the same weights and is timed, the predicted peak is reported, the
GPU-only numbers are reported as not measured with their reason, the single-device caveat
appears exactly when tensor = 1, and the trace is written. Plus its pure helpers (shape
fitting, peak table, FLOPs formula)."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _util import script_env

from benchmarks.gpu_check import (
    VARIANTS,
    ModelShape,
    fit_shape,
    model_flops,
    peak_bf16_flops,
)

ROOT = Path(__file__).resolve().parents[1]
SINGLE_DEVICE = "there is no communication at all"


def _run(out: Path, *extra: str) -> tuple[dict, str]:
    """Runs the script as ``make gpu-check`` would, with ``--quick --platform cpu``; no
    device count in XLA_FLAGS, so it must set its own simulated devices."""
    env = script_env()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--quick", "--platform", "cpu",
         "--out", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return (json.loads((out / "gpu_check.json").read_text()),
            (out / "gpu_check.md").read_text())


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """All four variants at tensor = 4."""
    out = tmp_path_factory.mktemp("gpu_check_4")
    report, md = _run(out, "--devices", "4")
    return out, report, md


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One variant (the traced one) at tensor = 1: cheap, for the single-device caveat."""
    out = tmp_path_factory.mktemp("gpu_check_1")
    report, md = _run(out, "--devices", "1", "--variants", "sp_jax_cm")
    return out, report, md


def _table(md: str) -> dict[str, list[str]]:
    """The markdown table's rows, by variant."""
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert rows[0].split("|")[1:-1] == [
        " variant ", " tensor size ", " step ms ", " tokens/s ", " MFU ", " real peak MiB ",
        " predicted peak MiB ", " first loss "], rows[0]
    return {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in rows[1:]}


def test_every_variant_timed_on_its_devices(four):
    _, report, _ = four
    assert report["ok"] and report["platform"] == "cpu" and report["tensor"] == 4
    # the script simulated its own devices (XLA_FLAGS was unset)
    assert "--xla_force_host_platform_device_count=4" in report["xla_flags"]
    assert tuple(report["variants"]) == VARIANTS
    tokens = report["shape"]["batch"] * report["shape"]["seq"]
    for name, r in report["variants"].items():
        assert "error" not in r, r.get("error")
        assert r["devices"] == (1 if name == "unsharded" else 4), name
        assert len(r["step_s_samples"]) == report["settings"]["steps"]
        assert all(t > 0 for t in r["step_s_samples"]), name
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0, name
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s"]), name


def test_variants_start_from_the_same_weights(four):
    _, report, _ = four
    runs = report["variants"].values()
    assert len({r["params"] for r in runs}) == 1
    losses = [r["first_loss"] for r in runs]
    assert all(math.isfinite(x) for x in losses)
    # same weights and batch: equal up to bf16 rounding (other seeds differ by far more)
    assert max(losses) - min(losses) < 0.01, losses
    # and every variant trained: the loss moved after the optimizer steps
    for r in runs:
        assert r["last_loss"] < r["first_loss"], r["variant"]


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


def test_model_flops_agree_with_xla_count(four):
    _, report, _ = four
    for name, r in report["variants"].items():
        xla = r["xla_flops_per_device"] * r["devices"]
        # XLA also counts the optimizer, norms, softmax and the recomputed GELU
        assert 0.9 < xla / r["flops_per_step"] < 1.5, (name, xla, r["flops_per_step"])


def test_trace_written_for_collective_matmul(four, one):
    for out, report, md in (four, one):
        trace = report["trace"]
        assert trace["variant"] == "sp_jax_cm" and trace["steps"] > 0 and trace["error"] is None
        assert any(f.endswith(".xplane.pb") for f in trace["files"]), trace["files"]
        for f in trace["files"]:
            assert (out / f).is_file() and (out / f).stat().st_size > 0, f
            assert f.startswith("trace/"), f
        assert f"in `{out / 'trace'}`" in md


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


@pytest.mark.parametrize("args, message", [
    (["--quick", "--devices", "9"], r"--devices 9 must be in 1\.\.8"),
    ([], r"sized for GPUs; on CPU run with --quick"),  # the full shapes on CPU: refused
], ids=["too-many-devices", "full-shapes-on-cpu"])
def test_bad_arguments_fail_clearly(tmp_path, args, message):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--platform", "cpu", *args,
         "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()
