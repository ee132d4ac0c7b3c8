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

:class:`TensorBoardLog` writes the same records as TensorBoard scalars (``train/loss``,
``eval/loss``, ...) with tensorboardX (no TensorFlow), whole records only and visible at
once; a resumed run hides the interrupted run's later steps. :func:`device_peak_flops` and
:func:`model_flops_utilization` give the ``mfu`` field: reported only on devices whose
dense peak FLOP/s is known (:data:`PEAK_FLOPS`), None elsewhere (CPUs)::

    peak = device_peak_flops()  # one device; None on a CPU
    mfu = model_flops_utilization(tokens_per_s, 6 * n_params,
                                  None if peak is None else peak * jax.device_count())
    with TensorBoardLog("runs/gpt-tb", resume_from=start) as tb:
        tb.write({"step": 1, "loss": 5.5, "lr": 3e-4, "mfu": mfu})
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import re
import socket
import struct
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "PEAK_FLOPS",
    "MetricsLog",
    "MetricsLogError",
    "TensorBoardLog",
    "device_peak_flops",
    "model_flops_utilization",
    "plot_losses",
]


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


_TAGS = {"loss": "train/loss", "lr": "train/learning_rate", "eval_loss": "eval/loss"}


class TensorBoardLog:
    """The metrics records as TensorBoard scalars; also a context manager that closes it.

    Writes the records :class:`MetricsLog` gets (``{"step": i, "loss": ..., "lr": ...}``,
    ``{"step": i, "eval_loss": ...}``) to one new event file in ``directory``, each numeric
    field as a scalar at global step ``step``, under a stable tag (:meth:`tag`):
    ``loss`` -> ``train/loss``, ``lr`` -> ``train/learning_rate``, ``eval_loss`` ->
    ``eval/loss``, another ``eval_<name>`` -> ``eval/<name>``, any other key ->
    ``train/<key>`` (``train/tokens_per_s``, ``train/grad_norm``, ``train/update_ratio``,
    ``train/time_s``, ``train/mfu``). Non-numeric fields (strings, None, bools, arrays of
    more than one value) are skipped; ``unix_time`` (when a step ended) is the event's
    wall time. View with ``tensorboard --logdir DIRECTORY``.

    Each record is one write of whole TFRecord frames, made in the calling thread and
    visible to TensorBoard at once (not fsynced, like :class:`MetricsLog`). The events
    are tensorboardX's protocol buffers; its ``SummaryWriter`` is not used because it
    writes from a background thread: a full disk would end that thread unseen and block
    the training loop after ten more records, and two writers opened within one second
    would share (truncate) one file.

    Args:
      directory: the run's TensorBoard directory (created); None writes nothing (e.g. on
        processes other than 0 of a multi-process run), and needs no tensorboardX.
      resume_from: the step a resumed run starts after. The new event file starts with
        TensorBoard's restart marker at step ``resume_from + 1`` (tensorboardX's
        ``purge_step``), so TensorBoard hides the directory's earlier events of later
        steps (the interrupted run's steps that the resumed run redoes). 0 is a new run:
        the marker is at step 0 and hides every earlier event in the directory (none is
        deleted). TensorBoard's Python reader (``--load_fast=false``, ``EventAccumulator``)
        honours the marker; its Rust data server instead drops a series' later points
        when an earlier step of that series is written again.

    Raises:
      ImportError: ``directory`` is given and tensorboardX is not installed.
      MetricsLogError: the directory or its event file cannot be written.

    Attributes:
      directory: ``directory`` as a str (None without one).
      path: the event file this log writes (None without a directory).
    """

    def __init__(self, directory: str | os.PathLike | None, *, resume_from: int = 0):
        if isinstance(resume_from, bool) or not isinstance(resume_from, int) or resume_from < 0:
            raise ValueError(f"TensorBoardLog: resume_from={resume_from!r} must be an int >= 0 "
                             "(the step a resumed run starts after; 0 for a new run).")
        self.directory = None if directory is None else os.fspath(directory)
        self.path: str | None = None
        self._file = None
        self._last_step: int | None = None
        if self.directory is None:
            return
        try:
            import tensorboardX  # noqa: F401  (installed?)
            from tensorboardX.proto.event_pb2 import Event, SessionLog
            from tensorboardX.proto.summary_pb2 import Summary
            from tensorboardX.record_writer import masked_crc32c
        except ImportError as e:
            raise ImportError("TensorBoardLog needs tensorboardX (a dependency of sp_jax): "
                              "pip install tensorboardX") from e
        self._Event, self._Summary, self._crc = Event, Summary, masked_crc32c
        purge_step = resume_from + 1 if resume_from > 0 else 0
        header = (Event(wall_time=time.time(), file_version="brain.Event:2"),
                  Event(wall_time=time.time(), step=purge_step,
                        session_log=SessionLog(status=SessionLog.START)))
        try:
            os.makedirs(self.directory, exist_ok=True)
            self._file = self._create()
        except OSError as e:
            raise self._error(e, "creating its event file") from e
        try:
            self._append(header)
        except OSError as e:
            self.close()
            with contextlib.suppress(OSError):
                os.remove(self.path)
            raise self._error(e, "writing the header of its event file") from e

    def _create(self):
        """Opens a new event file, named like tensorboardX's (``events.out.tfevents.
        <seconds>.<host>``) plus the nanoseconds and the process id: unique, and in the
        order of creation within a second (TensorBoard reads a directory's files in name
        order, so a resumed run's restart marker comes after the events it hides)."""
        for _ in range(100):
            now = time.time_ns()
            name = (f"events.out.tfevents.{now // 10**9:010d}.{socket.gethostname()}."
                    f"{now % 10**9:09d}.{os.getpid()}")
            self.path = os.path.join(self.directory, name)
            with contextlib.suppress(FileExistsError):
                # unbuffered: each record is one write, cut back off the file if it fails
                return open(self.path, "xb", buffering=0)  # noqa: SIM115
        raise FileExistsError(f"TensorBoardLog: no new event file name in {self.directory}")

    @staticmethod
    def tag(key: str) -> str:
        """The TensorBoard tag of the record field ``key`` (see the class docstring)."""
        if key in _TAGS:
            return _TAGS[key]
        if key.startswith("eval_") and len(key) > len("eval_"):
            return f"eval/{key[len('eval_'):]}"
        return f"train/{key}"

    def _frame(self, event) -> bytes:
        """``event`` as one TFRecord: length, its masked CRC-32C, data, the data's CRC."""
        data = event.SerializeToString()
        length = struct.pack("<Q", len(data))
        return (length + struct.pack("<I", self._crc(length)) + data
                + struct.pack("<I", self._crc(data)))

    def _append(self, events) -> None:
        """Writes ``events`` whole or, on an OSError, cuts what was written back off."""
        data = memoryview(b"".join(self._frame(event) for event in events))
        start = self._file.tell()
        try:
            while data:
                data = data[self._file.write(data):]
        except OSError:
            with contextlib.suppress(OSError):  # no torn record left behind
                self._file.truncate(start)
            raise

    def _error(self, e: OSError, doing: str) -> MetricsLogError:
        kept = (f"its last complete record is of step {self._last_step}"
                if self._last_step is not None else "it holds no record of this run")
        return MetricsLogError(e.errno, f"TensorBoardLog: cannot write {self.directory} "
                                        f"({doing}): {e.strerror or e}; {kept}")

    def write(self, record: Mapping[str, Any]) -> None:
        """Writes the numeric fields of ``record`` as scalars at step ``record["step"]``.

        Raises:
          ValueError: ``record`` has no int ``step`` >= 0, or the log is closed.
          MetricsLogError: the record could not be written (nothing of it is left in the
            event file).
        """
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"TensorBoardLog: record {dict(record)!r} needs a 'step' that "
                             "is an int >= 0 (the global step of its scalars).")
        if self._file is None:
            return
        if self._file.closed:
            raise ValueError(f"TensorBoardLog: {self.directory} is closed.")
        values = [self._Summary.Value(tag=self.tag(str(key)), simple_value=value)
                  for key, value in ((k, _scalar(v)) for k, v in record.items()
                                     if k not in ("step", "unix_time"))
                  if value is not None]
        if not values:
            return
        event = self._Event(wall_time=record.get("unix_time") or time.time(), step=int(step),
                            summary=self._Summary(value=values))
        try:
            self._append([event])
        except OSError as e:
            raise self._error(e, f"a record of step {step}") from e
        self._last_step = int(step)

    def close(self) -> None:
        """Closes the event file (idempotent)."""
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scalar(value: Any) -> float | None:
    """``value`` as a float if it is one number (a Python, NumPy or JAX scalar, not a
    bool), else None."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "shape", None) == () and getattr(value, "dtype", None) is not None:
        if np.dtype(value.dtype).kind in "bcOSU":  # bool, complex, object, text
            return None
        with contextlib.suppress(TypeError, ValueError):
            return float(value)
    return None


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


PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 NVL", {}),
    ("H100 PCIe", {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12}),
    ("H100", {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12}),
    ("H200 NVL", {}),
    ("H200", {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12}),
    ("A100", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}),
    ("L4", {"bfloat16": 121e12, "float16": 121e12, "float32": 60e12}),
    ("TPU v4 lite", {}),
    ("TPU v4", {"bfloat16": 275e12}),
    ("TPU v5 lite", {"bfloat16": 197e12}),
    ("TPU v5e", {"bfloat16": 197e12}),
    ("TPU v5p", {"bfloat16": 459e12}),
    ("TPU v5", {"bfloat16": 459e12}),
    ("TPU v6 lite", {"bfloat16": 918e12}),
    ("TPU v6e", {"bfloat16": 918e12}),
)
"""Dense (not 2:4-sparse) peak FLOP/s of one device per matmul dtype, by a word of
``device_kind`` (case-insensitive; first match wins, so specific kinds come first).

