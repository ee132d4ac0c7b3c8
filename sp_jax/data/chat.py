"""Conversations rendered with a checkpoint's own chat template, trained on the
assistant's tokens only (chat SFT), and preference pairs (DPO) as padded rows.

:class:`ChatTemplate` reads ``chat_template`` from a checkpoint's
``tokenizer_config.json`` (or its ``chat_template.jinja``) and renders a conversation (a
list of ``{"role", "content"}`` messages) as transformers' ``apply_chat_template``
does: Jinja in a sandbox with ``trim_blocks`` / ``lstrip_blocks``, the special tokens of
the tokenizer config as variables (``bos_token``, ``eos_token``, ...), its
``raise_exception``, ``strftime_now`` and ``tojson``; the text is then tokenized with
the special tokens it writes read as such (``tokenizer.encode(text,
add_special_tokens=False)``: the ids ``apply_chat_template(tokenize=True)`` gives).

The assistant's tokens are found by rendering each prefix of the conversation: the
characters between the prefix ending before an assistant message (with the generation
prompt) and the prefix ending with it are that message's turn, as it is written
(content and end-of-turn tokens); a token whose characters lie in a turn is a target
(its label the token itself, at the previous position), every other token's label is
ignored (-100).

:class:`ChatRows` (``--messages-field``) and :class:`PreferenceRows` (``--dpo``:
``prompt``, ``chosen``, ``rejected``) are :class:`~sp_jax.data.TrainData`: one example
per row, padded to ``seq_len`` (cut where longer), the batch of step ``s`` a pure
function of ``(seed, s)``.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jax
import numpy as np

from sp_jax.data.completions import IGNORE
from sp_jax.data.corpus import assemble, rows_held

__all__ = ["ChatRows", "ChatTemplate", "PreferenceRows"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
            "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


class ChatTemplate:
    """A checkpoint's chat template and the tokenizer that reads its special tokens.

    Build it with :meth:`from_checkpoint`. Attributes: ``source`` (the Jinja text),
    ``variables`` (the special tokens passed to it), ``tokenizer`` (a
    ``tokenizers.Tokenizer`` of the checkpoint's ``tokenizer.json``).
    """

    def __init__(self, source: str, variables: Mapping[str, str], tokenizer: Any) -> None:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox

        class Generation(jinja2.ext.Extension):  # {% generation %}: rendered as it is
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_render"), [], [],
                                              body).set_lineno(lineno)

            def _render(self, caller):
                return caller()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source, self.variables, self.tokenizer = source, dict(variables), tokenizer
        self._template = env.from_string(source)

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike,
                        tokenizer_json: str | os.PathLike | None = None) -> ChatTemplate:
        """The chat template of a checkpoint directory: ``chat_template.jinja``, else
        ``tokenizer_config.json``'s ``chat_template`` (its ``"default"`` entry when it is
        a list of named templates), with the special tokens of ``tokenizer_config.json``
        and the tokenizer of ``tokenizer.json`` (or ``tokenizer_json``).

        Raises:
          ValueError: the checkpoint has no chat template (naming the files looked at).
        """
        from tokenizers import Tokenizer

        directory = pathlib.Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        jinja_file = directory / "chat_template.jinja"
        source = jinja_file.read_text() if jinja_file.is_file() else config.get(
            "chat_template")
        if isinstance(source, list):
            source = {t.get("name"): t.get("template") for t in source}.get("default")
        if not source:
            raise ValueError(f"{directory}: no chat template (neither chat_template.jinja nor "
                             "a chat_template in tokenizer_config.json); train on plain "
                             "prompt / completion fields instead (--prompt-field, "
                             "--completion-field).")
        variables = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
        tokenizer = Tokenizer.from_file(str(tokenizer_json or directory / "tokenizer.json"))
        return cls(source, variables, tokenizer)

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = False) -> str:
        """The text of ``messages`` (``apply_chat_template(tokenize=False)``'s)."""
        return self._template.render(messages=list(messages), tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **self.variables)

    def encode(self, text: str) -> list[int]:
        """The ids of rendered text, its special tokens read as such."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def assistant_spans(self, messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, int]]:
        """The character spans of the assistant's turns in :meth:`render`'s text.

        Raises:
          ValueError: a prefix's rendering is not a prefix of the whole (a template
            that rewrites earlier turns, e.g. one that drops reasoning from all but the
            last assistant turn), naming the message.
        """
        full, spans = self.render(messages), []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = len(self.render(messages[:i], add_generation_prompt=True))
            end_text = self.render(messages[:i + 1])
            if not full.startswith(end_text) or start > len(end_text):
                raise ValueError(f"the chat template renders message {i} differently in "
                                 "the whole conversation than after its prefix; its "
                                 "assistant tokens cannot be told apart.")
            spans.append((start, len(end_text)))
        return spans

    def example(self, messages: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        """``{"tokens", "labels"}`` int32 of one conversation: labels aligned with the
        positions (``labels[i]`` the target of position ``i``), the assistant's tokens
        only (:meth:`assistant_spans`)."""
        text = self.render(messages)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, np.int32)
        trained = np.zeros(len(ids), bool)
        for start, end in self.assistant_spans(messages):
            for k, (a, b) in enumerate(encoding.offsets):
                if start <= a and b <= end and b > a:
                    trained[k] = True
        labels = np.full(len(ids), IGNORE, np.int32)
        labels[:-1] = np.where(trained[1:], ids[1:], IGNORE)
        return {"tokens": ids, "labels": labels}


def _pad(rows: list[dict[str, np.ndarray]], seq_len: int, pad_id: int
         ) -> dict[str, np.ndarray]:
    out = {}
    for key in rows[0]:
        fill = IGNORE if "labels" in key else pad_id
        out[key] = np.full((len(rows), seq_len), fill, np.int32)
        for i, row in enumerate(rows):
            n = min(len(row[key]), seq_len)
            out[key][i, :n] = row[key][:n]
    return out


class _Rows:
    """Padded examples ``arrays`` (``name -> [N, seq_len]``), the last
    ``held_out_fraction`` held out: a :class:`~sp_jax.data.TrainData`."""

    def __init__(self, arrays: dict[str, np.ndarray], held_out_fraction: float,
                 what: str) -> None:
        n = len(next(iter(arrays.values())))
        held = max(1, int(round(n * held_out_fraction))) if n > 1 else 0
        if n - held < 1:
            raise ValueError(f"{what}: {n} examples leave none to train on; add data or "
                             "lower --held-out-fraction.")
        self.train = {k: v[:n - held] for k, v in arrays.items()}
        self.held_out = {k: v[n - held:] for k, v in arrays.items()} if held else self.train
        self.seq_len = next(iter(arrays.values())).shape[1]
        self.what = what

    def _batch(self, rows: dict[str, np.ndarray], index: np.ndarray, sharding, axis: int):
        shape = (*index.shape, self.seq_len)
        held = rows_held(sharding, shape, axis)
        out = {}
        for key, values in rows.items():
            local = np.take(values[index.reshape(-1)].reshape(shape), held, axis=axis)
            out[key] = assemble(local, held, shape=shape, sharding=sharding, axis=axis)
        return out

    def train_batch(self, step: int, *, seed: int, batch_size: int, micro_batches: int,
                    sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
        """Batch ``step``: rows of a fresh permutation per epoch of ``(seed, epoch)``."""
        n = len(next(iter(self.train.values())))
        order = []
        first = step * batch_size
        for k in range(first, first + batch_size):
            epoch, i = divmod(k, n)
            order.append(np.random.default_rng([seed, epoch]).permutation(n)[i])
        index = np.asarray(order).reshape(micro_batches, -1)
        return self._batch(self.train, index, sharding, axis=1)

    def held_out_batches(self, count: int, *, batch_size: int,
                         sharding: jax.sharding.Sharding) -> list[dict[str, jax.Array]]:
        n = len(next(iter(self.held_out.values())))
        index = np.arange(count * batch_size) % n
        return [self._batch(self.held_out, i, sharding, axis=0)
                for i in index.reshape(count, batch_size)]

    def summary(self) -> str:
        n = len(next(iter(self.train.values())))
        h = len(next(iter(self.held_out.values())))
        return f"{self.what}: {n} training and {h} held-out examples, padded rows"


class ChatRows(_Rows):
    """Conversations (``messages_field`` of each JSON-lines record: a list of
    ``{"role", "content"}``) rendered by a :class:`ChatTemplate` and trained on the
    assistant's tokens: rows ``{"tokens", "labels"}``."""

    def __init__(self, conversations: Sequence[Sequence[Mapping[str, Any]]],
                 template: ChatTemplate, *, seq_len: int, pad_id: int,
                 held_out_fraction: float = 0.05) -> None:
        examples = [template.example(c) for c in conversations]
        if not examples:
            raise ValueError("ChatRows: no conversations.")
        super().__init__(_pad(examples, seq_len, pad_id), held_out_fraction,
                         "chat conversations (assistant tokens trained)")

    @classmethod
    def from_files(cls, paths, template: ChatTemplate, *, messages_field: str = "messages",
                   **kwargs: Any) -> ChatRows:
        """The conversations of JSON-lines ``paths``' ``messages_field``."""
        return cls(read_field(paths, messages_field, "--messages-field"), template, **kwargs)


