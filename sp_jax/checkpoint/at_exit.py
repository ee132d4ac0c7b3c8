"""Saves in flight at interpreter exit: an ``async_save=True`` manager that still has a
save in flight when the program ends without ``close()`` is waited for before the
interpreter shuts down, with one line to stderr saying whether the step was committed."""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["IN_FLIGHT", "register_exit_hook"]

# async saves not waited for yet: {manager (kept alive): what waits for its save at exit}
IN_FLIGHT: dict[Any, Callable[[], None]] = {}
_HOOK = threading.Lock()
_hooked = False


def register_exit_hook() -> None:
    """Registers :func:`_finish_at_exit`, once per process."""
    global _hooked
    with _HOOK:
        if _hooked:
            return
        # threading runs its exit hooks in reverse order, while threads and executors
        # still work (atexit would be too late: orbax needs concurrent.futures, which
        # refuses new work once its own hook has run). concurrent.futures registers that
        # hook on import: imported first, it runs after ours.
        import concurrent.futures.thread  # noqa: F401

        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("threading._register_atexit is missing")
            register(_finish_at_exit)
        except RuntimeError:
            atexit.register(_finish_at_exit)  # late: saves may not finish then
        _hooked = True


def _finish_at_exit() -> None:
    """At interpreter exit: waits for the saves still in flight of managers that were
    never closed (one line each to stderr)."""
    for manager, wait in list(IN_FLIGHT.items()):
        try:
            wait()
        except Exception as e:  # noqa: BLE001 - never block the exit
            print(f"sp_jax.checkpoint: at exit, {manager.directory}: {type(e).__name__}: "
                  f"{e}", file=sys.stderr, flush=True)
