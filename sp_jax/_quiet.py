"""Start-up noise of JAX's CUDA plugin on machines without a GPU, filtered.

With the CUDA PJRT plugin installed (the ``gpu-aot`` extra, for deviceless GPU compiles)
and no accelerator, loading the plugin's libraries writes absl's pre-initialisation
lines (``Could not find cuda drivers on your machine, GPU will not be used.``) straight
to file descriptor 2, and, without ``JAX_PLATFORMS=cpu``, JAX logs a traceback of the
plugin's failed initialisation before it falls back to the CPU. Neither says anything a
CPU user can act on. :func:`quiet_import_jax` imports JAX (and, later, lets it discover
its plugins) with exactly those lines removed, and only on such a machine: with an
accelerator, or without the plugin, it changes nothing. gloo, which carries cross-process
collectives on the CPU, prints a line per process and device group when it connects:
:func:`quiet_gloo` drops those from stdout.

The filters stream: a thread forwards every other line as it is written, so nothing is
held back (a crash in the middle still shows what came before it).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["GLOO_NOISE", "NOISE", "accelerator_present", "filtered_fd", "filtered_stderr",
           "quiet_gloo", "quiet_import_jax"]

NOISE = (
    re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called are "
               r"written to STDERR"),
    re.compile(r"I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on "
               r"your machine, GPU will not be used\."),
)
"""Lines (whole) that :func:`filtered_stderr` drops."""

GLOO_NOISE = (
    re.compile(r"(?:\[Gloo\] Rank |\d+ is connected to \d+ peer ranks\. Expected number of "
               r"connected peer ranks is : \d+\s*)+"),
)
"""gloo's line per process and device group when a cross-process collective first runs on
the CPU (written to stdout by several threads at once, so whole lines and fragments)."""


def accelerator_present() -> bool:
    """Whether JAX will run on an accelerator here, decided without importing JAX:
    ``JAX_PLATFORMS`` names one other than ``cpu``, or (``JAX_PLATFORMS`` unset) the
    machine has an NVIDIA or AMD GPU or a TPU device node (``/dev/nvidia<N>``,
    ``/dev/kfd``, ``/dev/accel<N>``, ``/dev/vfio/<N>``)."""
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return any(p != "cpu" for p in platforms)
    return any(glob.glob(pattern) for pattern in ("/dev/nvidia[0-9]*", "/dev/kfd",
                                                  "/dev/accel[0-9]*", "/dev/vfio/[0-9]*"))


def _cuda_plugin_installed() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except (ImportError, ValueError):  # no jax_plugins package at all
        return False


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _forward(read_fd: int, out_fd: int, noise: tuple[re.Pattern, ...],
             dropped: list[str]) -> None:
    """Copies ``read_fd`` to ``out_fd`` line by line until EOF, keeping back (in
    ``dropped``) the lines that match ``noise`` whole."""

    def emit(raw: bytes, end: bytes) -> None:
        text = raw.decode(errors="replace")
        if any(p.fullmatch(text) for p in noise):
            dropped.append(text)
        else:
            _write_all(out_fd, raw + end)

    buffer = b""
    while True:
        try:
            chunk = os.read(read_fd, 1 << 16)
        except OSError:
            chunk = b""
        *lines, buffer = (buffer + chunk).split(b"\n")
        for raw in lines:
            emit(raw, b"\n")
        if not chunk:
            if buffer:  # the last line, without a newline
                emit(buffer, b"")
            return


@contextlib.contextmanager
def filtered_fd(fd: int, noise: tuple[re.Pattern, ...]) -> Iterator[list[str]]:
    """Lines written to file descriptor ``fd`` (1 or 2; C++ libraries included) in the
    body reach it as they come, except those matching ``noise`` (whole lines).

    Yields a list that, after the body, holds the lines dropped. Does nothing where the
    descriptor or its Python stream is unavailable."""
    stream = sys.stdout if fd == 1 else sys.stderr
    dropped: list[str] = []
    try:
        if stream is not None:
            stream.flush()
        saved = os.dup(fd)
    except (OSError, ValueError):
        yield dropped
        return
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, fd)
    os.close(write_fd)
    reader = threading.Thread(target=_forward, args=(read_fd, saved, noise, dropped),
                              name="sp_jax-output-filter", daemon=True)
    reader.start()
    try:
        yield dropped
    finally:
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os.dup2(saved, fd)  # the pipe's last writer: the reader sees its end
        reader.join(timeout=10.0)  # longer only if a child process still holds the pipe
        os.close(saved)
        if not reader.is_alive():
            os.close(read_fd)


def filtered_stderr(noise: tuple[re.Pattern, ...] = NOISE
                    ) -> contextlib.AbstractContextManager[list[str]]:
    """:func:`filtered_fd` of stderr (default: the CUDA plugin's start-up lines)."""
    return filtered_fd(2, noise)


def quiet_gloo() -> contextlib.AbstractContextManager[list[str] | None]:
    """In a multi-process run, :func:`filtered_fd` of stdout without gloo's connection
    lines (:data:`GLOO_NOISE`), around the first call of each kind of computation (when
    gloo connects each device group); a no-op in a single process."""
    import jax

    if jax.process_count() == 1:
        return contextlib.nullcontext()
    return filtered_fd(1, GLOO_NOISE)


class _CudaPluginFallback(logging.Filter):
    """Drops JAX's traceback of a CUDA plugin that cannot load CUDA on a machine without
    an accelerator: JAX then runs on the CPU, the only thing such a machine can do."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if not message.startswith("Jax plugin configuration error: Exception when calling"):
            return True
        error = record.exc_info[1] if record.exc_info else None
        return "Unable to load CUDA" not in str(error)


def _wrap_plugin_discovery(xla_bridge: Any) -> None:
    """Runs JAX's one-time plugin discovery (at backend start) with the noise filtered."""
    discover: Callable[[], None] | None = getattr(xla_bridge, "discover_pjrt_plugins", None)
    if discover is None or getattr(discover, "_sp_jax_quiet", False):
        return

    def quiet_discover() -> None:
        with filtered_stderr():
            discover()

    quiet_discover._sp_jax_quiet = True  # type: ignore[attr-defined]
    xla_bridge.discover_pjrt_plugins = quiet_discover


def quiet_import_jax() -> None:
    """Imports JAX; on a machine without an accelerator that has the CUDA plugin
    installed, with the plugin's start-up noise filtered (see the module docstring).
    Elsewhere just ``import jax``."""
    if accelerator_present() or not _cuda_plugin_installed():
        import jax  # noqa: F401

        return
    if "jax" not in sys.modules:
        with filtered_stderr():
            import jax  # noqa: F401
    from jax._src import xla_bridge

    _wrap_plugin_discovery(xla_bridge)
    log = logging.getLogger(xla_bridge.__name__)
    if not any(isinstance(f, _CudaPluginFallback) for f in log.filters):
        log.addFilter(_CudaPluginFallback())
