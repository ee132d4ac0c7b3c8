"""sp_jax.training.log: the JSON-lines metrics log (flushed per record, resumable) and the
loss plot."""

from __future__ import annotations

import errno
import json
import sys

import pytest

from sp_jax.training import MetricsLog, plot_losses
from sp_jax.training.log import MetricsLogError


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