NVIDIA datasheets (SXM unless named): H100 / H200 989 TFLOP/s bf16 and fp16, H100 PCIe 756,
A100 (SXM and PCIe) 312, L4 121; ``float32`` is the TF32 tensor-core peak (H100 494.5, H100
PCIe 378, A100 156, L4 60), which XLA:GPU uses for fp32 matmuls at JAX's default precision
(``jax_default_matmul_precision="highest"`` runs true fp32 at a fraction of it). Google
Cloud TPU pages, bf16 per chip: v4 275, v5e (``device_kind`` "TPU v5 lite") 197, v5p
("TPU v5") 459, v6e ("TPU v6 lite") 918; no fp32 peak is published for TPUs. Kinds with an
empty entry (NVL cards, with power limits below SXM; TPU v4 lite) are unknown rather than
guessed."""

_PEAK_DTYPES = ("bfloat16", "float16", "float32")


def device_peak_flops(device: Any = None, dtype: Any = "bfloat16") -> float | None:
    """Dense peak FLOP/s of one ``device`` for matmuls in ``dtype``, from
    :data:`PEAK_FLOPS`; None when it is not known (CPUs, unknown devices, a dtype without
    a published peak).

    Args:
      device: a ``jax.Device`` (anything with a ``device_kind``) or a ``device_kind``
        string such as ``"NVIDIA H100 80GB HBM3"``; None: ``jax.devices()[0]``.
      dtype: the matmuls' dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` (a
        string or a dtype such as ``jnp.bfloat16``).

    Raises:
      ValueError: ``dtype`` is not one of those three.
      TypeError: ``device`` has no ``device_kind``.
    """
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _PEAK_DTYPES:
        raise ValueError(f"device_peak_flops: dtype={dtype!r} must be one of "
                         f"{', '.join(_PEAK_DTYPES)} (the matmuls' dtype).")
    if device is None:
        import jax

        device = jax.devices()[0]
    kind = device if isinstance(device, str) else getattr(device, "device_kind", None)
    if not isinstance(kind, str):
        raise TypeError(f"device_peak_flops: device={device!r} must be a jax.Device or a "
                        "device_kind string (e.g. jax.devices()[0]).")
    for key, peaks in PEAK_FLOPS:
        if re.search(rf"(?<![a-z0-9]){re.escape(key.lower())}(?![a-z0-9])", kind.lower()):
            return peaks.get(name)
    return None


def model_flops_utilization(tokens_per_s: float, flops_per_token: float,
                            peak_flops: float | None) -> float | None:
    """Model FLOPs utilization (MFU): the fraction of the devices' peak FLOP/s that the
    model's own FLOPs at the measured throughput make up, ``tokens_per_s *
    flops_per_token / peak_flops``; None when the peak is not known (report MFU only
    where it is: :func:`device_peak_flops` is None on CPUs and unknown devices).

    Args:
      tokens_per_s: training throughput over all the devices, tokens per second.
      flops_per_token: model FLOPs of one token's training step, forward and backward,
        without recomputation (e.g. ``6 * matmul_params + 12 * layers * hidden * seq``,
        PaLM appendix B).
      peak_flops: the summed dense peak FLOP/s of those devices (e.g.
        ``device_peak_flops() * jax.device_count()``), or None.

    Raises:
      ValueError: a value is not a finite number, ``tokens_per_s`` is negative, or
        ``flops_per_token`` / ``peak_flops`` is not positive.
    """
    _check_number("tokens_per_s", tokens_per_s, positive=False)
    _check_number("flops_per_token", flops_per_token, positive=True)
    if peak_flops is not None:
        _check_number("peak_flops", peak_flops, positive=True)
    if peak_flops is None:
        return None
    return float(tokens_per_s) * float(flops_per_token) / float(peak_flops)


def _check_number(what: str, value: Any, *, positive: bool) -> None:
    """Raises a ValueError naming ``what`` unless ``value`` is a finite real number, > 0
    if ``positive`` else >= 0."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or (value <= 0 if positive else value < 0)):
        raise ValueError(f"model_flops_utilization: {what}={value!r} must be a finite number "
                         f"{'> 0' if positive else '>= 0'}.")
