"""sp_jax.training.log: the JSON-lines metrics log (flushed per record, resumable), the
loss plot, the TensorBoard log (read back with TensorBoard's own reader) and MFU."""

from __future__ import annotations

import errno
import json
import os
import sys

import numpy as np
import pytest

from sp_jax.training import MetricsLog, plot_losses
from sp_jax.training.log import (
    MetricsLogError,
    TensorBoardLog,
    device_peak_flops,
    model_flops_utilization,
)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_records_are_written_and_flushed(tmp_path):
    path = tmp_path / "runs" / "log.jsonl"  # the directory is created
    with MetricsLog(path) as log:
        log.write({"step": 0, "eval_loss": 5.5})
        log.write({"step": 1, "loss": 5.0})
        # Readable before the file is closed (an interrupted run keeps every record).
        assert _lines(path) == [{"step": 0, "eval_loss": 5.5}, {"step": 1, "loss": 5.0}]
    assert log.records == _lines(path)
    with pytest.raises(ValueError, match="is closed"):
        log.write({"step": 2, "loss": 4.0})
    assert len(log.records) == 2


def test_resume_keeps_records_up_to_the_step_and_appends(tmp_path):
    path = tmp_path / "log.jsonl"
    with MetricsLog(path) as log:
        for step in range(1, 6):
            log.write({"step": step, "loss": float(step)})
        log.write({"step": 5, "eval_loss": 1.0})
    # Resumed from the step-3 checkpoint: steps 4-5 of the interrupted run are redone.
    with MetricsLog(path, resume_from=3) as log:
        assert [r["step"] for r in log.records] == [1, 2, 3]
        log.write({"step": 4, "loss": 40.0})
    assert _lines(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0},
                            {"step": 3, "loss": 3.0}, {"step": 4, "loss": 40.0}]
    # A new run (resume_from=0) starts the file afresh.
    with MetricsLog(path) as log:
        log.write({"step": 1, "loss": 9.0})
    assert _lines(path) == [{"step": 1, "loss": 9.0}]


def test_resume_without_a_file_starts_one(tmp_path):
    with MetricsLog(tmp_path / "new.jsonl", resume_from=7) as log:
        log.write({"step": 8, "loss": 1.0})
    assert _lines(tmp_path / "new.jsonl") == [{"step": 8, "loss": 1.0}]


def test_in_memory_without_a_path(tmp_path):
    with MetricsLog(None) as log:
        log.write({"step": 1, "loss": 2.0})
    assert log.records == [{"step": 1, "loss": 2.0}]
    assert list(tmp_path.iterdir()) == []


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="resume_from=-1 must be an int >= 0"):
        MetricsLog(tmp_path / "x.jsonl", resume_from=-1)
    with MetricsLog(tmp_path / "x.jsonl") as log, pytest.raises(TypeError):
        log.write({"step": 1, "loss": object()})
    assert log.records == [] and (tmp_path / "x.jsonl").read_text() == ""
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"line 2 of .*bad.jsonl is not JSON"):
        MetricsLog(tmp_path / "bad.jsonl", resume_from=1)


def test_a_torn_last_line_is_dropped_on_resume(tmp_path):
    """A write cut short (kill, full disk) leaves half a record at the end: the resume
    keeps the complete records up to its step and warns."""
    path = tmp_path / "torn.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    with pytest.warns(UserWarning, match="torn last line 3"), \
            MetricsLog(path, resume_from=2) as log:
        log.write({"step": 3, "loss": 1.8})
    assert [r["step"] for r in log.records] == [1, 2, 3]
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]


