"""Faults of a training run: signals, peers that disagree, die or stall, and a diverging loss.

Every piece is small and explicit, for a training loop to use (:class:`sp_jax.training.Trainer`
uses all of them):

* :class:`StopSignals`: SIGTERM / SIGINT (preemption, ``scancel``, Ctrl-C) become a request
  to stop at a step boundary; a second signal ends the process at once, even while it is
  blocked in a collective.
* :func:`agree_to_stop`: every process of a multi-process run stops after the *same* step
  (one of them may be the only one signalled), agreed through the ``jax.distributed``
  coordination service's key-value store, without device collectives.
* :func:`check_same_settings`: before the first step, every process checks that the others
  run with the same settings (model, optimizer, data, seed, steps, mesh, ...) and all end
  with :class:`SettingsMismatchError` naming the differing setting, instead of hanging in
  mismatched collectives.
* :func:`exit_on_peer_failure`: a collective that fails because a peer died ends the
  process at once with one line and :data:`EXIT_PEER_FAILED`.
* :class:`Watchdog`: ends the process with :data:`EXIT_PEER_FAILED` when a blocking call
  (a step, an evaluation, a save) makes no progress for a bounded time: a stalled or dead
  peer. A missing one is caught by the watchdog around ``jax.distributed.initialize``
  (:meth:`sp_jax.training.Launch.initialize`, ``--peer-timeout``), whose timeouts for
  JAX's own coordination service are set to come after every watchdog.
* :class:`Heartbeats`: each process's sign of life in the coordination service's
  key-value store, so that those two lines name the process that stalled or died.
* :class:`DivergenceGuard`: a loss that is not finite or spikes far above its recent median
  ends the run before the diverged parameters are saved (see its docstring for the
  known-good checkpoint rule).

Exit statuses (:attr:`sp_jax.training.TrainingStopped.status`, the examples' exit
statuses, documented in ``docs/errors.md``): :data:`EXIT_ERROR` 1,
:data:`EXIT_USAGE` 2, :data:`EXIT_DIVERGED` 3, :data:`EXIT_PEER_FAILED` 4,
:data:`EXIT_INTERRUPTED` 75 (``EX_TEMPFAIL``: stopped by a signal after writing a
checkpoint; rerun with ``--resume``); a second signal: 128 + its number.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import jax

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_PEER_FAILED",
    "EXIT_USAGE",
    "DivergenceGuard",
    "Heartbeats",
    "PeerTimeoutError",
    "SettingsMismatchError",
    "StopSignals",
    "Watchdog",
    "agree_to_stop",
    "announce_failure",
    "check_same_settings",
    "exit_on_peer_failure",
    "leave",
]

EXIT_ERROR = 1
"""A run error (bad data, an unusable checkpoint, a failed save, ...)."""
EXIT_USAGE = 2
"""Bad command-line flags (argparse's status)."""
EXIT_DIVERGED = 3
"""The loss diverged; nothing diverged was saved: resume from the last checkpoint with a
lower learning rate."""
EXIT_PEER_FAILED = 4
"""Another process disagreed on the settings, did not start, died or stalled."""
EXIT_INTERRUPTED = 75
"""Stopped by SIGTERM / SIGINT at an agreed step after writing a checkpoint (when a
checkpoint directory was given): continue with ``--resume``."""

_KEY = "sp_jax/faults"


class SettingsMismatchError(ValueError):
    """Processes of one run were started with different settings.

    Attributes:
      differences: ``{setting: {process_index: value}}`` for every setting that differs.
    """

    def __init__(self, message: str, differences: dict[str, dict[int, Any]]):
        super().__init__(message)
        self.differences = differences


class PeerTimeoutError(RuntimeError):
    """Other processes did not answer within the timeout (not started, dead or stalled).

    Attributes:
      missing: the process indices that did not answer.
    """

    def __init__(self, message: str, missing: Sequence[int]):
        super().__init__(message)
        self.missing = tuple(missing)


def _client() -> Any:
    """The ``jax.distributed`` coordination-service client (its key-value store)."""
    from jax._src import distributed  # the client has no public accessor in jax 0.10

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised: call "
                           "sp_jax.training.Launch.initialize() (or "
                           "jax.distributed.initialize()) first")
    return client


