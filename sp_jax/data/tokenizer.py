"""Tokenizers: text to token ids, with the end-of-document id packing appends.

:class:`Tokenizer` is the protocol :class:`~sp_jax.data.PackedText` reads: ``encode``,
``encode_batch``, ``vocab_size``, ``eos_id`` and a ``name`` for messages. Two kinds:

* :class:`ByteTokenizer`: UTF-8 bytes as ids 0..255, end of document 256 (257 ids); no
  file, no training.
* :class:`HFTokenizer`: a Hugging Face ``tokenizer.json`` (:func:`load_tokenizer`), e.g.
  a model's own, or one trained on local text with no download::

      .venv/bin/python -m sp_jax.data.tokenizer --vocab-size 4096 --out tokenizer.json \\
          'corpus/**/*.txt'

  (byte-level BPE by the ``tokenizers`` library's trainer, end of document
  ``<|endoftext|>``; below 257 ids, a small checkpoint's vocabulary, character-level BPE
  over the most frequent characters, the others ``<unk>``; the files as
  :class:`~sp_jax.data.Documents` reads them, with ``--text-field`` for JSON lines and parquet).

:func:`check_vocab` is the one check that the model's vocabulary holds every id.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from sp_jax.data.sources import Documents

__all__ = ["EOS_CANDIDATES", "SMALLEST_VOCAB", "UNKNOWN", "ByteTokenizer", "HFTokenizer",
           "Tokenizer", "check_vocab", "load_tokenizer", "main", "train_tokenizer"]

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
"""End-of-document tokens looked for, in this order, among a file's special tokens."""

TRAINED_EOS = "<|endoftext|>"


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids.

    Attributes:
      name: what it is, for messages (a path, ``"bytes"``).
      vocab_size: ids are ``0 .. vocab_size - 1``.
      eos_id: the end-of-document id, appended to every document when packing.
    """

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, no special tokens added."""
        ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]`` (possibly in parallel)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens written out)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; the end of a document is id 256 (vocab_size 257)."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The UTF-8 bytes of each text."""
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The UTF-8 text of the byte ids (the end-of-document id dropped; a broken byte
        sequence shown as U+FFFD)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", "replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (from a ``tokenizer.json``): build it with
    :func:`load_tokenizer`.

    ``encode`` adds no special tokens (no BOS: packing appends ``eos_id`` to each
    document itself), and reads special tokens written in the text (a literal
    ``<|endoftext|>``) as text: only packing marks a document's end.

    Attributes:
      name: the file it was loaded from.
      vocab_size: ``get_vocab_size(with_added_tokens=True)``.
      eos_id: the id of ``eos_token``.
      eos_token: the end-of-document token.
      tokenizer: the wrapped ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer, *, name: str, eos_token: str, eos_id: int) -> None:
        self.tokenizer, self.name = tokenizer, name
        tokenizer.encode_special_tokens = True  # "<|endoftext|>" in a text is text
        self.eos_token, self.eos_id = eos_token, int(eos_id)
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        # the batch call without offsets: the same ids, a quarter faster than encode()
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text (in parallel: the library's own threads)."""
        return [e.ids for e in self.tokenizer.encode_batch_fast(list(texts),
                                                                add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens written out."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, "
                f"eos={self.eos_token!r})")


def load_tokenizer(path: str | os.PathLike, *, eos_token: str | None = None) -> HFTokenizer:
    """A Hugging Face ``tokenizer.json``, via ``tokenizers.Tokenizer.from_file``.

    Args:
      path: the ``tokenizer.json`` file.
      eos_token: the end-of-document token; None: the first of :data:`EOS_CANDIDATES`
        among the file's special tokens.
    Raises:
      ValueError: the file does not load; ``eos_token`` is not in its vocabulary; none
        given and no candidate among its special tokens.
    """
    from tokenizers import Tokenizer as _HF

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer {path}: no such file; give a Hugging Face "
                         "tokenizer.json, or make one with python -m sp_jax.data.tokenizer "
                         "--vocab-size N --out tokenizer.json FILES")
    try:
        tok = _HF.from_file(path)
    except Exception as e:  # the Rust library raises a bare Exception
        raise ValueError(f"tokenizer {path} does not load as a Hugging Face tokenizer.json "
                         f"({str(e).strip() or type(e).__name__}); give the tokenizer.json "
                         "of a model, or make one with python -m sp_jax.data.tokenizer") from e
    if eos_token is None:
        special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        found = [t for t in EOS_CANDIDATES if t in special]
        if not found:
            shown = ", ".join(sorted(special)[:10]) or "none"
            raise ValueError(f"tokenizer {path}: no end-of-document token among its special "
                             f"tokens ({shown}); looked for {', '.join(EOS_CANDIDATES)}: pass "
                             "eos_token= (--eos-token) naming it")
        eos_token = found[0]
        eos_id = special[eos_token]
    else:
        eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"tokenizer {path}: eos_token {eos_token!r} is not in its "
                             "vocabulary; pass a token it has (e.g. one of its special "
                             "tokens)")
    return HFTokenizer(tok, name=path, eos_token=eos_token, eos_id=eos_id)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Checks that a model with ``model_vocab_size`` ids embeds every id of ``tokenizer``
    (a larger, e.g. padded, model vocabulary is fine).

    Raises:
      ValueError: the tokenizer has more ids than the model.
    """
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids but the model's "
            f"vocabulary is {model_vocab_size}: give the model a vocabulary of at least "
            f"{tokenizer.vocab_size} (--vocab-size {tokenizer.vocab_size}) or use a "
            f"tokenizer with at most {model_vocab_size} ids")


def _texts(docs: Documents, batch: int = 256) -> Iterator[list[str]]:
    for start in range(0, len(docs), batch):
        yield [docs[i] for i in range(start, min(start + batch, len(docs)))]


SMALLEST_VOCAB = 3
"""The fewest ids :func:`train_tokenizer` makes: ``<|endoftext|>``, ``<unk>`` and one
character."""

UNKNOWN = "<unk>"
"""The character-level tokenizer's token for a character outside its alphabet."""


