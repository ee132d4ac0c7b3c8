"""Token-id corpora and the global batches they feed a sharded model.

:class:`TokenIds` holds a stream of token ids split deterministically into a training and
a held-out part (the last ``held_out_fraction``, 5%). Sequences are windows of
``seq_len + 1`` ids: ``tokens`` are the first ``seq_len``, ``labels`` the last ``seq_len``
(the next id). It reads ids from a ``.npy`` array or a raw ``.bin`` of uint16 ids
(nanoGPT's format), both memory-mapped (:meth:`TokenIds.from_file`), takes an array
(:meth:`TokenIds.from_array`), or makes synthetic arithmetic progressions over a
vocabulary for smoke tests (:meth:`TokenIds.synthetic`); every id is checked against the
vocabulary. :class:`ByteCorpus` is its byte-level case: text files (globs or paths; by
default the running Python's standard library, ``**/*.py`` outside site-/dist-packages,
no download), sorted and concatenated up to ``max_bytes``, read as ids 0..255 (a JSON-lines
or parquet file as its documents' text, not its JSON).

* Training windows are drawn per optimizer step from a generator seeded by
  ``(seed, step)``: the data of a step is a pure function of its number, so a run resumed
  at step ``k`` sees exactly the batches the interrupted run would have.
* Held-out windows are fixed: evenly spaced over the held-out ids.

Batches are global ``jax.Array`` s assembled across processes: every process computes the
same window offsets, then reads and uploads only the rows its own devices hold
(:func:`rows_held` + :func:`assemble`, via ``jax.make_array_from_callback``). Their
shardings come from the layout vocabulary, e.g. for a model built with ``parallel``::

    layout = sp_jax.Layout.of(parallel)
    train_sharding = NamedSharding(mesh, layout.micro_batched_tokens)  # [M, B, S]
    eval_sharding = NamedSharding(mesh, layout.tokens)                 # [B, S]
    corpus = ByteCorpus.from_files(["data/**/*.txt"], seq_len=128)
    batch = corpus.train_batch(step, seed=0, batch_size=16, micro_batches=2,
                               sharding=train_sharding)   # {"tokens", "labels"} [2, 8, 128]

Any object with these two methods is :class:`TrainData`, what
:class:`sp_jax.training.Trainer` trains on.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import os
import sysconfig
from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

import jax
import numpy as np

from sp_jax.data.sources import Documents, is_record_file

__all__ = ["ByteCorpus", "TokenIds", "TrainData", "assemble", "default_patterns",
           "rows_held"]

Batch = dict[str, jax.Array]


@runtime_checkable
class TrainData(Protocol):
    """What :class:`sp_jax.training.Trainer` trains on (:class:`TokenIds` and
    :class:`ByteCorpus` are two).

    ``train_batch`` must be a pure function of ``(seed, step)`` (a resumed run then sees
    the batches the interrupted one would have) or, for a stateful source such as
    :class:`~sp_jax.data.PackedText`, take consecutive steps and resume from its
    ``state()`` / ``restore()``; ``held_out_batches`` the same fixed set on every call;
    both return global arrays with the ``sharding`` given, e.g.
    ``{"tokens", "labels"}`` int32 ``[micro_batches, batch_size / micro_batches, seq]``
    and ``[batch_size, seq]``.
    """

    def train_batch(self, step: int, *, seed: int, batch_size: int, micro_batches: int,
                    sharding: jax.sharding.Sharding) -> Batch:
        """The batch of optimizer step ``step``: leaves ``[micro_batches, batch_size /
        micro_batches, ...]`` with ``sharding``."""
        ...

    def held_out_batches(self, count: int, *, batch_size: int,
                         sharding: jax.sharding.Sharding) -> list[Batch]:
        """``count`` fixed held-out batches, leaves ``[batch_size, ...]`` with
        ``sharding``."""
        ...


def default_patterns() -> list[str]:
    """The running Python's standard library sources: ``<stdlib>/**/*.py``."""
    return [os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")]


def _installed(path: str) -> bool:
    """Whether ``path`` is (under) a site-packages or dist-packages directory."""
    return "site-packages" in path or "dist-packages" in path


def _default_files(patterns: Sequence[str]) -> set[str]:
    """The files the default ``patterns`` (``<root>/**/<name glob>``) match, those under
    site-packages or dist-packages left out: the paths ``glob.glob(pattern,
    recursive=True)`` gives (hidden names skipped, directory links followed), without
    walking the installed packages, which can be most of the tree (measured: 0.5-1.8 s of
    glob per process)."""
    files: set[str] = set()
    for pattern in patterns:
        root, sep, name = pattern.rpartition(os.path.join("**", ""))
        if not sep or not root or glob.has_magic(root) or os.sep in name:
            files.update(glob.glob(pattern, recursive=True))
            continue
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and not _installed(d)]
            files.update(os.path.join(dirpath, f) for f in fnmatch.filter(filenames, name)
                         if not f.startswith("."))
    return {f for f in files if not _installed(f)}


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