def check_same_settings(settings: Mapping[str, Any], *, timeout_s: float = 120.0,
                        tag: str = "settings") -> None:
    """Checks that every process of the run was given the same ``settings``.

    Each process publishes its settings (JSON) in the coordination service's key-value
    store and reads everyone else's, waiting at most ``timeout_s`` for a process that has
    not published yet. Nothing happens in a single-process run.

    Args:
      settings: ``{name: value}``, JSON-serialisable: what must be identical on every
        process (e.g. the command-line flags without the per-process ones such as
        ``--process-id``).
      timeout_s: how long to wait for the other processes' settings.
      tag: distinguishes several checks within one run (each needs its own tag).
    Raises:
      SettingsMismatchError: (a ``ValueError``) some setting differs; the message names
        each differing setting with every process's value.
      PeerTimeoutError: a process did not publish its settings within ``timeout_s``.
    """
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return
    client = _client()
    mine = json.dumps(dict(settings), sort_keys=True, default=str)
    client.key_value_set(f"{_KEY}/{tag}/{me}", mine)
    everyone, deadline = {me: json.loads(mine)}, time.monotonic() + timeout_s
    for other in range(n):
        if other == me:
            continue
        left_ms = max(int((deadline - time.monotonic()) * 1000), 1)
        try:
            everyone[other] = json.loads(client.blocking_key_value_get(
                f"{_KEY}/{tag}/{other}", left_ms))
        except Exception:  # noqa: BLE001 - the client raises a generic error on timeout
            missing = [p for p in range(n) if p not in everyone]
            raise PeerTimeoutError(
                f"process(es) {missing} did not report their settings within "
                f"{timeout_s:g} s: not started, dead or stalled (--peer-timeout)",
                missing) from None
    names = sorted({k for s in everyone.values() for k in s})
    absent = "<absent>"
    differences = {
        name: {p: everyone[p].get(name, absent) for p in sorted(everyone)}
        for name in names if len({json.dumps(s.get(name, absent), sort_keys=True)
                                  for s in everyone.values()}) > 1}
    if differences:
        listed = "; ".join(
            f"{name}: " + ", ".join(f"process {p} {v!r}" for p, v in values.items())
            for name, values in differences.items())
        raise SettingsMismatchError(
            f"the {n} processes were started with different settings ({listed}); start "
            "every process with the same flags", differences)


def agree_to_stop(step: int, requested: bool) -> bool:
    """Whether to stop after ``step``, the same answer on every process.

    Call it at every step boundary (after step ``step`` finished) on every process. A
    process that wants to stop (``requested``, e.g. :attr:`StopSignals.received`)
    proposes to stop after the next step, ``step + 1``: no process can be further than
    that, since each step waits for every process in its collectives. The first proposal
    wins (the key-value store refuses to overwrite it), so processes signalled at
    different steps still agree. A single-process run stops at once.

    Args:
      step: the step just finished on this process.
      requested: whether this process wants to stop.
    Returns:
      True when every process stops after this step.
    """
    if jax.process_count() == 1:
        return requested
    client = _client()
    key = f"{_KEY}/stop_after"
    if requested:
        with contextlib.suppress(Exception):  # another process proposed first
            client.key_value_set(key, str(step + 1))
    try:
        agreed = int(client.key_value_try_get(key))
    except Exception:  # noqa: BLE001 - NOT_FOUND: nobody asked to stop
        return False
    return step >= agreed


