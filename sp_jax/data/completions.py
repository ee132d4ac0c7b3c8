"""Prompt / completion pairs for completion-only fine-tuning.

:class:`PromptCompletions` reads pairs from JSON lines (two fields of each object) or
parquet (two columns): document ``i`` is ``(prompt, completion)``. Given to
:class:`~sp_jax.data.PackedText`, each pair becomes one element whose inputs are the
prompt's ids, the completion's ids and the end-of-document id, and whose labels are
those of a plain document with every label that predicts a prompt token set to the
ignore index (-100): the loss counts the completion's tokens and the end of document
only, as TRL's completion-only loss does (:func:`completion_element`)::

    pairs = PromptCompletions.from_paths("sft.jsonl", prompt_field="question",
                                         completion_field="answer")
    data = PackedText(pairs, tokenizer=load_tokenizer("ckpt/tokenizer.json"), seq_len=512)

A pair longer than ``seq_len`` is cut to its first ``seq_len`` tokens (not split into
pieces: a completion makes sense after its prompt only); a pair whose prompt alone fills
the ``seq_len`` positions has no completion token left and is dropped, counted in
:attr:`PromptCompletions.dropped` (:meth:`PromptCompletions.fit`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from sp_jax.data.sources import JSON_LINES, PARQUET, Documents, expand_paths

__all__ = ["IGNORE", "PromptCompletions", "completion_element"]

IGNORE = -100
"""The label of a position that trains nothing (no next token of its document, padding,
a prompt token)."""


def completion_element(prompt_ids: Sequence[int], completion_ids: Sequence[int], *,
                       eos_id: int, seq_len: int) -> dict[str, np.ndarray]:
    """One packing element of a pair: ``tokens = prompt + completion + [eos_id]`` cut to
    ``seq_len``; ``labels[i] = tokens[i + 1]`` where ``tokens[i + 1]`` is a completion
    token or the end of document, else :data:`IGNORE` (the label of the last token kept
    is the next token of the pair, when the pair was cut).

    Returns:
      ``{"tokens", "labels"}``: int32 ``[min(len(prompt) + len(completion) + 1, seq_len)]``.
    """
    ids = np.asarray([*prompt_ids, *completion_ids, eos_id], dtype=np.int32)
    labels = np.full_like(ids, IGNORE)
    labels[:-1] = ids[1:]
    labels[:max(len(prompt_ids) - 1, 0)] = IGNORE  # they predict prompt tokens
    return {"tokens": ids[:seq_len], "labels": labels[:seq_len]}


class PromptCompletions:
    """Prompt / completion pairs of JSON-lines or parquet files, by index (sorted path
    order, as :class:`~sp_jax.data.Documents`): ``pairs[i]`` is ``(prompt, completion)``.

    Attributes:
      files: the files, sorted.
      prompt_field: the JSON field / parquet column of the prompt.
      completion_field: the JSON field / parquet column of the completion.
      dropped: pairs left out by :meth:`fit` (the prompt fills every position).
      shortened: pairs cut to ``seq_len`` tokens by :meth:`fit`.
      seq_len: the row length :meth:`fit` was given (None before).
    """

    def __init__(self, prompts: Documents, completions: Documents,
                 keep: np.ndarray | None = None) -> None:
        if len(prompts) != len(completions):
            raise ValueError(f"PromptCompletions: {len(prompts)} prompts but "
                             f"{len(completions)} completions; read both from the same files")
        self.prompts, self.completions = prompts, completions
        self.files = prompts.files
        self.prompt_field, self.completion_field = prompts.text_field, completions.text_field
        self.keep = np.arange(len(prompts)) if keep is None else np.asarray(keep, np.int64)
        self.dropped, self.shortened, self.seq_len = 0, 0, None

    @classmethod
    def from_paths(cls, paths: str | os.PathLike | Sequence[str | os.PathLike], *,
                   prompt_field: str, completion_field: str) -> PromptCompletions:
        """The pairs of ``paths`` (JSON lines: two fields of each object; parquet: two
        columns). Raises ValueError as :meth:`~sp_jax.data.Documents.from_paths` does,
        naming ``--prompt-field`` or ``--completion-field``; a plain text file (one
        document, no fields) is refused."""
        plain = [f for f in expand_paths(paths) if not f.lower().endswith(JSON_LINES + PARQUET)]
        if plain:
            raise ValueError(f"{plain[0]}: a plain text file has no prompt and completion "
                             "fields; give JSON lines (.jsonl) or parquet files, or drop "
                             "--prompt-field / --completion-field to train on whole texts")
        return cls(
            Documents.from_paths(paths, text_field=prompt_field, flag="--prompt-field"),
            Documents.from_paths(paths, text_field=completion_field,
                                 flag="--completion-field"))

    def fit(self, tokenizer, seq_len: int) -> PromptCompletions:
        """These pairs for rows of ``seq_len`` tokens: those whose prompt takes fewer
        than ``seq_len`` tokens, with :attr:`dropped` and :attr:`shortened` counted.

        Raises:
          ValueError: no pair keeps a completion token (naming ``--seq-len``).
        """
        keep, shortened = [], 0
        for start in range(0, len(self.prompts), 256):
            index = range(start, min(start + 256, len(self.prompts)))
            prompts = tokenizer.encode_batch([self.prompts[int(i)] for i in index])
            completions = tokenizer.encode_batch([self.completions[int(i)] for i in index])
            for i, p, c in zip(index, prompts, completions, strict=True):
                if len(p) < seq_len:
                    keep.append(i)
                    shortened += len(p) + len(c) + 1 > seq_len
        fitted = PromptCompletions(self.prompts, self.completions, np.asarray(keep, np.int64))
        fitted.dropped, fitted.shortened = len(self.prompts) - len(keep), shortened
        fitted.seq_len = seq_len
        if not keep:
            raise ValueError(
                f"every one of the {len(self.prompts)} prompts in {' '.join(self.files)} "
                f"fills the {seq_len} positions of a row (--seq-len {seq_len}): no "
                "completion token is left to train; raise --seq-len (up to the model's "
                "positions) or shorten the prompts")
        return fitted

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, index: int) -> tuple[str, str]:
        i = int(self.keep[index])
        return self.prompts[i], self.completions[i]

    def location(self, index: int) -> str:
        """Where pair ``index`` is: ``path:line`` or ``path: row n``."""
        return self.prompts.location(int(self.keep[index]))

    def summary(self) -> str:
        """e.g. ``"completions only (prompt 'q', completion 'a'); 3 pairs dropped ..."``."""
        cut = (f"; {self.dropped} pairs dropped (the prompt fills all {self.seq_len} "
               f"positions), {self.shortened} cut to {self.seq_len} tokens"
               if self.seq_len else "")
        return (f"completions only (prompt '{self.prompt_field}', completion "
                f"'{self.completion_field}'){cut}")

    def __repr__(self) -> str:
        return f"PromptCompletions({len(self)} pairs in {len(self.files)} files)"