def _record_bytes(path: str, text_field: str, limit: int, flag: str | None) -> bytes:
    """Up to ``limit`` bytes of the documents of the JSON-lines or parquet file ``path``:
    each one's UTF-8 text and a newline."""
    docs = Documents.from_paths(path, text_field=text_field,
                                **({"flag": flag} if flag else {}))
    out, total = [], 0
    for i in range(len(docs)):
        if total >= limit:
            break
        out.append(docs[i].encode("utf-8") + b"\n")
        total += len(out[-1])
    return b"".join(out)[:limit]


def _smallest_dtype(vocab_size: int) -> type:
    return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.int32


@dataclasses.dataclass(frozen=True)
class TokenIds:
    """Token ids split into a training and a held-out stream, read as windows of
    ``seq_len + 1`` ids.

    Build it with :meth:`from_file`, :meth:`from_array` or :meth:`synthetic`; each checks
    that every id is in ``0 .. vocab_size - 1`` and that there is room for at least one
    window in each stream.

    Attributes:
      train: integer ``[n_train]``, the first ``1 - held_out_fraction`` of the ids (a
        memory map when read from a file).
      held_out: integer ``[n_held_out]``, the rest.
      seq_len: tokens per sequence.
      vocab_size: the model's vocabulary; ids must be below it.
      files: how many files the ids came from.
      source: what was read (a path, patterns, ...), for messages.
    """

    train: np.ndarray
    held_out: np.ndarray
    seq_len: int
    vocab_size: int
    files: int = 1
    source: str = "token ids"

    _dtype: ClassVar[type | None] = None  # the one dtype the streams must have; None: any int
    _what: ClassVar[str] = "token ids"  # "<n> token ids (<source>) are too few ..."
    _units: ClassVar[tuple[str, str]] = ("M", "k")  # summary's sizes: >= 1e5, below
    _noun: ClassVar[str] = " token ids"

    def __post_init__(self) -> None:
        where = type(self).__name__
        _positive_int(where, "seq_len", self.seq_len)
        _positive_int(where, "vocab_size", self.vocab_size)
        kind = np.dtype(self._dtype).name if self._dtype else "integer"
        for name in ("train", "held_out"):
            stream = getattr(self, name)
            dtype = getattr(stream, "dtype", None)
            if (not isinstance(stream, np.ndarray) or stream.ndim != 1
                    or not (dtype == self._dtype if self._dtype
                            else np.issubdtype(dtype, np.integer))):
                raise TypeError(f"{where}: {name} must be a 1-D {kind} numpy array, got "
                                f"{type(stream).__name__} {dtype or ''}.")
        if min(len(self.train), len(self.held_out)) <= self.seq_len + 1:
            raise ValueError(
                f"{len(self.train) + len(self.held_out)} {self._what} ({self.source}) are "
                f"too few for seq_len {self.seq_len} (train {len(self.train)}, held-out "
                f"{len(self.held_out)}; each needs more than seq_len + 1): use more data or "
                "a shorter sequence.")
        limits = [np.iinfo(s.dtype) for s in (self.train, self.held_out)]
        if any(i.min < 0 or i.max >= self.vocab_size for i in limits):  # else in range
            lo = min(int(self.train.min()), int(self.held_out.min()))
            hi = max(int(self.train.max()), int(self.held_out.max()))
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"{self.source}: token ids range over [{lo}, {hi}], outside the "
                    f"vocabulary of {self.vocab_size} (ids 0 .. {self.vocab_size - 1}): use "
                    "ids from the model's tokenizer, or a model with a larger vocabulary.")

    @classmethod
    def from_array(cls, ids: np.ndarray, *, seq_len: int, vocab_size: int,
                   held_out_fraction: float = 0.05, files: int = 1,
                   source: str = "array") -> TokenIds:
        """Splits the 1-D integer array ``ids`` deterministically: the last
        ``held_out_fraction`` is held out (views, no copy: a memory map stays one).

        Raises:
          TypeError: ``ids`` is not a 1-D integer array.
          ValueError: ``held_out_fraction`` not in (0, 1), an id outside the vocabulary,
            or too few ids for ``seq_len`` in either part.
        """
        if not 0 < held_out_fraction < 1:
            raise ValueError(f"{cls.__name__}: held_out_fraction={held_out_fraction!r} must "
                             "be in (0, 1).")
        cut = int(len(ids) * (1 - held_out_fraction))
        return cls(ids[:cut], ids[cut:], seq_len=seq_len, vocab_size=vocab_size, files=files,
                   source=source)

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, seq_len: int, vocab_size: int,
                  held_out_fraction: float = 0.05) -> TokenIds:
        """Token ids from a ``.npy`` array (any integer dtype and shape, flattened) or,
        for any other suffix, a raw ``.bin`` of uint16 ids (nanoGPT's format); both are
        memory-mapped, and only the windows of a batch are read.

        Raises:
          ValueError: the file cannot be read or holds no integers, an id is outside
            ``0 .. vocab_size - 1`` (naming the file and the range), or too few ids.
        """
        path = os.fspath(path)
        try:
            ids = (np.load(path, mmap_mode="r") if path.endswith(".npy")
                   else np.memmap(path, dtype=np.uint16, mode="r"))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read token ids from {path}: "
                             f"{getattr(e, 'strerror', None) or e}; give a .npy array of ids "
                             "or a raw .bin of uint16 ids (nanoGPT's format)") from e
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{path} holds {ids.dtype} values, not integer token ids; save "
                             "the ids as an integer array")
        return cls.from_array(ids.reshape(-1), seq_len=seq_len, vocab_size=vocab_size,
                              held_out_fraction=held_out_fraction, source=path)

    @classmethod
    def synthetic(cls, vocab_size: int, *, seq_len: int, tokens: int = 1 << 20, seed: int = 0,
                  held_out_fraction: float = 0.05) -> TokenIds:
        """``tokens`` ids any model can learn, to show a loop works without data: runs of
        ``4 * (seq_len + 1)`` ids ``start + stride * i (mod vocab_size)``, ``start`` and
        ``stride`` (1..7) drawn per run from ``seed``.

        Raises:
          ValueError: ``tokens`` too few for ``seq_len``.
        """
        tokens = _positive_int("TokenIds.synthetic", "tokens", tokens)
        vocab_size = _positive_int("TokenIds.synthetic", "vocab_size", vocab_size)
        run = 4 * (_positive_int("TokenIds.synthetic", "seq_len", seq_len) + 1)
        rng = np.random.default_rng(seed)
        count = -(-tokens // run)
        start, stride = rng.integers(0, vocab_size, (count, 1)), rng.integers(1, 8, (count, 1))
        ids = ((start + stride * np.arange(run)) % vocab_size).reshape(-1)[:tokens]
        return cls.from_array(ids.astype(_smallest_dtype(vocab_size)), seq_len=seq_len,
                              vocab_size=vocab_size, held_out_fraction=held_out_fraction,
                              files=0, source=f"synthetic progressions, seed {seed}")

    def summary(self) -> str:
        """One line: how many ids from how many files, and the split, e.g.
        ``"1.05M token ids from 1 files (ids.npy); train 0.99M, held-out 52.4k"`` (a
        :class:`ByteCorpus`: ``"8.39 MB from 640 files (<stdlib>/**/*.py); train 7.97 MB,
        held-out 419.4 kB"``)."""
        def size(n: int) -> str:
            return f"{n / 1e6:.2f}{big}" if n >= 100_000 else f"{n / 1e3:.1f}{small}"

        big, small = self._units
        n_train, n_held = len(self.train), len(self.held_out)
        origin = f" from {self.files} files" if self.files else ""
        return (f"{size(n_train + n_held)}{self._noun}{origin} ({self.source}); train "
                f"{size(n_train)}, held-out {size(n_held)}")

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
            ``NamedSharding(mesh, layout.micro_batched_tokens)``.
        Returns:
          ``{"tokens", "labels"}``: int32 ``[micro_batches, batch_size / micro_batches,
          seq_len]`` global arrays with ``sharding``.
        Raises:
          ValueError: ``batch_size`` is not a positive multiple of ``micro_batches``.
        """
        where = f"{type(self).__name__}.train_batch"
        batch_size = _positive_int(where, "batch_size", batch_size)
        micro_batches = _positive_int(where, "micro_batches", micro_batches)
        if batch_size % micro_batches:
            raise ValueError(f"{where}: batch_size {batch_size} is not divisible by "
                             f"micro_batches {micro_batches}.")
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
        where = f"{type(self).__name__}.held_out_batches"
        count = _positive_int(where, "count", count)
        batch_size = _positive_int(where, "batch_size", batch_size)
        starts = np.linspace(0, len(self.held_out) - self.seq_len - 1,
                             count * batch_size).astype(np.int64)
        return [self._batch(self.held_out, s, sharding, axis=0)
                for s in starts.reshape(count, batch_size)]


@dataclasses.dataclass(frozen=True)
class ByteCorpus(TokenIds):
    """Bytes split into a training and a held-out stream, read as windows of
    ``seq_len + 1`` bytes (token ids 0..255): the byte-level :class:`TokenIds`.

    Build it with :meth:`from_files` or :meth:`from_bytes`; both check there is room for
    at least one window in each stream.

    Attributes:
      train: uint8 ``[n_train]``, the first ``1 - held_out_fraction`` of the bytes.
      held_out: uint8 ``[n_held_out]``, the rest.
      seq_len: tokens per sequence.
      vocab_size: 256.
      files: how many files the bytes came from.
      source: what was read (the patterns), for messages.
    """

    vocab_size: int = 256
    source: str = "bytes"

    _dtype: ClassVar[type | None] = np.uint8
    _what: ClassVar[str] = "bytes of text"
    _units: ClassVar[tuple[str, str]] = (" MB", " kB")
    _noun: ClassVar[str] = ""

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
        stream = (np.frombuffer(bytes(data), dtype=np.uint8)
                  if isinstance(data, bytes | bytearray) else data)
        return cls.from_array(stream, seq_len=seq_len, vocab_size=256,
                              held_out_fraction=held_out_fraction, files=files, source=source)

    @classmethod
    def from_files(cls, patterns: Sequence[str] | None = None, *, seq_len: int,
                   max_bytes: int = 8 << 20, held_out_fraction: float = 0.05,
                   text_field: str = "text", flag: str | None = None) -> ByteCorpus:
        """The files matching ``patterns``, sorted and concatenated up to ``max_bytes``.

        A plain text file is read whole, as bytes. A JSON-lines or parquet file
        (:func:`~sp_jax.data.sources.is_record_file`) is read as its documents: the UTF-8
        text of each record's ``text_field``, each followed by a newline (not the file's
        JSON keys and quotes; its records are checked as :class:`~sp_jax.data.Documents`
        checks them).

        Args:
          patterns: globs (recursive ``**``) or paths; None: :func:`default_patterns`
            (the standard library's ``.py`` files, those under site-packages or
            dist-packages left out).
          seq_len: tokens per sequence.
          max_bytes: read files in sorted path order until this many bytes.
          held_out_fraction: the final part of the stream held out for evaluation.
          text_field: the JSON field or parquet column holding the text.
          flag: what a message about a missing field says to pass (a command line's
            flag; default: ``Documents``').
        Raises:
          ValueError: no file matches, a file cannot be read, a record lacks
            ``text_field`` or holds no string there, ``max_bytes`` is not positive, or
            the text is too short for ``seq_len``.
        """
        max_bytes = _positive_int("ByteCorpus.from_files", "max_bytes", max_bytes)
        if isinstance(patterns, str):
            patterns = [patterns]
        default = patterns is None
        patterns = default_patterns() if default else list(patterns)
        files = (_default_files(patterns) if default
                 else {f for p in patterns for f in glob.glob(p, recursive=True)})
        chunks, total = [], 0
        for path in sorted(f for f in files if os.path.isfile(f)):
            if total >= max_bytes:
                break
            try:
                if is_record_file(path):
                    chunks.append(_record_bytes(path, text_field, max_bytes - total, flag))
                else:
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