def leave(status: int, *, wait_s: float = 10.0, gone: Sequence[int] = (),
          coordinate: bool = True) -> NoReturn:
    """Ends this process at once with ``status`` (``os._exit`` after flushing stdout and
    stderr), also while other threads are blocked in collectives.

    In a multi-process run process 0 hosts JAX's coordination service, and jaxlib aborts
    every process still connected to it (SIGABRT, a C++ stack trace) the moment it goes.
    So the other processes record their leaving in its key-value store first (at most
    1 s: it may be the stalled one), and process 0 leaves last: when every other process
    has left, or after ``wait_s`` (the others are dead, stalled, or still to be ended by
    their own watchdog or :class:`Heartbeats`).

    Args:
      status: the exit status.
      wait_s: how long process 0 waits for the others.
      gone: processes known to be stalled or dead (:attr:`Heartbeats.gone`): process 0
        does not wait for them.
      coordinate: False before ``jax.distributed`` is connected (while it starts): leave
        at once.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if coordinate and jax.process_count() > 1:
        with contextlib.suppress(Exception):
            me, n, client = jax.process_index(), jax.process_count(), _client()
            if me:
                _bounded(lambda: client.key_value_set(f"{_KEY}/left/{me}", str(status)), 1.0)
            else:
                deadline, waiting = time.monotonic() + wait_s, set(range(1, n)) - set(gone)
                while waiting and time.monotonic() < deadline:
                    left = _bounded(lambda: client.key_value_dir_get(f"{_KEY}/left/"), 1.0)
                    waiting -= {int(key.rsplit("/", 1)[1]) for key, _ in left or ()}
                    if waiting:
                        time.sleep(0.2)
    os._exit(status)


def announce_failure(message: str) -> None:
    """Announces that this process stops with an error of its own (the first line of
    ``message``): the other processes' :class:`Heartbeats` end them within an interval,
    each with one line naming it, instead of waiting for this one in their next
    collective. The caller then leaves without JAX's final barrier (:func:`leave`, e.g.
    by :meth:`Launch.end <sp_jax.training.Launch.end>`). The first announcement of a run
    is kept; nothing happens in a single-process run."""
    if jax.process_count() == 1:
        return
    first = message.strip().splitlines()[0] if message.strip() else "an error"
    me = jax.process_index()
    _bounded(lambda: _client().key_value_set(f"{_KEY}/failed", f"process {me} failed: "
                                                                f"{first}"), 1.0)


def _bounded(call: Callable[[], Any], timeout_s: float) -> Any:
    """``call()``'s result, or None when it fails or takes longer than ``timeout_s`` (a
    stalled coordination service; the call is left running in a daemon thread)."""
    answer: list[Any] = []

    def run() -> None:
        with contextlib.suppress(Exception):
            answer.append(call())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return answer[0] if answer else None


def _wait_s(heartbeats: Heartbeats | None) -> float:
    """How long process 0 waits for the others after a fault: long enough for their
    heartbeat threads to be told (:meth:`Heartbeats.fail`) and leave."""
    return 5.0 + (2 * heartbeats.interval_s if heartbeats is not None else 0.0)


@contextlib.contextmanager
def exit_on_peer_failure(stream: Any = None, *, heartbeats: Heartbeats | None = None,
                         activity: Callable[[], str] | None = None) -> Iterator[None]:
    """Ends a multi-process run at once when a cross-process collective fails in the body.

    When a peer dies, the collectives waiting for it fail (gloo on CPU: "Connection reset
    by peer") or hang (NCCL: a :class:`Watchdog` ends them). A failure would otherwise
    unwind into a traceback, and the exit would then wait for the dead peer at
    jax.distributed's shutdown barrier. Here it prints one line naming the failure (and,
    with ``heartbeats``, the process that died, about two heartbeat intervals later) and
    leaves with ``os._exit(EXIT_PEER_FAILED)``. In a single-process run the error
    propagates unchanged.

    Args:
      stream: where the line goes (default ``sys.stderr``).
      heartbeats: started :class:`Heartbeats`, to name the dead process.
      activity: says what this process was doing (e.g. :attr:`Watchdog.activity`:
        ``"step 12"``), for the line.
    """
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        culprit = heartbeats.culprits() if heartbeats is not None else ""
        doing = f"{activity()}: " if activity is not None else ""
        print(f"error: process {jax.process_index()}: {doing}a collective with the other "
              f"processes failed ({first}): "
              f"{culprit or 'another process died or lost its connection'}; exiting with "
              f"status {EXIT_PEER_FAILED}", file=stream or sys.stderr, flush=True)
        leave(EXIT_PEER_FAILED, wait_s=_wait_s(heartbeats),
              gone=heartbeats.gone if heartbeats is not None else ())


class StopSignals:
    """Turns SIGTERM and SIGINT into a request to stop at the next step boundary.

    Use it as a context manager around the training loop (from the main thread); poll
    :attr:`received`. The first signal prints one line and sets :attr:`received`; a second
    one prints one line and ends the process at once with status ``128 + signal`` (a
    helper thread watches the signals, so this works even while the main thread is
    blocked in a device call or a collective, where Python signal handlers do not run).

    A SIGTERM repeated within ``repeat_window_s`` of the first is the same request, not
    the second one: a scheduler may deliver one stop twice (SLURM signals a job's steps
    and, with ``--full``, every process of the job, and a batch script that passes its
    own TERM on adds one more); a SIGINT repeated (Ctrl-C twice) always exits.

    Args:
      signals: the signals to catch (default SIGTERM and SIGINT).
      stream: where the lines go (default ``sys.stderr``).
      repeat_window_s: seconds after a first SIGTERM in which another is ignored.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
                 stream: Any = None, repeat_window_s: float = 10.0):
        self.signals = tuple(signals)
        self.stream = stream
        self.repeat_window_s = float(repeat_window_s)
        self._first_term: float | None = None
        self.received: str | None = None
        self._old: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._old_fd = -1

    def _say(self, message: str) -> None:
        stream = self.stream or sys.stderr
        print(message, file=stream, flush=True)

    def _watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 1)
            except OSError:
                return
            if not data:
                return
            signum = data[0]
            if signum not in self.signals:
                continue
            name = signal.Signals(signum).name
            now = time.monotonic()
            if self.received is not None:
                if (signum == signal.SIGTERM and self._first_term is not None
                        and now - self._first_term < self.repeat_window_s):
                    continue  # the same request, delivered twice (see the class doc)
                self._say(f"{name} again: exiting now (status {128 + signum}), no checkpoint")
                os._exit(128 + signum)
            self.received = name
            if signum == signal.SIGTERM:
                self._first_term = now
            self._say(f"{name} received: stopping after the current step (with a "
                      "checkpoint when --ckpt-dir is set); send it again to exit at once")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignals must be entered from the main thread")
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        # The C-level handler writes each signal's number to the pipe the moment it
        # arrives; the Python-level handler (which may run much later) does nothing.
        self._old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        for signum in self.signals:
            self._old[signum] = signal.signal(signum, lambda *_: None)
        threading.Thread(target=self._watch, args=(read,), name="sp_jax-signals",
                         daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._old_fd)
        if self._pipe is not None:
            os.close(self._pipe[1])  # ends the watcher thread
            self._pipe = None


