"""Text documents tokenized and packed into rows, the same global batches for any number of
processes, resumable at any step.

:class:`PackedText` reads :class:`~sp_jax.data.Documents` (text, JSON lines, parquet),
tokenizes each with a :class:`~sp_jax.data.Tokenizer`, appends the end-of-document id and
packs the documents into rows of ``seq_len`` tokens with Grain's packing transforms. A
row holds ``tokens``, ``labels`` (the next token of the same document, ``-100`` where
there is none), ``segment_ids`` (1, 2, ... per document, 0 = padding) and ``positions``
(from 0 in each document): what a causal model needs to attend within documents only.

Determinism: the training documents are dealt to ``batch_size`` fixed *streams* (stream
``j`` reads documents ``j, j + batch_size, ...`` of a shuffle of the documents by
``seed``, reshuffled every epoch, forever), each its own Grain pipeline that yields one
row per step. Row ``r`` of every batch comes from stream ``r`` (rows numbered over the
whole batch, micro-batch-major: row ``m * (batch_size / micro_batches) + b`` is
micro-batch ``m``, row ``b``), so a step's global batch depends on neither the number of
processes nor the mesh, and each process builds and reads only the streams of the rows
its devices hold::

    data = PackedText.from_files(["corpus/**/*.jsonl"], tokenizer=load_tokenizer(path),
                                 seq_len=1024)
    batch = data.train_batch(1, seed=0, batch_size=16, micro_batches=2, sharding=s)
    # {"tokens", "labels", "segment_ids", "positions"}: int32 [2, 8, 1024]
    saved = data.state()  # JSON: this process's streams, after step 1
    # later, on any number of processes, with every process's saved state:
    again = PackedText.from_files(["corpus/**/*.jsonl"], tokenizer=..., seq_len=1024)
    again.restore(merge_states(saved_by_every_process))
    again.train_batch(2, seed=0, batch_size=16, micro_batches=2, sharding=s)

:meth:`PackedText.train_batch` is stateful: it takes consecutive steps (1, 2, ... from a
fresh start, ``k + 1, k + 2, ...`` after :meth:`PackedText.restore` of the state saved
after step ``k``), and a resumed run sees exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np
from grain.experimental import (
    ConcatThenSplitIterDataset,
    FirstFitPackIterDataset,
    FlatMapIterDataset,
    FlatMapTransform,
)

from sp_jax.data.completions import IGNORE, PromptCompletions, completion_element
from sp_jax.data.corpus import Batch, assemble, rows_held
from sp_jax.data.sources import Documents
from sp_jax.data.tokenizer import Tokenizer

__all__ = ["IGNORE", "KEYS", "PackedText", "merge_states", "packing_efficiency"]

KEYS = ("tokens", "labels", "segment_ids", "positions")
"""A batch's arrays, all int32."""

PACKINGS = ("first_fit", "concat")