class _DiskFillsUp:
    """A log file whose disk fills up in the middle of the next write: half of the
    bytes land, then ENOSPC."""

    def __init__(self, file):
        self.file = file

    def write(self, data) -> int:
        self.file.write(bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_full_disk_leaves_no_torn_line_and_names_the_file(tmp_path):
    path = tmp_path / "log.jsonl"
    log = MetricsLog(path)
    log.write({"step": 1, "loss": 2.5})
    log._file = _DiskFillsUp(log._file)
    with pytest.raises(MetricsLogError) as info:
        log.write({"step": 2, "loss": 2.25})
    assert str(info.value) == (f"MetricsLog: cannot write {path} (a record of step 2): No space "
                               "left on device; its last complete record is of step 1")
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    log.close()
    assert path.read_text() == '{"step": 1, "loss": 2.5}\n'  # the half line was cut off
    assert log.records == [{"step": 1, "loss": 2.5}]
    with pytest.raises(MetricsLogError, match="cannot write /dev/full .* No space left"):
        MetricsLog("/dev/full").write({"step": 1})


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")  # the examples extra, not the test extra
    records = [{"step": i, "loss": 5.0 - 0.1 * i} for i in range(1, 31)]
    records += [{"step": 0, "eval_loss": 5.2}, {"step": 30, "eval_loss": 2.3}]
    path = tmp_path / "plots" / "loss.png"
    plot_losses(path, records, title="test", ylabel="nats")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(ImportError, match=r"pip install '\.\[examples\]' in a clone"):
        plot_losses(tmp_path / "loss.png", [{"step": 1, "loss": 1.0}])
    assert not (tmp_path / "loss.png").exists()


def _scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in ``directory``, as TensorBoard's own reader sees it."""
    pytest.importorskip("tensorboard")  # the test extra
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.fspath(directory)).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_tensorboard_scalars_have_stable_tags(tmp_path):
    directory = tmp_path / "runs" / "tb"  # created
    with TensorBoardLog(directory) as tb:
        tb.write({"step": 0, "eval_loss": 5.5})
        tb.write({"step": 1, "loss": 5.25, "tokens_per_s": 1024.0, "grad_norm": 1.5,
                  "update_ratio": 0.125, "time_s": 0.75, "lr": 0.25, "mfu": 0.5,
                  "tokens": np.int64(4096), "scale": np.float32(2.0),
                  "note": "text", "finite": True, "none": None, "vector": np.ones(3)})
        tb.write({"step": 2, "loss": np.asarray(4.75, dtype=np.float32)})  # a 0-d array
        tb.write({"step": 3, "eval_loss": 4.5, "eval_accuracy": 0.25})
        # Readable before the log is closed (each record is written whole, at once).
        assert _scalars(directory)["train/loss"] == [(1, 5.25), (2, 4.75)]
    assert _scalars(directory) == {
        "eval/loss": [(0, 5.5), (3, 4.5)], "eval/accuracy": [(3, 0.25)],
        "train/loss": [(1, 5.25), (2, 4.75)], "train/tokens_per_s": [(1, 1024.0)],
        "train/grad_norm": [(1, 1.5)], "train/update_ratio": [(1, 0.125)],
        "train/time_s": [(1, 0.75)], "train/learning_rate": [(1, 0.25)],
        "train/mfu": [(1, 0.5)], "train/tokens": [(1, 4096.0)], "train/scale": [(1, 2.0)]}
    assert [f.name for f in directory.iterdir()] == [os.path.basename(tb.path)]
    assert os.path.basename(tb.path).startswith("events.out.tfevents.")
    with pytest.raises(ValueError, match="is closed"):
        tb.write({"step": 4, "loss": 4.0})
    assert TensorBoardLog.tag("lr") == "train/learning_rate"
    assert TensorBoardLog.tag("loss") == "train/loss"
    assert TensorBoardLog.tag("eval_loss") == "eval/loss"


def test_tensorboard_resume_hides_the_redone_steps(tmp_path):
    with TensorBoardLog(tmp_path) as tb:
        for step in range(1, 6):
            tb.write({"step": step, "loss": float(step)})
        tb.write({"step": 5, "eval_loss": 1.0})
    # Resumed from the step-3 checkpoint: steps 4-5 of the interrupted run are redone.
    # Within the same second: the new file must neither overwrite nor precede the old one.
    with TensorBoardLog(tmp_path, resume_from=3) as tb:
        tb.write({"step": 4, "loss": 40.0})
    assert _scalars(tmp_path) == {"train/loss": [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)],
                                  "eval/loss": []}
    assert len(list(tmp_path.iterdir())) == 2  # hidden, not deleted
    # A new run (resume_from=0) hides every earlier event.
    with TensorBoardLog(tmp_path) as tb:
        tb.write({"step": 0, "eval_loss": 9.5})
        tb.write({"step": 1, "loss": 9.0})
    assert _scalars(tmp_path) == {"train/loss": [(1, 9.0)], "eval/loss": [(0, 9.5)]}