class Heartbeats:
    """A sign of life of every process, to name the one that holds a multi-process run up.

    A background thread of each process writes a counter and what the process is doing
    (e.g. ``"step 12"``) to the ``jax.distributed`` coordination service's key-value
    store every ``interval_s`` seconds. When a collective fails or a watched call makes
    no progress, :meth:`culprits` reads everyone's counter twice, two intervals apart: a
    process whose counter stood still is stalled (stopped, swapped out) or dead. No clock
    is compared between hosts. Process 0 hosts the coordination service: when it is the
    stalled one, the store does not answer, and that names it.

    The same thread ends this process (one line, :data:`EXIT_PEER_FAILED`) within an
    interval when another one announced (:meth:`fail`, :func:`announce_failure`) that it
    stops with an error of its own (e.g. a full disk under its log): otherwise this one
    would wait for it in the next collective until the watchdog's limit.

    Args:
      interval_s: seconds between two writes (default 5; the first write is at
        :meth:`start`).

    Attributes:
      gone: the processes :meth:`culprits` found stalled or dead (:func:`leave` does not
        wait for them).
    """

    def __init__(self, interval_s: float = 5.0):
        if not interval_s > 0:
            raise ValueError(f"Heartbeats: interval_s={interval_s!r} must be positive")
        self.interval_s = float(interval_s)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._done = threading.Event()
        self.gone: set[int] = set()

    @staticmethod
    def interval_for(timeout_s: float) -> float:
        """The interval for a watchdog of ``timeout_s``: an eighth of it, within 0.5 to
        5 s (naming a culprit then takes at most ``2 x interval + 0.5`` s more)."""
        return min(5.0, max(0.5, timeout_s / 8))

    def start(self, activity: Callable[[], str]) -> None:
        """Starts writing (once; nothing in a single-process run); ``activity()`` says
        what this process is doing at each write."""
        if self._thread is not None or jax.process_count() == 1:
            return
        me = jax.process_index()
        client, key = _client(), f"{_KEY}/alive/{me}"

        def beat() -> None:
            count = 0
            while not self._done.is_set():
                with contextlib.suppress(Exception):  # a stalled coordinator: blocks here
                    client.key_value_set(key, json.dumps({"n": count, "at": activity()}),
                                         allow_overwrite=True)
                failed = None
                with contextlib.suppress(Exception):  # NOT_FOUND: nobody failed
                    failed = client.key_value_try_get(f"{_KEY}/failed")
                if failed and not self._stopping and not failed.startswith(f"process {me} "):
                    print(f"error: process {me}: {activity()}: stopping because {failed}; "
                          f"exiting with status {EXIT_PEER_FAILED}", file=sys.stderr,
                          flush=True)
                    leave(EXIT_PEER_FAILED, wait_s=_wait_s(self), gone=self.gone)
                count += 1
                self._done.wait(self.interval_s)

        self._thread = threading.Thread(target=beat, name="sp_jax-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the writes and waits (up to ``timeout_s``) for the thread: before the
        final barrier and the process's exit, a write still in the coordination client
        when the interpreter finalizes would abort the process ("FATAL: exception not
        rethrown")."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def fail(self, message: str) -> None:
        """:func:`announce_failure` of ``message`` by this process, whose own heartbeat
        thread then does not end it for that (nothing in a single-process run)."""
        if self._thread is None:
            return
        self._stopping = True
        announce_failure(message)

    def _read(self, timeout_s: float) -> dict[int, dict[str, Any]] | None:
        """Everyone's last write, or None when the store does not answer in time."""
        answer = _bounded(lambda: _client().key_value_dir_get(f"{_KEY}/alive/"), timeout_s)
        if answer is None:
            return None
        beats = {}
        for key, value in answer:
            with contextlib.suppress(ValueError):
                beats[int(key.rsplit("/", 1)[1])] = json.loads(value)
        return beats

    def culprits(self) -> str:
        """Which processes stopped answering, as a clause for a message, e.g. ``"process
        1 stopped answering (last seen in step 12): it is stalled or dead"``. Takes about
        two intervals (a single-process run, or one that never started: ``""``)."""
        if self._thread is None:
            return ""
        me, wait = jax.process_index(), 2 * self.interval_s + 0.5
        first = self._read(timeout_s=3.0)
        if first is None:
            self.gone.add(0)
            return ("process 0, which hosts the coordination service, does not answer: it "
                    "is stalled or dead")
        time.sleep(wait)
        second = self._read(timeout_s=3.0) or {}
        still = sorted(p for p in range(jax.process_count()) if p != me and (
            p not in first or second.get(p, {}).get("n") == first[p].get("n")))
        self.gone.update(still)
        if still:
            seen = ", ".join(f"process {p}" + (f" (last seen in {first[p]['at']})"
                                               if p in first else " (never seen)")
                             for p in still)
            return (f"{seen} stopped answering: "
                    f"{'it is' if len(still) == 1 else 'they are'} stalled or dead")
        doing = "; ".join(f"process {p} in {second[p]['at']}" for p in sorted(second)
                          if p != me and p in second)
        return (f"every process still answers ({doing}): one is stuck (a hung collective, "
                "slow storage)")


class Watchdog:
    """Ends the process when a blocking call makes no progress for too long.

    A multi-process step waits in collectives for every other process: a peer that is
    alive but stuck would hold everyone forever. Wrap each blocking call in :meth:`watch`;
    when one runs longer than its limit, the watchdog prints one line naming it (and,
    with ``heartbeats``, the process that holds it up) and ends the process with
    :func:`leave` (:data:`EXIT_PEER_FAILED`; ``sys.exit`` cannot interrupt a thread
    blocked in a collective).

    Args:
      timeout_s: the limit of a watched call; ``None`` or ``<= 0`` disables the watchdog.
      name: prefixes the line, e.g. ``"process 1"``.
      stream: where the line goes (default ``sys.stderr``).
      heartbeats: started :class:`Heartbeats` to name the culprit with (the exit then
        comes up to ``2 x heartbeats.interval_s + 0.5`` s after the limit).
      coordinate: False for a watchdog around ``jax.distributed.initialize`` (no
        coordination service to leave through yet, :func:`leave`).
    """

    def __init__(self, timeout_s: float | None, *, name: str | None = None,
                 stream: Any = None, heartbeats: Heartbeats | None = None,
                 coordinate: bool = True):
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.name = name
        self.stream = stream
        self.heartbeats = heartbeats
        self.coordinate = coordinate
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._what = ""
        self._extra = 0.0
        self._thread: threading.Thread | None = None

    @property
    def last(self) -> str:
        """The name of the watched call, or of the last one (``""`` before the first)."""
        with self._lock:
            return self._what

    @property
    def activity(self) -> str:
        """What this process is doing: the watched call, or ``"after <the last one>"``
        between calls (for :meth:`Heartbeats.start`)."""
        with self._lock:
            return self._what if self._deadline is not None else f"after {self._what or 'start'}"

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                deadline, what = self._deadline, self._what
            if deadline is not None and time.monotonic() > deadline:
                who = f"{self.name}: " if self.name else ""
                culprit = self.heartbeats.culprits() if self.heartbeats else ""
                print(f"error: {who}{what} made no progress for "
                      f"{self.timeout_s + self._extra:g} s: "
                      f"{culprit or 'another process is stalled, dead or was never started'}"
                      f" (--peer-timeout); exiting with status {EXIT_PEER_FAILED}",
                      file=self.stream or sys.stderr, flush=True)
                leave(EXIT_PEER_FAILED, wait_s=_wait_s(self.heartbeats),
                      gone=self.heartbeats.gone if self.heartbeats else (),
                      coordinate=self.coordinate)

    @contextlib.contextmanager
    def watch(self, what: str, *, extra_s: float = 0.0) -> Iterator[None]:
        """Watches the body: ``what`` names it in the message (e.g. ``"step 12"``);
        ``extra_s`` extends this call's limit (e.g. for a first call that compiles)."""
        if self.timeout_s is None:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sp_jax-watchdog",
                                            daemon=True)
            self._thread.start()
        with self._lock:
            self._deadline, self._what = time.monotonic() + self.timeout_s + extra_s, what
            self._extra = extra_s
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None


class DivergenceGuard:
    """Decides when training has diverged, so that nothing diverged is ever saved.

    A loss has diverged when it is not finite, or (once ``min_history`` losses were seen)
    when it exceeds ``spike`` times the median of the last ``window`` training losses; an
    optimizer step has, when its update is larger than ``max_update_ratio`` times the
    parameters it was applied to (global L2 norms; healthy steps move the weights by
    ~1e-3 of their norm, a blown-up one by orders of magnitude more, and can leave a model
    whose loss still looks fine: e.g. collapsed to the uniform distribution). The
    known-good checkpoint rule built on it: a checkpoint of the parameters after step *i*
    is written only after *those* parameters gave a finite, non-spiking held-out loss
    (:meth:`check` on an evaluation right before the save), so every checkpoint on disk
    was good when it was written, and ``max_to_keep`` rotation can only ever drop older
    good ones. A run that diverges stops without saving; resuming from the last checkpoint
    with a lower learning rate starts from parameters that were good.

    Args:
      spike: the factor over the recent median that counts as divergence; ``0`` or
        ``None`` checks finiteness only.
      max_update_ratio: the largest update-to-weight norm ratio of a step; ``0`` or
        ``None``: no limit.
      window: how many recent training losses the median is taken over.
      min_history: how many losses must have been seen before spikes are checked (until
        then, finiteness only). A resumed run can :meth:`record` the losses logged before
        its checkpoint so that its first steps are checked too.
    """

    def __init__(self, spike: float | None = 3.0, *, max_update_ratio: float | None = 1.0,
                 window: int = 20, min_history: int = 1):
        if spike is not None and (not math.isfinite(spike) or spike < 0):
            raise ValueError(f"spike={spike!r}: use a factor > 1 (e.g. 3.0), or 0 to check "
                             "finiteness only")
        if spike and spike <= 1:
            raise ValueError(f"spike={spike!r} would flag ordinary noise as divergence: use a"
                             " factor > 1 (e.g. 3.0), or 0 to check finiteness only")
        if max_update_ratio is not None and not max_update_ratio >= 0:
            raise ValueError(f"max_update_ratio={max_update_ratio!r}: use a ratio > 0 (e.g. "
                             "1.0), or 0 for no limit")
        self.spike = spike or None
        self.max_update_ratio = max_update_ratio or None
        self.min_history = min_history
        self.recent: deque[float] = deque(maxlen=window)

    def check(self, loss: float, what: str = "loss") -> str | None:
        """None when ``loss`` is fine, else the reason it counts as diverged (one line).
        Does not record ``loss``: call :meth:`record` for training losses."""
        if not math.isfinite(loss):
            return f"{what} is {loss}"
        if self.spike and len(self.recent) >= self.min_history:
            median = sorted(self.recent)[len(self.recent) // 2]
            if loss > self.spike * median:
                return (f"{what} {loss:.4g} is over {self.spike:g}x the median of the last "
                        f"{len(self.recent)} training losses ({median:.4g})")
        return None

    def check_update(self, update_norm: float, param_norm: float) -> str | None:
        """None when a step's update is within ``max_update_ratio`` of the parameters'
        norm, else the reason it counts as diverged (one line)."""
        if self.max_update_ratio and update_norm > self.max_update_ratio * param_norm:
            return (f"the update's norm {update_norm:.3g} is over {self.max_update_ratio:g}x "
                    f"the parameters' norm {param_norm:.3g}")
        return None

    def record(self, loss: float) -> None:
        """Adds a (checked) training loss to the recent history."""
        self.recent.append(float(loss))
