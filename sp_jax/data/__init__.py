"""Training data: token-id corpora, text documents, tokenizers, and the global batches they
feed a sharded model.

* :mod:`~sp_jax.data.corpus`: :class:`TokenIds` (ids from ``.npy`` / ``.bin``, arrays or
  synthetic progressions) and :class:`ByteCorpus` (text files read as bytes), windows as a
  pure function of ``(seed, step)``; the :class:`TrainData` protocol the
  :class:`~sp_jax.training.Trainer` reads; :func:`rows_held` and :func:`assemble`, how
  every data source builds global arrays from the rows a process holds.
* :mod:`~sp_jax.data.sources`: :class:`Documents`, random access to the documents of
  plain text files, JSON lines and parquet files.
* :mod:`~sp_jax.data.completions`: :class:`PromptCompletions`, prompt / completion pairs
  for completion-only fine-tuning (:func:`completion_element`: the prompt's labels
  ignored).
* :mod:`~sp_jax.data.tokenizer`: the :class:`Tokenizer` protocol, :class:`ByteTokenizer`,
  :func:`load_tokenizer` (a Hugging Face ``tokenizer.json``), :func:`train_tokenizer`
  (``python -m sp_jax.data.tokenizer``), :func:`check_vocab`.
* :mod:`~sp_jax.data.packed`: :class:`PackedText`, documents tokenized and packed into
  rows with segment ids and positions by Grain, resumable (``state()`` /
  ``restore()``), the same global batches for any process count.

:mod:`~sp_jax.data.packed` imports Grain (and with it a second of start-up) and
:mod:`~sp_jax.data.tokenizer` is a command: both are loaded on first use of one of their
names (``from sp_jax.data import PackedText``), not by ``import sp_jax``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sp_jax.data.completions import PromptCompletions, completion_element
from sp_jax.data.corpus import (
    Batch,
    ByteCorpus,
    TokenIds,
    TrainData,
    assemble,
    default_patterns,
    rows_held,
)
from sp_jax.data.sources import Documents

if TYPE_CHECKING:  # loaded on first use by __getattr__; named here for checkers
    from sp_jax.data.packed import PackedText, merge_states, packing_efficiency
    from sp_jax.data.tokenizer import (
        ByteTokenizer,
        HFTokenizer,
        Tokenizer,
        check_vocab,
        load_tokenizer,
        train_tokenizer,
    )

# Loaded on first use: ``packed`` imports Grain (a second of start-up), and
# ``python -m sp_jax.data.tokenizer`` must find its module not yet imported.
_LAZY = {"PackedText": "packed", "packing_efficiency": "packed", "merge_states": "packed",
         "packed": "packed", "tokenizer": "tokenizer", **{
             name: "tokenizer" for name in ("ByteTokenizer", "HFTokenizer", "Tokenizer",
                                            "check_vocab", "load_tokenizer",
                                            "train_tokenizer")}}

__all__ = ["Batch", "ByteCorpus", "ByteTokenizer", "Documents", "HFTokenizer", "PackedText",
           "PromptCompletions", "TokenIds", "Tokenizer", "TrainData", "assemble",
           "check_vocab", "completion_element", "default_patterns", "load_tokenizer",
           "merge_states", "packing_efficiency", "rows_held", "train_tokenizer"]


def __getattr__(name: str) -> Any:
    """The names of ``packed`` and ``tokenizer``, imported on first use."""
    if name in _LAZY:
        module = importlib.import_module(f"sp_jax.data.{_LAZY[name]}")
        return module if name == _LAZY[name] else getattr(module, name)
    raise AttributeError(f"module 'sp_jax.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
