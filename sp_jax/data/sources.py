"""Documents of text corpora, by index: plain text, JSON lines and parquet files.

:class:`Documents` gives random access to the documents of one or many files (what Grain's
``MapDataset.source`` needs: ``len`` and ``[index]``), in sorted path order:

* a plain text file (any other suffix) is one document;
* a JSON-lines file (``.jsonl``, ``.ndjson``, ``.json``) holds one document per non-empty
  line: a JSON object whose ``text_field`` (default ``"text"``) is the text. The line
  offsets are indexed once (one scan of the bytes, no parsing);
* a parquet file holds one document per row, in the column ``text_field``; the row
  counts come from the file's metadata and row groups are read when a document in them
  is (the last few stay cached).

Every document is checked when it is read (UTF-8, JSON, the field, a string), and the
first few of each file also when :meth:`Documents.from_paths` builds the index, so that
the usual mistakes (a wrong field name, a binary file in a glob) fail at once, naming the
file and the line or row::

    docs = Documents.from_paths(["corpus/**/*.jsonl"], text_field="content")
    len(docs), docs[0], docs.location(0)   # 1200, "...", "corpus/a.jsonl:1"
"""

from __future__ import annotations

import bisect
import codecs
import collections
import glob
import json
import os
import threading
from collections.abc import Sequence

import numpy as np

__all__ = ["Documents", "expand_paths", "is_record_file"]

JSON_LINES = (".jsonl", ".ndjson", ".json")
PARQUET = (".parquet", ".pq")
_SCAN_BYTES = 1 << 26  # JSON-lines files are indexed in chunks of 64 MiB
_CHECK_BYTES = 4096  # of each text file, checked as UTF-8 at construction
_ROW_GROUPS_CACHED = 8  # parquet row groups kept decoded, across files
_FLAG = "--text-field (text_field=)"  # what a missing field's message says to pass


def expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The files that ``paths`` (paths or globs, recursive ``**``) name: sorted, each once.

    Raises:
      ValueError: a path or glob matches no file, or names a directory.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if not paths:
        raise ValueError("no data files given: pass paths or globs (e.g. 'data/**/*.jsonl')")
    files: set[str] = set()
    for pattern in map(os.fspath, paths):
        if os.path.isdir(pattern):
            raise ValueError(f"{pattern} is a directory: give its files or a glob such as "
                             f"'{os.path.join(pattern, '**', '*.jsonl')}'")
        matched = [f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)]
        if not matched:
            raise ValueError(f"no file matches {pattern}; give existing files or globs "
                             "(quote globs with ** so the shell leaves them to Python)")
        files.update(os.path.normpath(f) for f in matched)
    return sorted(files)


def _kind(path: str) -> str:
    lower = path.lower()
    return ("jsonl" if lower.endswith(JSON_LINES) else "parquet" if lower.endswith(PARQUET)
            else "text")


def is_record_file(path: str | os.PathLike) -> bool:
    """Whether :class:`Documents` reads ``path`` as records whose ``text_field`` holds the
    text (JSON lines: ``.jsonl``, ``.ndjson``, ``.json``; parquet: ``.parquet``, ``.pq``),
    not as one plain text document."""
    return _kind(os.fspath(path)) != "text"


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


class _TextFile:
    """One plain text file, one document."""

    def __init__(self, path: str) -> None:
        self.path, self.count = path, 1 if os.path.getsize(path) else 0

    def location(self, index: int) -> str:
        return self.path

    def check_head(self, count: int) -> None:
        """Whether the file's first bytes are UTF-8 (the one document's start)."""
        if not self.count:
            return
        with open(self.path, "rb") as fh:
            head = fh.read(_CHECK_BYTES)
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as e:
            raise self._not_utf8(head, e) from None

    def _not_utf8(self, data: bytes, e: UnicodeDecodeError) -> ValueError:
        return ValueError(f"{self.path}:{_line_of(data, e.start)}: not UTF-8 text (byte "
                          f"{e.start}: {e.reason}); leave the file out of the globs or "
                          "convert it to UTF-8")

    def read(self, index: int) -> str:
        with open(self.path, "rb") as fh:
            data = fh.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._not_utf8(data, e) from None


class _DocumentsFile:
    """A file of many documents: reading its first few checks them."""

    count: int

    def read(self, index: int) -> str:
        raise NotImplementedError

    def check_head(self, count: int) -> None:
        """Reads the first ``count`` documents (their errors name the file and line)."""
        for index in range(min(count, self.count)):
            self.read(index)


