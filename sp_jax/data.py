"""A byte-level text corpus and the global batches it feeds a sharded model.

:class:`ByteCorpus` reads text files (globs or paths; by default the running Python's
standard library, ``**/*.py`` outside site-/dist-packages, no download), sorted and
concatenated up to ``max_bytes``, and splits the byte stream deterministically: the last
``held_out_fraction`` (5%) is held out. Sequences are windows of ``seq_len + 1`` bytes:
``tokens`` are the first ``seq_len``, ``labels`` the last ``seq_len`` (the next byte).

* Training windows are drawn per optimizer step from a generator seeded by
  ``(seed, step)``: the data of a step is a pure function of its number, so a run resumed
  at step ``k`` sees exactly the batches the interrupted run would have.
* Held-out windows are fixed: evenly spaced over the held-out bytes.

Batches are global ``jax.Array`` s assembled across processes: every process computes the
same window offsets, then reads and uploads only the rows its own devices hold
(:func:`rows_held` + :func:`assemble`, via ``jax.make_array_from_callback``). Their
shardings come from the layout vocabulary, e.g. for a model built with ``parallel``::

    layout = sp_jax.Layout.of(parallel)
    train_sharding = NamedSharding(mesh, layout.spec(None, "batch", "length"))  # [M, B, S]
    eval_sharding = NamedSharding(mesh, layout.tokens)                          # [B, S]
    corpus = ByteCorpus.from_files(["data/**/*.txt"], seq_len=128)
    batch = corpus.train_batch(step, seed=0, batch_size=16, micro_batches=2,
                               sharding=train_sharding)   # {"tokens", "labels"} [2, 8, 128]
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig
from collections.abc import Sequence

import jax
import numpy as np

__all__ = ["ByteCorpus", "assemble", "default_patterns", "rows_held"]

Batch = dict[str, jax.Array]


def default_patterns() -> list[str]:
    """The running Python's standard library sources: ``<stdlib>/**/*.py``."""
    return [os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")]


def _positive_int(where: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{where}: {name}={value!r} must be a positive int.")
    return int(value)


def rows_held(sharding: jax.sharding.Sharding, shape: tuple[int, ...], axis: int
              ) -> np.ndarray:
    """Sorted indices along ``axis`` of a global array of ``shape`` that this process's
    devices hold under ``sharding`` (all of them in a single-process run), int64."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[axis].indices(shape[axis])))
    return np.asarray(sorted(rows), dtype=np.int64)


def assemble(local: np.ndarray, rows: np.ndarray, *, shape: tuple[int, ...],
             sharding: jax.sharding.Sharding, axis: int) -> jax.Array:
    """The global ``jax.Array`` of ``shape`` and ``sharding`` from this process's part.

    Every process calls it with its own part: ``local`` holds the global rows ``rows``
    (from :func:`rows_held`) along ``axis`` and the full extent of every other dimension;
    each device's shard is cut from its own process's rows.

    Raises:
      ValueError: ``local`` does not have ``len(rows)`` rows and the other dimensions of
        ``shape``.
    """
    want = tuple(len(rows) if d == axis else n for d, n in enumerate(shape))
    if tuple(local.shape) != want:
        raise ValueError(f"assemble: local part of shape {tuple(local.shape)}, expected "
                         f"{want} ({len(rows)} rows along axis {axis} of {shape}).")
    position = {int(r): k for k, r in enumerate(rows)}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        index = list(index)
        index[axis] = [position[r] for r in range(*index[axis].indices(shape[axis]))]
        return local[tuple(index)]

    return jax.make_array_from_callback(shape, sharding, shard)


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
    """Bytes split into a training and a held-out stream, read as windows of
    ``seq_len + 1`` bytes (token ids 0..255).

    Build it with :meth:`from_files` or :meth:`from_bytes`; both check there is room for
    at least one window in each stream.

    Attributes:
      train: uint8 ``[n_train]``, the first ``1 - held_out_fraction`` of the bytes.
      held_out: uint8 ``[n_held_out]``, the rest.
      seq_len: tokens per sequence.
      files: how many files the bytes came from.
      source: what was read (the patterns), for messages.
    """

    train: np.ndarray
    held_out: np.ndarray
    seq_len: int
    files: int = 1
    source: str = "bytes"

    def __post_init__(self) -> None:
        _positive_int("ByteCorpus", "seq_len", self.seq_len)
        for name in ("train", "held_out"):
            stream = getattr(self, name)
            if not isinstance(stream, np.ndarray) or stream.dtype != np.uint8 or stream.ndim != 1:
                raise TypeError(f"ByteCorpus: {name} must be a 1-D uint8 numpy array, got "
                                f"{type(stream).__name__} {getattr(stream, 'dtype', '')}.")
        if min(len(self.train), len(self.held_out)) <= self.seq_len + 1:
            raise ValueError(
                f"{len(self.train) + len(self.held_out)} bytes of text ({self.source}) are "
                f"too few for seq_len {self.seq_len} (train {len(self.train)}, held-out "
                f"{len(self.held_out)}; each needs more than seq_len + 1): use more data or "
                "a shorter sequence.")

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | np.ndarray, *, seq_len: int,
                   held_out_fraction: float = 0.05, files: int = 1,
                   source: str = "bytes") -> ByteCorpus:
        """Splits ``data`` (bytes, or a 1-D uint8 array) deterministically: the last
        ``held_out_fraction`` is held out.

        Raises:
          TypeError: ``data`` is neither bytes nor a 1-D uint8 array.
          ValueError: ``held_out_fraction`` not in (0, 1), or too few bytes for
            ``seq_len`` in either part.
        """
        if not 0 < held_out_fraction < 1:
            raise ValueError(f"ByteCorpus: held_out_fraction={held_out_fraction!r} must be "
                             "in (0, 1).")
        stream = (np.frombuffer(bytes(data), dtype=np.uint8)
                  if isinstance(data, bytes | bytearray) else data)
        cut = int(len(stream) * (1 - held_out_fraction))
        return cls(stream[:cut], stream[cut:], seq_len=seq_len, files=files, source=source)

    @classmethod
    def from_files(cls, patterns: Sequence[str] | None = None, *, seq_len: int,
                   max_bytes: int = 8 << 20, held_out_fraction: float = 0.05) -> ByteCorpus:
        """The files matching ``patterns``, sorted and concatenated up to ``max_bytes``.

        Args:
          patterns: globs (recursive ``**``) or paths; None: :func:`default_patterns`
            (the standard library's ``.py`` files, those under site-packages or
            dist-packages left out).
          seq_len: tokens per sequence.
          max_bytes: read files in sorted path order until this many bytes.
          held_out_fraction: the final part of the stream held out for evaluation.
        Raises:
          ValueError: no file matches, a file cannot be read, ``max_bytes`` is not positive,
            or the text is too short for ``seq_len``.
        """
        max_bytes = _positive_int("ByteCorpus.from_files", "max_bytes", max_bytes)
        if isinstance(patterns, str):
            patterns = [patterns]
        default = patterns is None
        patterns = default_patterns() if default else list(patterns)
        files = {f for p in patterns for f in glob.glob(p, recursive=True)}
        if default:
            files = {f for f in files if "site-packages" not in f and "dist-packages" not in f}
        chunks, total = [], 0
        for path in sorted(f for f in files if os.path.isfile(f)):
            if total >= max_bytes:
                break
            try:
                with open(path, "rb") as fh:
                    chunks.append(fh.read(max_bytes - total))
            except OSError as e:
                raise ValueError(f"cannot read data file {path}: {e.strerror or e}; fix its "
                                 "permissions or leave it out of the globs") from e
            total += len(chunks[-1])
        if not chunks:
            raise ValueError(f"no files match {' '.join(patterns) or '(no patterns)'}; give "
                             "existing files or globs (quote globs with ** so the shell "
                             "leaves them to Python)")
        source = (" ".join(patterns) if len(patterns) <= 2
                  else f"{patterns[0]} ... ({len(patterns)} patterns)")
        return cls.from_bytes(b"".join(chunks), seq_len=seq_len,
                              held_out_fraction=held_out_fraction, files=len(chunks),
                              source=source)

    def summary(self) -> str:
        """One line: how much text from how many files, and the split, e.g.
        ``"8.39 MB from 640 files (<stdlib>/**/*.py); train 7.97 MB, held-out 419.4 kB"``."""
        def size(n: int) -> str:
            return f"{n / 1e6:.2f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"

        n_train, n_held = len(self.train), len(self.held_out)
        return (f"{size(n_train + n_held)} from {self.files} files ({self.source}); "
                f"train {size(n_train)}, held-out {size(n_held)}")

    # -- batches --------------------------------------------------------------------------

    def _windows(self, stream: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """int32 ``[*starts.shape, seq_len + 1]``: the windows beginning at ``starts``."""
        return stream[starts[..., None] + np.arange(self.seq_len + 1)].astype(np.int32)

    def _batch(self, stream: np.ndarray, starts: np.ndarray,
               sharding: jax.sharding.Sharding, axis: int) -> Batch:
        """Global tokens/labels of the windows at ``starts`` (the batch's shape without
        the sequence), reading only the rows along ``axis`` this process holds."""
        shape = (*starts.shape, self.seq_len)
        rows = rows_held(sharding, shape, axis)
        w = self._windows(stream, np.take(starts, rows, axis=axis))
        return {"tokens": assemble(w[..., :-1], rows, shape=shape, sharding=sharding, axis=axis),
                "labels": assemble(w[..., 1:], rows, shape=shape, sharding=sharding, axis=axis)}

    def train_starts(self, step: int, *, seed: int, batch_size: int) -> np.ndarray:
        """The ``batch_size`` window offsets into :attr:`train` of optimizer step ``step``:
        a pure function of ``(seed, step)`` (numpy's default generator seeded by both)."""
        rng = np.random.default_rng([seed, step])
        return rng.integers(0, len(self.train) - self.seq_len - 1, size=batch_size)

    def train_batch(self, step: int, *, seed: int, batch_size: int, micro_batches: int,
                    sharding: jax.sharding.Sharding) -> Batch:
        """The training batch of optimizer step ``step`` (see :meth:`train_starts`).

        Args:
          step: the optimizer step (any int >= 0; resumed runs pass the same numbers).
          seed: the data-order seed.
          batch_size: sequences per step, split into ``micro_batches``.
          micro_batches: the leading dimension, for gradient accumulation.
          sharding: of ``[micro_batches, batch_size / micro_batches, seq_len]``, e.g.
            ``NamedSharding(mesh, layout.spec(None, "batch", "length"))``.
        Returns:
          ``{"tokens", "labels"}``: int32 ``[micro_batches, batch_size / micro_batches,
          seq_len]`` global arrays with ``sharding``.
        Raises:
          ValueError: ``batch_size`` is not a positive multiple of ``micro_batches``.
        """
        batch_size = _positive_int("ByteCorpus.train_batch", "batch_size", batch_size)
        micro_batches = _positive_int("ByteCorpus.train_batch", "micro_batches", micro_batches)
        if batch_size % micro_batches:
            raise ValueError(f"ByteCorpus.train_batch: batch_size {batch_size} is not "
                             f"divisible by micro_batches {micro_batches}.")
        starts = self.train_starts(step, seed=seed, batch_size=batch_size)
        return self._batch(self.train, starts.reshape(micro_batches, -1), sharding, axis=1)

    def held_out_batches(self, count: int, *, batch_size: int,
                         sharding: jax.sharding.Sharding) -> list[Batch]:
        """The fixed held-out set: ``count * batch_size`` windows evenly spaced over
        :attr:`held_out` (first at 0, last ending at its end), in ``count`` batches.

        Args:
          count: number of batches.
          batch_size: sequences per batch.
          sharding: of ``[batch_size, seq_len]``, e.g. ``NamedSharding(mesh,
            layout.tokens)``.
        Returns:
          ``count`` dicts ``{"tokens", "labels"}``: int32 ``[batch_size, seq_len]``
          global arrays with ``sharding``.
        """
        count = _positive_int("ByteCorpus.held_out_batches", "count", count)
        batch_size = _positive_int("ByteCorpus.held_out_batches", "batch_size", batch_size)
        starts = np.linspace(0, len(self.held_out) - self.seq_len - 1,
                             count * batch_size).astype(np.int64)
        return [self._batch(self.held_out, s, sharding, axis=0)
                for s in starts.reshape(count, batch_size)]
