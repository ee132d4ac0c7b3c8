"""Start-up noise of JAX's CUDA plugin on machines without a GPU, filtered.

With the CUDA PJRT plugin installed (the ``gpu-aot`` extra, for deviceless GPU compiles)
and no NVIDIA driver, loading the plugin's libraries writes absl's pre-initialisation
lines (``Could not find cuda drivers on your machine, GPU will not be used.``) straight
to file descriptor 2, and, without ``JAX_PLATFORMS=cpu``, JAX logs a traceback of the
plugin's failed initialisation before it falls back to the CPU. Neither says anything a
CPU user can act on. :func:`quiet_import_jax` imports JAX (and, later, lets it discover
its plugins) with those lines removed; every other line reaches stderr unchanged.
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

__all__ = ["NOISE", "filtered_stderr", "quiet_import_jax"]

NOISE = (
    re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called are "
               r"written to STDERR"),
    re.compile(r"I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on "
               r"your machine, GPU will not be used\."),
)
"""Lines (whole) that :func:`filtered_stderr` drops."""


@contextlib.contextmanager
def filtered_stderr(noise: tuple[re.Pattern, ...] = NOISE) -> Iterator[list[str]]:
    """Captures what is written to file descriptor 2 (C++ libraries included) in the body
    and writes it back afterwards without the lines matching ``noise`` (whole lines).

    Yields a list that, after the body, holds the lines dropped. Does nothing where fd 2
    cannot be duplicated."""
    dropped: list[str] = []
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield dropped
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield dropped
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = []
            for line in capture.read().decode(errors="replace").splitlines(True):
                noisy = any(p.fullmatch(line.rstrip("\n")) for p in noise)
                (dropped if noisy else kept).append(line.rstrip("\n") if noisy else line)
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


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
