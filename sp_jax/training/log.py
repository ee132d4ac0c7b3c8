"""Training metrics: a JSON-lines log that survives resumption, and the loss plot.

:class:`MetricsLog` writes one JSON object per line and flushes after each, so an
interrupted run leaves every record it made. Resumed from step ``k``, it keeps the earlier
records up to step ``k`` (later ones belonged to the interrupted run's steps that the
resumed run redoes) and appends. Without a path it only keeps the records in memory
(e.g. on processes other than 0 of a multi-process run)::

    with MetricsLog("runs/gpt.jsonl", resume_from=start) as log:
        log.write({"step": 1, "loss": 5.5})
    plot_losses("runs/loss.png", log.records, title="...")

:func:`plot_losses` needs matplotlib (the ``examples`` extra: ``pip install ".[examples]"`` in
a clone of sp_jax), imported on call.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["MetricsLog", "MetricsLogError", "plot_losses"]


class MetricsLogError(OSError):
    """A record could not be written (e.g. the disk is full); the file keeps every
    complete record before it, and no part of this one. ``errno`` is the failed write's;
    ``str()`` is the message alone."""

    def __str__(self) -> str:
        return str(self.args[-1])


class MetricsLog:
    """A JSON-lines metrics file; also a context manager that closes it.

    Args:
      path: the file (its directory is created); None keeps records in memory only.
      resume_from: the step a resumed run starts after; records of an existing file with
        ``step <= resume_from`` are kept, the rest dropped. 0 starts a new file. A torn
        last line (a write cut short by a kill or a full disk) is dropped with a warning;
        a bad line before the last is an error. The kept records replace the file
        atomically (a kill meanwhile leaves the old file).

    Each record is one line written whole: a write that fails (a full disk) is cut back
    off the file and raises :class:`MetricsLogError` naming the file, so only a kill in
    the middle of a write can leave a torn last line.

    Attributes:
      records: every record of the run so far, the kept ones included (dicts).
    """

    def __init__(self, path: str | os.PathLike | None, *, resume_from: int = 0):
        if isinstance(resume_from, bool) or not isinstance(resume_from, int) or resume_from < 0:
            raise ValueError(f"MetricsLog: resume_from={resume_from!r} must be an int >= 0 "
                             "(the step a resumed run starts after; 0 for a new run).")
        self.path = None if path is None else os.fspath(path)
        self.records: list[dict[str, Any]] = []
        self._file = None
        if self.path is None:
            return
        if resume_from > 0 and os.path.exists(self.path):
            with open(self.path) as fh:
                lines = [(n, line) for n, line in enumerate(fh, 1) if line.strip()]
            for n, line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    if n == lines[-1][0]:  # torn by a kill or a full disk mid-write
                        warnings.warn(f"MetricsLog: dropped the torn last line {n} of "
                                      f"{self.path} ({line[:60]!r})", stacklevel=2)
                        continue
                    raise ValueError(f"MetricsLog: line {n} of {self.path} is not JSON "
                                     f"({e}); resume with another log file.") from e
                if record.get("step", 0) <= resume_from:
                    self.records.append(record)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if self.records:  # the kept records replace the file atomically
            tmp = f"{self.path}.tmp"
            try:
                with open(tmp, "w") as fh:
                    fh.writelines(json.dumps(record) + "\n" for record in self.records)
                os.replace(tmp, self.path)
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise self._error(e, "rewriting its kept records") from e
        # unbuffered: each record is one write, cut back off the file if it fails
        self._file = open(self.path, "ab" if self.records else "wb", buffering=0)  # noqa: SIM115

    def _error(self, e: OSError, doing: str) -> MetricsLogError:
        steps = [r["step"] for r in self.records if "step" in r]
        kept = (f"its last complete record is of step {steps[-1]}" if steps
                else "it holds no complete record")
        return MetricsLogError(e.errno, f"MetricsLog: cannot write {self.path} ({doing}): "
                                        f"{e.strerror or e}; {kept}")

    def write(self, record: Mapping[str, Any]) -> None:
        """Appends ``record`` (JSON-serialisable) to the file, as one line, and to
        :attr:`records`.

        Raises:
          MetricsLogError: the line could not be written (nothing of it is left in the
            file; :attr:`records` is unchanged).
        """
        if self._file is not None and self._file.closed:
            raise ValueError(f"MetricsLog: {self.path} is closed.")
        record = dict(record)
        line = (json.dumps(record) + "\n").encode()  # not serialisable: fails here
        if self._file is not None:
            start = self._file.tell()
            try:
                view = memoryview(line)
                while view:
                    view = view[self._file.write(view):]
            except OSError as e:
                with contextlib.suppress(OSError):  # no torn line left behind
                    self._file.truncate(start)
                raise self._error(e, f"a record of step {record.get('step', '?')}") from e
        self.records.append(record)

    def close(self) -> None:
        """Closes the file (idempotent); :attr:`records` stay readable."""
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plot_losses(path: str | os.PathLike, records: Sequence[Mapping[str, Any]],
                title: str = "", *, ylabel: str = "loss", smooth: int = 20) -> None:
    """Writes the loss curve of ``records`` to the image ``path`` (PNG by its suffix).

    Records with ``loss`` are drawn faintly with their ``smooth``-step running mean on
    top; records with ``eval_loss`` as points joined by a line. ``step`` is the x axis,
    ``ylabel`` labels the y axis.

    Raises:
      ImportError: matplotlib is not installed (the ``examples`` extra).
    """
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plot_losses needs matplotlib: pip install matplotlib (the "
                          "examples extra, pip install '.[examples]' in a clone of sp_jax)"
                          ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    try:
        if train:
            steps, losses = (np.asarray(v) for v in zip(*train, strict=True))
            ax.plot(steps, losses, lw=0.8, alpha=0.35, color="C0")
            k = max(1, min(smooth, len(losses)))
            mean = np.convolve(losses, np.ones(k) / k, mode="valid")
            ax.plot(steps[k - 1:], mean, lw=1.5, color="C0",
                    label=f"train loss ({k}-step mean)" if k > 1 else "train loss")
        if evals:
            ax.plot(*zip(*evals, strict=True), "o-", ms=4, color="C1",
                    label="held-out loss")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if train or evals:
            ax.legend()
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