class _JsonLinesFile(_DocumentsFile):
    """A JSON-lines file: one document per non-empty line; line offsets indexed once."""

    def __init__(self, path: str, text_field: str, flag: str = _FLAG) -> None:
        self.path, self.text_field, self.flag = path, text_field, flag
        ends, cr_before, last, size = [], [], -1, 0
        with open(path, "rb") as fh:  # in chunks: the file may be larger than memory
            while chunk := fh.read(_SCAN_BYTES):
                data = np.frombuffer(chunk, dtype=np.uint8)
                newlines = np.flatnonzero(data == ord("\n"))
                before = np.where(newlines > 0, data[np.maximum(newlines - 1, 0)], last)
                ends.append(newlines + size)
                cr_before.append(before == ord("\r"))
                last, size = int(data[-1]), size + len(data)
        ends = np.concatenate([np.zeros(0, np.int64), *ends])
        cr = np.concatenate([np.zeros(0, bool), *cr_before])
        if size and last != ord("\n"):  # a last line without a newline
            ends, cr = np.append(ends, size), np.append(cr, last == ord("\r"))
        starts = np.concatenate([[0], ends[:-1] + 1])[:len(ends)].astype(np.int64)
        lengths = ends - starts
        keep = lengths - cr > 0  # a blank line, or one holding only "\r" (Windows), is none
        self.starts, self.lengths = starts[keep], lengths[keep]
        self.lines = np.flatnonzero(keep) + 1  # 1-based line numbers, for messages
        self.count = len(self.starts)

    def location(self, index: int) -> str:
        return f"{self.path}:{self.lines[index]}"

    def read(self, index: int) -> str:
        where = self.location(index)
        with open(self.path, "rb") as fh:
            fh.seek(int(self.starts[index]))
            raw = fh.read(int(self.lengths[index]))
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text (byte {e.start} of the line: "
                             f"{e.reason}); convert the file to UTF-8") from None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not a JSON object ({e.msg} at column {e.colno}); "
                             "JSON-lines files hold one JSON object per line") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object; "
                             f"JSON-lines files hold one object per line, the text in "
                             f"'{self.text_field}'")
        if self.text_field not in record:
            fields = ", ".join(map(repr, list(record)[:12])) or "none"
            raise ValueError(f"{where}: no field '{self.text_field}' (fields: {fields}); pass "
                             f"{self.flag} naming the field that holds the text")
        text = record[self.text_field]
        if not isinstance(text, str):
            raise ValueError(f"{where}: field '{self.text_field}' is a JSON "
                             f"{type(text).__name__}, not a string; pass {self.flag} "
                             "naming the field that holds the text")
        return text


class _ParquetFile(_DocumentsFile):
    """A parquet file: one document per row of the column ``text_field``."""

    def __init__(self, path: str, text_field: str, cache: _RowGroupCache,
                 flag: str = _FLAG) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path, self.text_field, self._cache = path, text_field, cache
        self.flag = flag
        try:
            self._file = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise ValueError(f"{path}: not a readable parquet file ({e}); leave it out of "
                             "the globs or rewrite it") from None
        schema = self._file.schema_arrow
        if text_field not in schema.names:
            fields = ", ".join(map(repr, schema.names[:12])) or "none"
            raise ValueError(f"{path}: no column '{text_field}' (columns: {fields}); pass "
                             f"{flag} naming the column that holds the text")
        kind = schema.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_string_view(kind)):
            raise ValueError(f"{path}: column '{text_field}' holds {kind}, not strings; pass "
                             f"{flag} naming the column that holds the text")
        metadata = self._file.metadata
        sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        self._group_starts = np.cumsum([0, *sizes]).tolist()
        self.count = self._group_starts[-1]

    def location(self, index: int) -> str:
        return f"{self.path}: row {index}"

    def read(self, index: int) -> str:
        group = bisect.bisect_right(self._group_starts, index) - 1
        column = self._cache.get((self.path, group), lambda: self._file.read_row_group(
            group, columns=[self.text_field]).column(0))
        text = column[index - self._group_starts[group]].as_py()
        if text is None:
            raise ValueError(f"{self.location(index)}: column '{self.text_field}' is null; "
                             "drop the row or fill it")
        return text


