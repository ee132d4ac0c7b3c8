"""Start-up noise of JAX's CUDA plugin on machines without a GPU, filtered.

With the CUDA PJRT plugin installed (the ``gpu-aot`` extra, for deviceless GPU compiles)
and no NVIDIA driver, loading the plugin's libraries writes absl's pre-initialisation
lines (``Could not find cuda drivers on your machine, GPU will not be used.``) straight
to file descriptor 2, and, without ``JAX_PLATFORMS=cpu``, JAX logs a traceback of the
plugin's failed initialisation before it falls back to the CPU. Neither says anything a
CPU user can act on. :func:`quiet_import_jax` imports JAX (and, later, lets it discover
its plugins) with those lines removed; every other line reaches stderr unchanged. gloo,
which carries cross-process collectives on the CPU, prints a line per process and
device group when it connects: :func:`quiet_gloo` drops those from stdout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["GLOO_NOISE", "NOISE", "filtered_fd", "filtered_stderr", "quiet_gloo",
           "quiet_import_jax"]

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


@contextlib.contextmanager
def filtered_fd(fd: int, noise: tuple[re.Pattern, ...]) -> Iterator[list[str]]:
    """Captures what is written to file descriptor ``fd`` (1 or 2; C++ libraries included)
    in the body and writes it back afterwards without the lines matching ``noise``
    (whole lines).

    Yields a list that, after the body, holds the lines dropped. Does nothing where the
    descriptor cannot be duplicated."""
    stream = sys.stdout if fd == 1 else sys.stderr
    dropped: list[str] = []
    stream.flush()
    try:
        saved = os.dup(fd)
    except OSError:
        yield dropped
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), fd)
        try:
            yield dropped
        finally:
            stream.flush()
            os.dup2(saved, fd)
            os.close(saved)
            capture.seek(0)
            kept = []
            for line in capture.read().decode(errors="replace").splitlines(True):
                noisy = any(p.fullmatch(line.rstrip("\n")) for p in noise)
                (dropped if noisy else kept).append(line.rstrip("\n") if noisy else line)
            if kept:
                stream.write("".join(kept))
                stream.flush()


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
    """Drops JAX's traceback of a CUDA plugin that cannot load CUDA (no driver): JAX then
    runs on the CPU, which is what a machine without a GPU can do."""

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
    """Imports JAX with its CUDA plugin's start-up noise filtered (see the module
    docstring); a no-op for the import when JAX is already imported."""
    if "jax" not in sys.modules:
        with filtered_stderr():
            import jax  # noqa: F401
    from jax._src import xla_bridge

    _wrap_plugin_discovery(xla_bridge)
    log = logging.getLogger(xla_bridge.__name__)
    if not any(isinstance(f, _CudaPluginFallback) for f in log.filters):
        log.addFilter(_CudaPluginFallback())