def test_tensorboard_without_a_directory_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing in the working directory either
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # not needed without a directory
    with TensorBoardLog(None, resume_from=5) as tb:
        tb.write({"step": 6, "loss": 2.0})
    assert tb.path is None and list(tmp_path.iterdir()) == []
    with pytest.raises(ImportError, match="TensorBoardLog needs tensorboardX.*pip install "
                                          "tensorboardX"):
        TensorBoardLog(tmp_path / "tb")
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_bad_input(tmp_path):
    with pytest.raises(ValueError, match="resume_from=-1 must be an int >= 0"):
        TensorBoardLog(tmp_path, resume_from=-1)
    with TensorBoardLog(None) as tb:  # the same checks on every process
        for record in ({"loss": 1.0}, {"step": -1, "loss": 1.0}, {"step": 1.5, "loss": 1.0}):
            with pytest.raises(ValueError, match="needs a 'step' that is an int >= 0"):
                tb.write(record)
    (tmp_path / "file").write_text("")
    with pytest.raises(MetricsLogError, match=f"TensorBoardLog: cannot write "
                                              f"{tmp_path / 'file' / 'tb'} \\(creating"):
        TensorBoardLog(tmp_path / "file" / "tb")


def test_tensorboard_full_disk_names_the_directory_and_leaves_whole_records(tmp_path):
    tb = TensorBoardLog(tmp_path)
    tb.write({"step": 1, "loss": 2.5})
    size = os.path.getsize(tb.path)
    tb._file = _DiskFillsUp(tb._file)
    with pytest.raises(MetricsLogError) as info:
        tb.write({"step": 2, "loss": 2.25, "lr": 0.5})
    assert str(info.value) == (f"TensorBoardLog: cannot write {tmp_path} (a record of step 2): "
                               "No space left on device; its last complete record is of step 1")
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    tb.close()
    assert os.path.getsize(tb.path) == size  # the half record was cut off
    assert _scalars(tmp_path) == {"train/loss": [(1, 2.5)]}


def test_model_flops_utilization():
    # 2000 tokens/s of a model of 6e9 FLOPs per token on devices of 24e12 FLOP/s in all.
    assert model_flops_utilization(2000.0, 6e9, 24e12) == pytest.approx(0.5)
    assert model_flops_utilization(0, 6e9, 24e12) == 0.0
    assert model_flops_utilization(2000.0, 6e9, None) is None  # the peak is unknown
    for args, what in (((-1.0, 6e9, 1e12), "tokens_per_s=-1.0"),
                       ((float("nan"), 6e9, 1e12), "tokens_per_s=nan"),
                       ((1.0, 0, 1e12), "flops_per_token=0"),
                       ((1.0, 6e9, 0.0), "peak_flops=0.0"),
                       ((True, 6e9, 1e12), "tokens_per_s=True")):
        with pytest.raises(ValueError, match=f"{what} must be a finite number"):
            model_flops_utilization(*args)


class _Device:
    def __init__(self, device_kind: str):
        self.device_kind = device_kind


def test_device_peak_flops():
    import jax.numpy as jnp

    assert device_peak_flops() is None  # the tests' CPU devices
    h100 = _Device("NVIDIA H100 80GB HBM3")
    assert device_peak_flops(h100) == 989e12
    assert device_peak_flops(h100, jnp.bfloat16) == 989e12
    assert device_peak_flops(h100, "float32") == 494.5e12  # TF32 tensor cores
    kinds = {"NVIDIA H100 PCIe": 756e12, "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA A100 80GB PCIe": 312e12, "NVIDIA L4": 121e12, "TPU v4": 275e12,
             "TPU v5 lite": 197e12, "TPU v5": 459e12, "TPU v5p": 459e12,
             "TPU v6 lite": 918e12, "cpu": None, "NVIDIA H100 NVL": None,
             "NVIDIA L40S": None, "NVIDIA GH200 480GB": None, "TPU v4 lite": None}
    assert {kind: device_peak_flops(_Device(kind)) for kind in kinds} == kinds
    assert device_peak_flops("TPU v5 lite") == 197e12  # a device_kind string
    assert device_peak_flops("TPU v4", "float32") is None  # no published fp32 peak
    with pytest.raises(ValueError, match="dtype='bf16' must be one of bfloat16"):
        device_peak_flops(h100, "bf16")
    with pytest.raises(TypeError, match="device=3 must be a jax.Device"):
        device_peak_flops(3)