def train_tokenizer(paths: str | os.PathLike | Sequence[str | os.PathLike], *,
                    vocab_size: int, out: str | os.PathLike,
                    text_field: str = "text") -> HFTokenizer:
    """Trains a BPE tokenizer on local files and saves it as ``out``.

    ``vocab_size >= 257``: byte-level BPE, the ``tokenizers`` library's BPE trainer over
    a byte-level pre-tokenizer (GPT-2's scheme: any text encodes, no unknown token), with
    one special token, ``<|endoftext|>`` (id 0), the end of document.

    ``vocab_size < 257`` (a small checkpoint's vocabulary, e.g. 96, too small for the 256
    byte symbols): character-level BPE: its alphabet is the ``vocab_size - 2`` most
    frequent characters of the files (the ``tokenizers`` trainer's ``limit_alphabet``),
    any other character encodes as ``<unk>`` (id 1, after ``<|endoftext|>`` id 0), spaces
    are kept as ``▁`` (SentencePiece's ``Metaspace``, so decoding gives the text back),
    and the ids the alphabet leaves over are BPE merges. Text made only of the alphabet's
    characters decodes to itself; the command line prints the alphabet's size.

    Args:
      paths: files or globs, as :meth:`~sp_jax.data.Documents.from_paths` reads them.
      vocab_size: ids in all (at most: a small corpus may have fewer characters and
        merges), at least :data:`SMALLEST_VOCAB`.
      out: the ``tokenizer.json`` to write.
      text_field: the JSON field or parquet column holding the text.
    Returns:
      The tokenizer, as :func:`load_tokenizer` reads ``out``.
    Raises:
      ValueError: ``vocab_size`` not an int >= 3, or the files as
        :meth:`~sp_jax.data.Documents.from_paths` raises.
    """
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or \
            vocab_size < SMALLEST_VOCAB:
        raise ValueError(f"train_tokenizer: vocab_size={vocab_size!r} must be an int >= "
                         f"{SMALLEST_VOCAB} (<|endoftext|>, {UNKNOWN} and a character; from "
                         "257 on byte-level BPE).")
    docs = Documents.from_paths(paths, text_field=text_field)
    if vocab_size >= 257:
        tok = _HF(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    else:
        tok = _HF(models.BPE(unk_token=UNKNOWN))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tok.decoder = decoders.Metaspace(prepend_scheme="never")
        trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                      special_tokens=[TRAINED_EOS, UNKNOWN],
                                      limit_alphabet=vocab_size - 2, show_progress=False)
    tok.train_from_iterator(_texts(docs), trainer=trainer, length=len(docs))
    out = os.fspath(out)
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    tok.save(out)
    return load_tokenizer(out, eos_token=TRAINED_EOS)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sp_jax.data.tokenizer --vocab-size N --out tokenizer.json FILES...``:
    trains a BPE tokenizer (:func:`train_tokenizer`: byte-level from 257 ids, below that
    character-level) and prints one line, its size, kind and path."""
    parser = argparse.ArgumentParser(
        prog="python -m sp_jax.data.tokenizer",
        description="Train a BPE tokenizer (tokenizer.json) on local text files, JSON lines "
                    "or parquet; no download. Byte-level from --vocab-size 257 on; below "
                    "that (a small checkpoint's vocabulary) character-level: the most "
                    "frequent characters, the others <unk>.")
    parser.add_argument("files", nargs="+", metavar="FILES",
                        help="files or quoted globs (recursive **): .txt and other text files "
                             "(one document each), .jsonl (one per line), .parquet (one per "
                             "row)")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help="ids in all (at most): >= 257 byte-level BPE (256 bytes + "
                             "<|endoftext|>); 3 .. 256 character-level BPE (<|endoftext|>, "
                             "<unk>, the VOCAB_SIZE - 2 most frequent characters, merges)")
    parser.add_argument("--out", required=True, help="the tokenizer.json to write")
    parser.add_argument("--text-field", default="text",
                        help="JSON field / parquet column holding the text (default: text)")
    args = parser.parse_args(argv)
    try:
        tok = train_tokenizer(args.files, vocab_size=args.vocab_size, out=args.out,
                              text_field=args.text_field)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.vocab_size >= 257:
        kind = "byte-level BPE"
    else:
        alphabet = sum(len(t) == 1 for t in tok.tokenizer.get_vocab(with_added_tokens=False))
        kind = (f"character-level BPE: {alphabet} characters, the others "
                f"{UNKNOWN!r} = {tok.tokenizer.token_to_id(UNKNOWN)}")
    print(f"wrote {tok.name}: {tok.vocab_size} ids ({kind}, end of document "
          f"{tok.eos_token!r} = {tok.eos_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