class _RowGroupCache:
    """The last few decoded parquet row groups, shared by the files of a corpus."""

    def __init__(self, size: int) -> None:
        self._size, self._items = size, collections.OrderedDict()
        self._lock, self._loading = threading.Lock(), threading.Lock()

    def get(self, key: tuple[str, int], load):
        """The cached value of ``key``, or ``load()`` (one load at a time: a pyarrow
        ``ParquetFile`` is not read from two threads at once)."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        with self._loading:
            with self._lock:
                if key in self._items:  # loaded while this thread waited
                    return self._items[key]
            value = load()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


class Documents:
    """The documents of text, JSON-lines and parquet files, by index (sorted path order;
    within a file, line or row order).

    Build it with :meth:`from_paths`. ``len(docs)`` is the number of documents (empty text
    files and blank JSON lines are not documents), ``docs[i]`` the text of document ``i``
    (read and checked then), :meth:`location` where it is (``path``, ``path:line`` or
    ``path: row n``). Thread-safe: Grain's reading threads may call ``docs[i]``
    concurrently.

    Attributes:
      files: the files, sorted.
      text_field: the JSON field or parquet column holding the text.
    """

    def __init__(self, files: Sequence[_TextFile | _JsonLinesFile | _ParquetFile],
                 text_field: str) -> None:
        self._files = [f for f in files if f.count]
        self.files = [f.path for f in files]
        self.text_field = text_field
        self._starts = np.cumsum([0, *(f.count for f in self._files)]).tolist()

    @classmethod
    def from_paths(cls, paths: str | os.PathLike | Sequence[str | os.PathLike], *,
                   text_field: str = "text", check_first: int = 4,
                   flag: str = _FLAG) -> Documents:
        """Indexes the documents of ``paths``.

        Args:
          paths: files or globs (recursive ``**``), one or many; each must match a file.
            ``.jsonl`` / ``.ndjson`` / ``.json``: JSON lines; ``.parquet`` / ``.pq``:
            parquet; anything else: plain text, one document per file.
          text_field: the JSON field or parquet column that holds the text.
          check_first: documents of each JSON-lines or parquet file read and checked now
            (every document is checked again when it is read); text files: their first
            4 KiB are checked to be UTF-8.
          flag: what a message about a missing or wrong field says to pass (a command
            line's flag).
        Raises:
          ValueError: a path matches no file; a file is unreadable, not UTF-8, not JSON
            lines; a missing field or column, or one that is not a string (each naming
            the file and the line or row); no document at all.
        """
        if not isinstance(text_field, str) or not text_field:
            raise TypeError(f"Documents: text_field={text_field!r} must be a non-empty str "
                            "(the JSON field or parquet column that holds the text).")
        cache = _RowGroupCache(_ROW_GROUPS_CACHED)
        files: list[_TextFile | _JsonLinesFile | _ParquetFile] = []
        for path in expand_paths(paths):
            try:
                kind = _kind(path)
                file = (_JsonLinesFile(path, text_field, flag) if kind == "jsonl"
                        else _ParquetFile(path, text_field, cache, flag) if kind == "parquet"
                        else _TextFile(path))
                file.check_head(check_first)
            except OSError as e:
                raise ValueError(f"cannot read data file {path}: {e.strerror or e}; fix its "
                                 "permissions or leave it out of the globs") from e
            files.append(file)
        docs = cls(files, text_field)
        shown = " ".join(map(os.fspath, [paths] if isinstance(paths, str | os.PathLike)
                             else paths))
        if not len(docs):
            raise ValueError(f"no documents in {shown} ({len(files)} files: empty, or blank "
                             "lines only); give files that hold text")
        if len(docs) <= check_first and not any(docs[i] for i in range(len(docs))):
            raise ValueError(f"no non-empty document in {shown}: every text is empty; "
                             "give files that hold text (or the right --text-field)")
        return docs

    def __len__(self) -> int:
        return self._starts[-1]

    def _find(self, index: int) -> tuple[_TextFile | _JsonLinesFile | _ParquetFile, int]:
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(f"Documents: index {index!r} must be an int.")
        if not 0 <= index < len(self):
            raise IndexError(f"Documents: index {index} outside 0 .. {len(self) - 1}.")
        k = bisect.bisect_right(self._starts, int(index)) - 1
        return self._files[k], int(index) - self._starts[k]

    def __getitem__(self, index: int) -> str:
        """The text of document ``index``, read and checked now.

        Raises:
          ValueError: the document is not UTF-8, not a JSON object, lacks the field or
            holds no string there (naming the file and line or row).
        """
        file, local = self._find(index)
        return file.read(local)

    def location(self, index: int) -> str:
        """Where document ``index`` is: ``path``, ``path:line`` or ``path: row n``."""
        file, local = self._find(index)
        return file.location(local)

    def __repr__(self) -> str:
        return f"Documents({len(self)} documents in {len(self.files)} files)"