def packing_efficiency(rows: Mapping[str, np.ndarray]) -> float:
    """The share of positions that hold a token: ``mean(segment_ids != 0)`` over rows
    ``{"segment_ids": [..., seq_len]}`` (a batch, or :meth:`PackedText.rows`)."""
    return float(np.mean(np.asarray(rows["segment_ids"]) != 0))


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The states of all processes (:meth:`PackedText.state`) as one, for
    :meth:`PackedText.restore`: the union of their streams.

    Raises:
      ValueError: the states disagree on the step, batch size, seed or packing, or on a
        stream that two of them hold.
    """
    if not states:
        raise ValueError("merge_states: no states given; pass each process's state().")
    merged = {k: v for k, v in states[0].items() if k != "streams"}
    streams: dict[str, Any] = {}
    for i, state in enumerate(states):
        for key in merged:
            if state.get(key) != merged[key]:
                raise ValueError(f"merge_states: state {i} has {key}={state.get(key)!r}, "
                                 f"state 0 {merged[key]!r}; merge states saved at the same "
                                 "step of the same run")
        for j, stream in state["streams"].items():
            if j in streams and streams[j] != stream:
                raise ValueError(f"merge_states: two states hold stream {j} at different "
                                 "positions; merge states saved at the same step")
            streams[j] = stream
    return {**merged, "streams": dict(sorted(streams.items(), key=lambda kv: int(kv[0])))}


class _Slice:
    """Documents ``start .. stop - 1`` of ``docs``: a Grain data source."""

    def __init__(self, docs: Documents, start: int, stop: int) -> None:
        self.docs, self.start, self.stop = docs, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> str:
        return self.docs[self.start + int(index)]


class _Pieces(FlatMapTransform):
    """A tokenized document as pieces of at most ``seq_len`` tokens (first-fit packing
    cannot place a longer one); each keeps its labels, the last one's included."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len, self.max_fan_out = seq_len, 1 << 30

    def flat_map(self, element: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        n, step = len(element["tokens"]), self.seq_len
        if n <= step:
            return [element]
        return [{k: v[i:i + step] for k, v in element.items()} for i in range(0, n, step)]


class _Stream:
    """One stream's Grain iterator and how many rows it has given."""

    def __init__(self, iterator: Any, given: int = 0) -> None:
        self.iterator, self.given = iterator, given


class PackedText:
    """Documents tokenized, with the end-of-document id appended, packed into rows of
    ``seq_len`` tokens: a :class:`~sp_jax.data.TrainData` for the
    :class:`~sp_jax.training.Trainer`, resumable with :meth:`state` / :meth:`restore`.

    Each document ``d`` (its ids and the end-of-document id) is an element with inputs
    ``d`` and labels ``d[1:] + [-100]``: the end-of-document token is not trained to
    predict the next document's first token. Two ways to pack (``packing``):

    * ``"first_fit"`` (default): Grain's ``FirstFitPackIterDataset``. Documents longer
      than ``seq_len`` are first cut into pieces of ``seq_len`` tokens (each piece keeps
      the label of its last token, the next piece's first); ``num_packing_bins`` rows
      are filled at a time, each element into the first row with room, and a row is
      padded (segment 0, label -100) where nothing fits. Documents stay whole when they
      fit in a row; the price is padding, which more bins reduce (over 0.95 of
      positions hold tokens with 64 bins on varied lengths), at the cost of memory and
      of rows that mix documents read further apart.
    * ``"concat"``: Grain's ``ConcatThenSplitIterDataset``: documents concatenated and
      cut every ``seq_len`` tokens. No padding at all, but most documents are cut at a
      row end, their start and end trained in different rows.

    Positions restart at 0 in every segment: a piece of a long document (either packing)
    starts at position 0 again, as if it were a document of its own; its tokens still
    see only their own piece. Rows are int32 ``[seq_len]``: ``tokens``, ``labels``,
    ``segment_ids``, ``positions``.

    Streams: row ``r`` of every training batch (micro-batch-major) comes from stream
    ``r`` of ``batch_size``: documents ``r, r + batch_size, ...`` of the training
    documents shuffled by ``seed`` (Grain's index shuffle, a new order every epoch),
    each stream its own Grain pipeline (source, shuffle, tokenize, cut, pack). A
    process builds and reads only the streams of its rows, so the global batch of a
    step is the same for any process count, mesh or micro-batch split. Each stream
    holds up to two packs of ``num_packing_bins`` rows (first-fit: the one it hands
    out and the one it fills, up to ``48 * num_packing_bins * seq_len`` bytes) and at
    most one tokenized document ahead: lower ``num_packing_bins`` for long rows on a
    process holding many rows.

    Held-out data: the last ``held_out_fraction`` of the documents in path order (at
    least one), packed the same way without shuffling into a fixed sequence of rows;
    :meth:`held_out_batches` takes its first ``count * batch_size`` rows; when there are
    fewer, it takes them again in the same order, with a warning.

    Completions only: given :class:`~sp_jax.data.PromptCompletions` instead of
    ``Documents``, each element is a pair cut to ``seq_len`` whose labels train the
    completion and the end of document only; pairs whose prompt fills the row are
    dropped (``documents.dropped``).

    Attributes:
      documents: all documents; the first ``train_documents`` are for training.
      tokenizer: the tokenizer.
      seq_len: tokens per row.
      vocab_size: the tokenizer's, what the model must embed.
      packing: ``"first_fit"`` or ``"concat"``.
      train_documents: how many documents training reads (the rest are held out).
    """

    def __init__(self, documents: Documents, *, tokenizer: Tokenizer, seq_len: int,
                 packing: str = "first_fit", held_out_fraction: float = 0.05,
                 num_packing_bins: int = 64, read_workers: int = 0) -> None:
        """
        Args:
          documents: the corpus, e.g. ``Documents.from_paths(...)``.
          tokenizer: a :class:`~sp_jax.data.Tokenizer` (``ByteTokenizer()``,
            ``load_tokenizer(path)``).
          seq_len: tokens per row.
          packing: ``"first_fit"`` or ``"concat"`` (see the class docstring).
          held_out_fraction: the share of documents (the last in path order, at least
            one) held out for evaluation, in (0, 1).
          num_packing_bins: first-fit: rows filled at a time per stream.
          read_workers: threads that advance this process's streams concurrently (the
            tokenizer releases the GIL; each stream is read by one thread at a time);
            0: one after the other in the calling thread.
        Raises:
          TypeError: ``documents`` or ``tokenizer`` of the wrong kind.
          ValueError: a bad ``seq_len``, ``packing``, ``held_out_fraction``,
            ``num_packing_bins`` or ``read_workers``; fewer than 2 documents; the
            tokenizer's ``eos_id`` outside its vocabulary.
        """
        where = "PackedText"
        if not isinstance(documents, Documents | PromptCompletions):
            raise TypeError(f"{where}: documents must be sp_jax.data.Documents, got "
                            f"{type(documents).__name__}; use PackedText.from_files(paths, "
                            "...) or Documents.from_paths(paths).")
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"{where}: tokenizer {tokenizer!r} lacks encode, encode_batch, "
                            "vocab_size, eos_id or name; use ByteTokenizer() or "
                            "load_tokenizer(path).")
        self.seq_len = _int(where, "seq_len", seq_len, 1)
        if packing not in PACKINGS:
            raise ValueError(f"{where}: packing={packing!r} must be one of "
                             f"{', '.join(map(repr, PACKINGS))}.")
        if not (isinstance(held_out_fraction, float | int) and 0 < held_out_fraction < 1):
            raise ValueError(f"{where}: held_out_fraction={held_out_fraction!r} must be in "
                             "(0, 1).")
        self.num_packing_bins = _int(where, "num_packing_bins", num_packing_bins, 1)
        self.read_workers = _int(where, "read_workers", read_workers, 0)
        if not 0 <= tokenizer.eos_id < tokenizer.vocab_size:
            raise ValueError(f"{where}: tokenizer {tokenizer.name} has eos_id "
                             f"{tokenizer.eos_id}, outside its {tokenizer.vocab_size} ids.")
        if isinstance(documents, PromptCompletions):  # pairs cut off by seq_len dropped
            documents = documents.fit(tokenizer, self.seq_len)
        if len(documents) < 2:
            raise ValueError(f"{where}: {len(documents)} document in {documents.files}: "
                             "training and held-out data need at least 2; give more "
                             "documents")
        self.documents, self.tokenizer, self.packing = documents, tokenizer, packing
        self.vocab_size, self.eos_id = tokenizer.vocab_size, tokenizer.eos_id
        self.held_out_fraction = float(held_out_fraction)
        held = max(1, int(len(documents) * held_out_fraction))
        self.train_documents = len(documents) - held
        self._streams: dict[int, _Stream] = {}
        self._pool = (concurrent.futures.ThreadPoolExecutor(
            self.read_workers, thread_name_prefix="sp_jax-packed") if self.read_workers
            else None)
        if self._pool is not None:
            weakref.finalize(self, self._pool.shutdown, wait=False)
        self._run: tuple[int, int] | None = None  # (seed, batch_size) of the streams
        self._next_step = 1
        self._restored: dict[str, Any] | None = None
        self._held_out: dict[str, np.ndarray] | None = None

    @classmethod
    def from_files(cls, paths: str | Sequence[str], *, tokenizer: Tokenizer, seq_len: int,
                   text_field: str = "text", packing: str = "first_fit",
                   held_out_fraction: float = 0.05, num_packing_bins: int = 64,
                   read_workers: int = 0, prompt_field: str | None = None,
                   completion_field: str | None = None) -> PackedText:
        """The documents of ``paths`` (files or globs: text, JSON lines, parquet; see
        :meth:`~sp_jax.data.Documents.from_paths`), ``text_field`` naming the JSON field
        or parquet column; with ``prompt_field`` and ``completion_field`` (both), the
        :class:`~sp_jax.data.PromptCompletions` of those fields instead, trained on the
        completions only; the other arguments as :class:`PackedText` takes them.

        Raises:
          ValueError: as :meth:`~sp_jax.data.Documents.from_paths` and
            :class:`PackedText` raise.
        """
        if (prompt_field is None) != (completion_field is None):
            raise ValueError("PackedText.from_files: prompt_field (--prompt-field) and "
                             "completion_field (--completion-field) go together; give both")
        docs = (Documents.from_paths(paths, text_field=text_field) if prompt_field is None
                else PromptCompletions.from_paths(paths, prompt_field=prompt_field,
                                                  completion_field=completion_field))
        return cls(docs, tokenizer=tokenizer,
                   seq_len=seq_len, packing=packing, held_out_fraction=held_out_fraction,
                   num_packing_bins=num_packing_bins, read_workers=read_workers)

    def summary(self) -> str:
        """One line, e.g. ``"400 documents in 3 files (train 380, held-out 20);
        tokenizer tok.json (4096 ids); first-fit packing (64 bins) into rows of 128"``."""
        n, files = len(self.documents), len(self.documents.files)
        how = (f"first-fit packing ({self.num_packing_bins} bins)"
               if self.packing == "first_fit" else "concatenate-then-split packing")
        pairs = (f"; {self.documents.summary()}"
                 if isinstance(self.documents, PromptCompletions) else "")
        return (f"{n} documents in {files} files (train {self.train_documents}, held-out "
                f"{n - self.train_documents}); tokenizer {self.tokenizer.name} "
                f"({self.vocab_size} ids); {how} into rows of {self.seq_len}{pairs}")

    def __repr__(self) -> str:
        return f"PackedText({self.summary()})"

    # -- pipelines ------------------------------------------------------------------------

    def _element(self, text: str | tuple[str, str]) -> dict[str, np.ndarray]:
        """A document's inputs (ids + eos) and labels (the next id; -100 after eos); a
        ``(prompt, completion)`` pair's as :func:`~sp_jax.data.completions.
        completion_element` makes them (labels of the completion and eos only)."""
        if isinstance(text, tuple):
            prompt, completion = self.tokenizer.encode_batch(list(text))
            return completion_element(prompt, completion, eos_id=self.eos_id,
                                      seq_len=self.seq_len)
        ids = self.tokenizer.encode(text)
        tokens = np.empty(len(ids) + 1, dtype=np.int32)
        tokens[:-1], tokens[-1] = ids, self.eos_id
        labels = np.empty_like(tokens)
        labels[:-1], labels[-1] = tokens[1:], IGNORE
        return {"tokens": tokens, "labels": labels}

    def _pack(self, elements: grain.MapDataset) -> Any:
        """An iterator of packed rows over the (possibly infinite) tokenized documents
        ``elements`` (:meth:`_element`)."""
        # No Grain reading threads: per stream they would read and tokenize documents
        # far ahead (measured: slower, and a slow first step); read_workers advances
        # whole streams in threads instead.
        ds = elements.to_iter_dataset(grain.ReadOptions(num_threads=0,
                                                        prefetch_buffer_size=0))
        lengths = {"tokens": self.seq_len, "labels": self.seq_len}
        if self.packing == "concat":
            return iter(ConcatThenSplitIterDataset(ds, length_struct=lengths))
        return iter(FirstFitPackIterDataset(
            FlatMapIterDataset(ds, _Pieces(self.seq_len)), length_struct=lengths,
            num_packing_bins=self.num_packing_bins, shuffle_bins=False,
            padding_struct={"tokens": 0, "labels": IGNORE}))

    def _row(self, iterator: Any) -> dict[str, np.ndarray]:
        """The next row of a packing iterator, under the batch's names."""
        row = next(iterator)
        segments, labels = row["tokens_segment_ids"], row["labels"]
        if self.packing == "concat":  # its padding (a finite stream's end) holds zeros
            labels = np.where(segments == 0, IGNORE, labels)
        return {"tokens": row["tokens"], "segment_ids": segments, "labels": labels,
                "positions": row["tokens_positions"]}

    def _new_stream(self, j: int) -> _Stream:
        """Stream ``j`` of the run ``self._run``: documents ``j, j + S, ...`` of the
        per-epoch shuffles of the training documents, at its start."""
        seed, streams = self._run
        shuffle_seed = int(np.random.SeedSequence([seed, 0x5EED]).generate_state(1)[0])
        docs = (grain.MapDataset.source(_Slice(self.documents, 0, self.train_documents))
                .shuffle(seed=shuffle_seed).repeat()[j::streams])
        return _Stream(self._pack(docs.map(self._element)))

    def _stream(self, j: int) -> _Stream:
        """Stream ``j``, built on first use: at the restored position, or advanced to
        the current step."""
        if j in self._streams:
            return self._streams[j]
        stream, restored = self._new_stream(j), self._restored
        if restored is not None and restored["next_step"] > 1:
            state = restored["streams"].get(str(j))
            if state is None:
                held = ", ".join(sorted(restored["streams"], key=int)) or "none"
                raise ValueError(
                    f"PackedText: this process reads stream {j} (row {j} of each batch), "
                    f"which the restored state lacks (streams {held}); restore the states "
                    "of every process merged (merge_states)")
            stream.iterator.set_state(self._grain_state(state))
            stream.given = restored["next_step"] - 1
        self._streams[j] = stream
        return stream

    def _grain_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A stream's state as Grain takes it back (JSON turned its tuples to lists)."""
        if self.packing == "concat":
            state = {**state, "remainder_slices": {
                k: tuple(v) for k, v in state["remainder_slices"].items()}}
        return state

    # -- training batches -----------------------------------------------------------------

    def _start(self, where: str, step: int, seed: int, batch_size: int) -> None:
        """Checks the arguments of the step about to be read; binds the run's seed and
        batch size on the first step."""
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            raise TypeError(f"{where}: step={step!r} must be an int.")
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"{where}: seed={seed!r} must be an int >= 0.")
        batch_size = _int(where, "batch_size", batch_size, 1)
        if step != self._next_step:
            after = "after the restored step" if self._restored else "from a fresh start"
            raise ValueError(
                f"{where}: step {step}, expected step {self._next_step} ({after}): "
                "PackedText reads its streams in order; call steps consecutively, or "
                "restore() the state saved after step "
                f"{step - 1} to resume there")
        run = (int(seed), batch_size)
        if self._run is None:
            if self._restored is not None and self._restored["next_step"] > 1:
                saved = (self._restored["seed"], self._restored["batch_size"])
                if saved != run:
                    raise ValueError(
                        f"{where}: seed {seed}, batch_size {batch_size}, but the restored "
                        f"state was saved with seed {saved[0]}, batch_size {saved[1]} (one "
                        "stream per row): resume with the same seed and batch size")
            self._run = run
        elif run != self._run:
            raise ValueError(
                f"{where}: seed {seed}, batch_size {batch_size}, but this run reads seed "
                f"{self._run[0]}, batch_size {self._run[1]}: a PackedText serves one run; "
                "make a new one (or restore a state) for another")

    def rows(self, step: int, rows: Sequence[int], *, seed: int,
             batch_size: int) -> dict[str, np.ndarray]:
        """The rows ``rows`` (global indices ``0 .. batch_size - 1``) of the batch of step
        ``step``, as numpy: what a process holding those rows reads.
        :meth:`train_batch` is this plus the upload; call one of the two per step.

        Args:
          step: the next step (see :meth:`train_batch`).
          rows: global row indices (micro-batch-major over the whole batch).
          seed: the data-order seed.
          batch_size: rows per step (= streams).
        Returns:
          ``{"tokens", "labels", "segment_ids", "positions"}``: int32
          ``[len(rows), seq_len]``.
        Raises:
          ValueError: ``step`` is not the next step; ``seed`` or ``batch_size`` differ
            from the run's (or the restored state's); a row outside the batch or named
            twice; a stream this process needs is missing from the restored state.
        """
        where = "PackedText.rows"
        self._start(where, step, seed, batch_size)
        rows = [int(r) for r in rows]
        bad = [r for r in rows if not 0 <= r < batch_size]
        if bad:
            raise ValueError(f"{where}: rows {bad} outside the batch of {batch_size} rows.")
        if len(set(rows)) != len(rows):
            raise ValueError(f"{where}: rows {rows} name a row twice; each row is one "
                             "stream, read once per step.")
        out = {k: np.zeros((len(rows), self.seq_len), np.int32) for k in KEYS}
        streams = [self._stream(r) for r in rows]

        def advance(stream: _Stream) -> dict[str, np.ndarray]:
            while stream.given < step - 1:  # first read after step 1, not restored
                self._row(stream.iterator)
                stream.given += 1
            row = self._row(stream.iterator)
            stream.given += 1
            return row

        read = (self._pool.map(advance, streams) if self._pool and len(streams) > 1
                else map(advance, streams))
        for i, row in enumerate(read):
            for k in KEYS:
                out[k][i] = row[k]
        self._next_step = step + 1
        return out

    def train_batch(self, step: int, *, seed: int, batch_size: int, micro_batches: int,
                    sharding: jax.sharding.Sharding) -> Batch:
        """The training batch of optimizer step ``step``, reading only the streams of the
        rows this process's devices hold.

        Args:
          step: 1 on a fresh start, then each next step; ``k + 1`` after restoring the
            state saved after step ``k``.
          seed: the data-order seed (the documents' shuffle).
          batch_size: rows per step, split into ``micro_batches``; one stream per row.
          micro_batches: the leading dimension, for gradient accumulation.
          sharding: of ``[micro_batches, batch_size / micro_batches, seq_len]``, e.g.
            ``NamedSharding(mesh, layout.micro_batched_tokens)``.
        Returns:
          ``{"tokens", "labels", "segment_ids", "positions"}``: int32 ``[micro_batches,
          batch_size / micro_batches, seq_len]`` global arrays with ``sharding``.
        Raises:
          ValueError: ``batch_size`` not a multiple of ``micro_batches``; as
            :meth:`rows` raises.
        """
        where = "PackedText.train_batch"
        batch_size = _int(where, "batch_size", batch_size, 1)
        micro_batches = _int(where, "micro_batches", micro_batches, 1)
        if batch_size % micro_batches:
            raise ValueError(f"{where}: batch_size {batch_size} is not divisible by "
                             f"micro_batches {micro_batches}.")
        per = batch_size // micro_batches
        shape = (micro_batches, per, self.seq_len)
        held: set[tuple[int, int]] = set()  # (micro-batch, row) pairs this process holds
        for index in sharding.addressable_devices_indices_map(shape).values():
            held.update((m, b) for m in range(*index[0].indices(micro_batches))
                        for b in range(*index[1].indices(per)))
        global_rows = sorted(m * per + b for m, b in held)
        self._start(where, step, seed, batch_size)  # before any stream moves
        data = self.rows(step, global_rows, seed=seed, batch_size=batch_size)
        cols = rows_held(sharding, shape, axis=1)
        col = {int(b): k for k, b in enumerate(cols)}
        local = {k: np.zeros((micro_batches, len(cols), self.seq_len), np.int32) for k in KEYS}
        for i, r in enumerate(global_rows):
            m, b = divmod(r, per)
            for k in KEYS:
                local[k][m, col[b]] = data[k][i]
        return {k: assemble(local[k], cols, shape=shape, sharding=sharding, axis=1)
                for k in KEYS}

    # -- resuming -------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Where this process's streams are, JSON-serialisable: ``{"next_step",
        "batch_size", "seed", "packing", "streams": {"<j>": Grain iterator state}}``
        for the streams it has read (those of its rows). Merge the states of all
        processes (:func:`merge_states`) for :meth:`restore`."""
        streams = {}
        if self._restored is not None and self._restored["next_step"] == self._next_step:
            streams.update(self._restored["streams"])  # not read since: still there
        streams.update({str(j): s.iterator.get_state() for j, s in self._streams.items()})
        seed, batch_size = self._run or (None, None)
        if self._restored is not None and self._run is None:
            seed, batch_size = self._restored["seed"], self._restored["batch_size"]
        state = {"next_step": self._next_step, "batch_size": batch_size, "seed": seed,
                 "packing": self.packing, "streams": dict(sorted(
                     streams.items(), key=lambda kv: int(kv[0])))}
        return json.loads(json.dumps(state, default=_json_scalar))

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continues from ``state`` (all processes' :meth:`state` merged by
        :func:`merge_states`, saved after step ``next_step - 1``): the next
        :meth:`train_batch` is step ``next_step``, with the same seed and batch size.
        Streams are positioned when first read (this process's, whatever the mesh).

        Raises:
          ValueError: ``state`` is not such a dict, was saved with another packing, or
            holds a stream outside its batch; later, at ``train_batch``, a stream this
            process reads is missing or the seed or batch size differ.
        """
        where = "PackedText.restore"
        keys = ("next_step", "batch_size", "seed", "packing", "streams")
        if not isinstance(state, Mapping) or any(k not in state for k in keys):
            raise ValueError(f"{where}: expected the dict of PackedText.state() (keys "
                             f"{', '.join(keys)}), got {type(state).__name__} "
                             f"{sorted(state) if isinstance(state, Mapping) else ''}.")
        next_step = _int(where, "next_step", state["next_step"], 1)
        if state["packing"] != self.packing:
            raise ValueError(f"{where}: the state was saved with packing "
                             f"{state['packing']!r}, this PackedText packs {self.packing!r}; "
                             "resume with the same packing")
        streams = dict(state["streams"])
        if next_step > 1:
            batch_size = _int(where, "batch_size", state["batch_size"], 1)
            bad = [j for j in streams if not (str(j).isdigit() and int(j) < batch_size)]
            if bad:
                raise ValueError(f"{where}: streams {bad} outside the {batch_size} of the "
                                 "saved batch size; pass a state from PackedText.state()")
        self._restored = {"next_step": next_step, "batch_size": state["batch_size"],
                          "seed": state["seed"],
                          "streams": {str(j): v for j, v in streams.items()}}
        self._streams = {}
        self._run, self._next_step = None, next_step

    # -- held-out batches -----------------------------------------------------------------

    def held_out_rows(self, count: int) -> dict[str, np.ndarray]:
        """The first ``count`` rows of the held-out documents packed in order (no
        shuffle), the same on every call and every process: int32 ``[count, seq_len]``.
        Where they fill fewer rows, they are taken again in the same order (a warning
        says so).
        """
        have = self._held_out
        if have is not None and len(have["tokens"]) >= count:
            return {k: v[:count] for k, v in have.items()}
        docs = grain.MapDataset.source(
            _Slice(self.documents, self.train_documents, len(self.documents)))
        iterator, rows = self._pack(docs.map(self._element)), []
        for _ in range(count):
            try:
                rows.append(self._row(iterator))
            except StopIteration:
                break
        if len(rows) < count:  # a small held-out set: its rows again, in the same order
            held = len(self.documents) - self.train_documents
            warnings.warn(
                f"PackedText: the {held} held-out documents fill {len(rows)} rows of "
                f"{self.seq_len} tokens, fewer than the {count} asked for (eval batches x "
                "batch size): evaluation reuses them (each counted more than once); hold "
                "out more (--held-out-fraction / held_out_fraction, "
                f"{self.held_out_fraction} now) for a held-out loss over distinct rows",
                stacklevel=2)
            rows = [rows[i % len(rows)] for i in range(count)]
        self._held_out = {k: np.stack([r[k] for r in rows]) for k in KEYS}
        return self._held_out

    def held_out_batches(self, count: int, *, batch_size: int,
                         sharding: jax.sharding.Sharding) -> list[Batch]:
        """``count`` fixed held-out batches: rows ``k * batch_size .. (k + 1) * batch_size
        - 1`` of :meth:`held_out_rows` for batch ``k``.

        Args:
          count: number of batches.
          batch_size: rows per batch.
          sharding: of ``[batch_size, seq_len]``, e.g. ``NamedSharding(mesh,
            layout.tokens)``.
        Returns:
          ``count`` dicts ``{"tokens", "labels", "segment_ids", "positions"}``: int32
          ``[batch_size, seq_len]`` global arrays with ``sharding``.
        """
        where = "PackedText.held_out_batches"
        count = _int(where, "count", count, 1)
        batch_size = _int(where, "batch_size", batch_size, 1)
        data = self.held_out_rows(count * batch_size)
        shape = (batch_size, self.seq_len)
        rows = rows_held(sharding, shape, axis=0)
        return [{k: assemble(data[k][rows + i * batch_size], rows, shape=shape,
                             sharding=sharding, axis=0) for k in KEYS}
                for i in range(count)]


def _int(where: str, name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{where}: {name}={value!r} must be an int >= {low}.")
    return int(value)


def _json_scalar(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating) and math.isfinite(value):
        return float(value)
    raise TypeError(f"PackedText.state: {type(value).__name__} {value!r} is not JSON")