class PreferenceRows(_Rows):
    """Preference pairs ``(prompt, chosen, rejected)``, each side ``prompt + completion
    + end of document`` in its row, labels on the completion and the end of document:
    rows ``{"chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels"}``
    (:func:`sp_jax.training.dpo_loss`'s batch). With a ``template`` the prompt (a string,
    or a list of messages) is rendered as a conversation with the generation prompt and
    each completion as the assistant's message."""

    def __init__(self, pairs: Sequence[tuple[Any, Any, Any]], encode, *, eos_id: int,
                 seq_len: int, pad_id: int, template: ChatTemplate | None = None,
                 held_out_fraction: float = 0.05) -> None:
        rows = []
        for prompt, chosen, rejected in pairs:
            row = {}
            for side, completion in (("chosen", chosen), ("rejected", rejected)):
                if template is not None:
                    messages = prompt if isinstance(prompt, list) else [
                        {"role": "user", "content": prompt}]
                    head = template.render(messages, add_generation_prompt=True)
                    whole = template.render([*messages, {"role": "assistant",
                                                         "content": completion}])
                    p = template.encode(head)
                    ids = template.encode(whole)
                else:
                    p = encode(prompt)
                    ids = [*p, *encode(completion), eos_id]
                ids = np.asarray(ids, np.int32)
                labels = np.full(len(ids), IGNORE, np.int32)
                labels[max(len(p) - 1, 0):-1] = ids[len(p):]
                row[f"{side}_tokens"], row[f"{side}_labels"] = ids, labels
            rows.append(row)
        if not rows:
            raise ValueError("PreferenceRows: no pairs.")
        super().__init__(_pad(rows, seq_len, pad_id), held_out_fraction,
                         "preference pairs (DPO)")


def read_field(paths, field: str, flag: str) -> list[Any]:
    """The values of ``field`` in every record of JSON-lines ``paths`` (sorted path order),
    as JSON gives them (a conversation's list of messages); a ValueError naming ``flag``
    for a record without it."""
    from sp_jax.data.sources import expand_paths

    out = []
    for path in expand_paths(paths):
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if field not in record:
                    raise ValueError(f"{path}:{line_no}: no field {field!r} ({flag}); the "
                                     f"record has {sorted(record)}.")
                out.append(record[field])
    if not out:
        raise ValueError(f"{flag}: no records in {paths}.")
    return out
