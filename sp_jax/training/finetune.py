"""Fine-tuning a Hugging Face checkpoint on text: the data flags of
``examples/finetune_hf.py`` and what they build.

:func:`add_data_arguments` adds ``--data`` (token ids, or text / JSON lines / parquet),
``--tokenizer``, ``--eos-token``, ``--text-field``, ``--prompt-field`` /
``--completion-field``, ``--packing``, ``--held-out-fraction`` and ``--seq-len``;
:func:`check_data_args` checks them (``ValueError`` naming the flags);
:func:`checkpoint_tokenizer` loads the checkpoint's own ``tokenizer.json`` (or
``--tokenizer``), checked against the checkpoint's vocabulary and ``eos_token_id``;
:func:`load_data` builds the :class:`~sp_jax.data.TrainData`; :func:`save_tokenizer`
writes the tokenizer files beside a written checkpoint, so that transformers'
``AutoTokenizer`` loads the directory.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

from sp_jax.config import LORA_BASE_DTYPES, LORA_TARGETS
from sp_jax.data import TokenIds, TrainData
from sp_jax.training.cli import check_text_args

__all__ = ["TOKENIZER_FILES", "add_adapter_arguments", "add_data_arguments", "check_adapter_args",
           "lora_config", "checkpoint_eos_ids", "checkpoint_tokenizer",
           "check_data_args", "is_token_ids", "load_data", "save_tokenizer", "seq_len_for"]

TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")
"""Files beside a ``tokenizer.json`` copied with it (those that exist)."""

DEFAULT_SEQ_LEN = 128


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the group "checkpoint and data": ``--hf-dir --data --tokenizer --eos-token
    --text-field --prompt-field --completion-field --packing --held-out-fraction --seq-len``."""
    add = parser.add_argument_group("checkpoint and data").add_argument
    add("--hf-dir", required=True, help="Hugging Face checkpoint directory")
    add("--data", nargs="+", default=None, metavar="PATH",
        help="a .npy / uint16 .bin of token ids, or text, JSON lines and parquet files "
             "(paths or quoted globs), tokenized with the checkpoint's tokenizer.json "
             "(default: synthetic sequences)")
    add("--tokenizer", default=None, metavar="JSON",
        help="the tokenizer.json for text --data (default: the one in --hf-dir)")
    add("--eos-token", default=None, metavar="TOKEN",
        help="the tokenizer's end-of-document token (default: the checkpoint's "
             "eos_token_id, else <|endoftext|>, </s>, ...)")
    add("--text-field", default=None,
        help="JSON lines field / parquet column of the text (default: text)")
    add("--prompt-field", default=None, metavar="P",
        help="with --completion-field: train on the completions only (prompt labels ignored)")
    add("--completion-field", default=None, metavar="C", help="see --prompt-field")
    add("--packing", default="first_fit", choices=("first_fit", "concat"),
        help="first-fit (pads, documents whole) or concatenate-then-split")
    add("--held-out-fraction", type=float, default=0.05, metavar="F",
        help="the share of the data (the last documents or ids) held out for evaluation")
    add("--seq-len", type=int, default=None,
        help=f"tokens per sequence (default: {DEFAULT_SEQ_LEN}, or the model's positions "
             "when fewer)")
    add("--messages-field", default=None, metavar="FIELD",
        help="JSON lines field of a conversation (a list of {role, content}): rendered with "
             "the checkpoint's chat_template, trained on the assistant's tokens only")


def add_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the group "adapters and preferences": ``--lora-rank --lora-alpha
    --lora-targets --base-dtype --merge-lora --dpo --dpo-beta``."""
    add = parser.add_argument_group("adapters (LoRA) and preferences (DPO)").add_argument
    add("--lora-rank", type=int, default=None, metavar="R",
        help="train LoRA adapters of rank R on a frozen base (sp_jax.LoRAConfig); --out "
             "then writes a PEFT adapter (adapter_config.json, adapter_model.safetensors)")
    add("--lora-alpha", type=float, default=None, metavar="A",
        help="the adapters' scale numerator, scale = A / R (default: 2 R)")
    add("--lora-targets", nargs="+", default=None, choices=LORA_TARGETS, metavar="T",
        help=f"the linear layers adapted, among {' '.join(LORA_TARGETS)} (default: all)")
    add("--base-dtype", default=None, choices=LORA_BASE_DTYPES,
        help="store the frozen base as bf16, int8, nf4 or fp8 (QLoRA; default: the "
             "checkpoint's dtype)")
    add("--merge-lora", action="store_true",
        help="with --out: write the model with the adapters merged into its weights "
             "instead of the adapter alone")
    add("--dpo", action="store_true",
        help="preference training (DPO): --data JSON lines of prompt, chosen, rejected")
    add("--dpo-beta", type=float, default=0.1, metavar="B",
        help="DPO's beta (TRL's default 0.1)")


def check_adapter_args(args: argparse.Namespace) -> None:
    """Checks the adapter and preference flags.

    Raises:
      ValueError: naming the flags: ``--lora-alpha`` / ``--lora-targets`` /
        ``--base-dtype`` / ``--merge-lora`` without ``--lora-rank``, a rank below 1,
        ``--dpo`` without JSON-lines ``--data`` or with ``--prompt-field`` /
        ``--messages-field``, a ``--dpo-beta`` that is not positive.
    """
    if args.lora_rank is None:
        given = [f for f, v in (("--lora-alpha", args.lora_alpha),
                                ("--lora-targets", args.lora_targets),
                                ("--base-dtype", args.base_dtype),
                                ("--merge-lora", args.merge_lora or None)) if v is not None]
        if given:
            raise ValueError(f"{given[0]} needs --lora-rank R (the adapters it sets up)")
    elif args.lora_rank < 1:
        raise ValueError(f"--lora-rank {args.lora_rank} must be at least 1")
    if args.dpo:
        if not args.data or is_token_ids(args.data):
            raise ValueError("--dpo needs --data naming JSON lines of prompt, chosen and "
                             "rejected")
        clash = [f for f, v in (("--prompt-field", args.prompt_field),
                                ("--messages-field", args.messages_field)) if v is not None]
        if clash:
            raise ValueError(f"--dpo reads prompt, chosen and rejected; drop {clash[0]}")
        if not args.dpo_beta > 0:
            raise ValueError(f"--dpo-beta {args.dpo_beta} must be positive")
        if args.lora_rank is None:
            raise ValueError("--dpo needs --lora-rank R: the reference model is the frozen "
                             "base (the adapters switched off), no second copy of the "
                             "weights")


def lora_config(args: argparse.Namespace):
    """The :class:`~sp_jax.LoRAConfig` of ``--lora-rank`` (None without it)."""
    if args.lora_rank is None:
        return None
    from sp_jax.config import LoRAConfig

    return LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha or 2.0 * args.lora_rank,
                      targets=tuple(args.lora_targets or LORA_TARGETS),
                      base_dtype=args.base_dtype)


def is_token_ids(data: list[str] | None) -> bool:
    """Whether ``--data`` names a file of token ids (one ``.npy`` or ``.bin``)."""
    return bool(data) and len(data) == 1 and data[0].lower().endswith((".npy", ".bin"))


def check_data_args(args: argparse.Namespace) -> None:
    """Checks the data flags.

    Raises:
      ValueError: naming the flags: ``--prompt-field`` without ``--completion-field``
        (or the other way), text flags with token ids or without ``--data``, a
        ``--held-out-fraction`` outside (0, 1), a ``--seq-len`` below 1; a missing
        ``--tokenizer`` file, a ``--text-field`` without JSON-lines or parquet ``--data``
        (:func:`~sp_jax.training.cli.check_text_args`).
    """
    messages = getattr(args, "messages_field", None)
    if messages is not None and (args.prompt_field or getattr(args, "text_field", None)):
        raise ValueError("--messages-field reads whole conversations; drop --prompt-field / "
                         "--completion-field / --text-field")
    if messages is not None and (not args.data or is_token_ids(args.data)):
        raise ValueError("--messages-field needs --data naming JSON lines files")
    if (args.prompt_field is None) != (args.completion_field is None):
        raise ValueError("--prompt-field and --completion-field go together: give both "
                         "(the JSON fields / parquet columns of the prompt and the completion)")
    if not 0 < args.held_out_fraction < 1:
        raise ValueError(f"--held-out-fraction {args.held_out_fraction} must be in (0, 1)")
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len {args.seq_len} must be positive")
    text_only = [f for f, v in (("--tokenizer", args.tokenizer), ("--eos-token", args.eos_token),
                                ("--prompt-field", args.prompt_field)) if v is not None]
    if text_only and (not args.data or is_token_ids(args.data)):
        raise ValueError(f"{text_only[0]} needs --data naming text, JSON lines or parquet "
                         "files (token ids are already tokenized)")
    check_text_args(args, byte_tokenizer=False)  # --tokenizer's file, --text-field's files


def seq_len_for(args: argparse.Namespace, max_seq_len: int) -> int:
    """``--seq-len``, or :data:`DEFAULT_SEQ_LEN` capped at the model's positions.

    Raises:
      ValueError: ``--seq-len`` exceeds the model's positions.
    """
    if args.seq_len is None:
        return min(DEFAULT_SEQ_LEN, max_seq_len)
    if args.seq_len > max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's {max_seq_len} "
                         f"positions; pass --seq-len {max_seq_len} or fewer")
    return args.seq_len


def checkpoint_eos_ids(hf_dir: str | os.PathLike) -> list[int]:
    """The checkpoint's ``eos_token_id`` (``config.json``, else ``generation_config.json``),
    as a list (Llama 3 lists several); empty when neither says."""
    for name in ("config.json", "generation_config.json"):
        path = pathlib.Path(hf_dir, name)
        eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        if eos is not None:
            return [int(i) for i in (eos if isinstance(eos, list) else [eos])]
    return []


def checkpoint_tokenizer(hf_dir: str | os.PathLike, hf_config: Mapping[str, Any], *,
                         path: str | None = None, eos_token: str | None = None):
    """The tokenizer of a fine-tuning run: ``path`` (``--tokenizer``) or ``hf_dir``'s
    ``tokenizer.json``, its end of document the checkpoint's ``eos_token_id`` where that is
    one of the tokenizer's special tokens (else ``eos_token``, else the first of
    :data:`~sp_jax.data.tokenizer.EOS_CANDIDATES`).

    Raises:
      ValueError: no tokenizer file; more ids than the checkpoint's ``vocab_size``; an
        end-of-document id other than the checkpoint's ``eos_token_id`` (naming both
        and the fix).
    """
    from sp_jax.data import load_tokenizer

    file = path or os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(file):
        raise ValueError(f"{file}: no such file; text --data is tokenized with the "
                         "checkpoint's own tokenizer.json: copy it into --hf-dir or pass "
                         "--tokenizer PATH")
    eos_ids = checkpoint_eos_ids(hf_dir)
    tok = load_tokenizer(file, eos_token=eos_token) if eos_token or not eos_ids else None
    if tok is None:  # the checkpoint's eos where the tokenizer has it as a special token
        from tokenizers import Tokenizer

        special = {i: t.content for i, t in
                   Tokenizer.from_file(file).get_added_tokens_decoder().items() if t.special}
        found = next((special[i] for i in eos_ids if i in special), None)
        tok = load_tokenizer(file, eos_token=found)
    vocab = int(hf_config["vocab_size"])
    if tok.vocab_size > vocab:
        raise ValueError(f"tokenizer {file} has {tok.vocab_size} ids but the checkpoint "
                         f"{hf_dir} embeds {vocab} (vocab_size in config.json): its ids "
                         f"{vocab} and above have no embedding; pass --tokenizer with the "
                         "checkpoint's own tokenizer.json (at most that many ids)")
    if eos_ids and tok.eos_id not in eos_ids:
        shown = eos_ids[0] if len(eos_ids) == 1 else eos_ids
        has = tok.tokenizer.id_to_token(eos_ids[0])
        hint = (f"pass --eos-token {has!r} (the tokenizer's id {eos_ids[0]}) if it ends "
                "documents, " if has is not None else "")
        raise ValueError(f"tokenizer {file} ends documents with {tok.eos_token!r} (id "
                         f"{tok.eos_id}) but the checkpoint's eos_token_id is {shown} "
                         f"({hf_dir}/config.json): training would end documents with "
                         f"{tok.eos_id} and generation stop at {shown}; {hint}use the "
                         "checkpoint's own tokenizer (--tokenizer), or set eos_token_id "
                         f"{tok.eos_id} in its config.json and generation_config.json")
    return tok


def load_data(args: argparse.Namespace, hf_config: Mapping[str, Any], *, seq_len: int,
              vocab_size: int) -> tuple[TrainData, Any]:
    """``--data`` as :class:`~sp_jax.data.TokenIds` (a ``.npy`` / ``.bin``), synthetic
    ids (none), or :class:`~sp_jax.data.PackedText` of text tokenized by
    :func:`checkpoint_tokenizer` (completions only with ``--prompt-field``); and the
    tokenizer (None for ids).

    Raises:
      ValueError: as :func:`checkpoint_tokenizer` and the data sources raise.
    """
    held = args.held_out_fraction
    if not args.data:
        return TokenIds.synthetic(vocab_size, seq_len=seq_len, seed=args.seed,
                                  held_out_fraction=held), None
    if is_token_ids(args.data):
        return TokenIds.from_file(args.data[0], seq_len=seq_len, vocab_size=vocab_size,
                                  held_out_fraction=held), None
    from sp_jax.data import PackedText

    tok = checkpoint_tokenizer(args.hf_dir, hf_config, path=args.tokenizer,
                               eos_token=args.eos_token)
    if getattr(args, "messages_field", None) or getattr(args, "dpo", False):
        return _rows(args, tok, seq_len), tok
    return PackedText.from_files(args.data, tokenizer=tok, seq_len=seq_len,
                                 text_field=args.text_field, packing=args.packing,
                                 held_out_fraction=held, prompt_field=args.prompt_field,
                                 completion_field=args.completion_field), tok


def _rows(args: argparse.Namespace, tok: Any, seq_len: int) -> Any:
    """Chat conversations (``--messages-field``) or preference pairs (``--dpo``) as padded
    rows (:mod:`sp_jax.data.chat`), rendered with the checkpoint's chat template where
    it has one (conversations need it)."""
    from sp_jax.data.chat import ChatRows, ChatTemplate, PreferenceRows, read_field

    held, pad = args.held_out_fraction, tok.eos_id
    template = None
    try:
        template = ChatTemplate.from_checkpoint(args.hf_dir, tokenizer_json=tok.name)
    except ValueError:
        if not args.dpo:
            raise
    if not args.dpo:
        return ChatRows.from_files(args.data, template, messages_field=args.messages_field,
                                   seq_len=seq_len, pad_id=pad, held_out_fraction=held)
    pairs = list(zip(*(read_field(args.data, f, "--dpo") for f in ("prompt", "chosen",
                                                                  "rejected")),
                     strict=True))
    return PreferenceRows(pairs, tok.encode, eos_id=tok.eos_id, seq_len=seq_len, pad_id=pad,
                          template=template, held_out_fraction=held)


def save_tokenizer(tokenizer: Any, out: str | os.PathLike, *, max_seq_len: int) -> list[str]:
    """Writes ``tokenizer``'s ``tokenizer.json`` into ``out`` with the files beside it
    (:data:`TOKENIZER_FILES`) and, where it has none, a ``tokenizer_config.json``
    (``PreTrainedTokenizerFast``, its end-of-document token, ``model_max_length``) and
    ``special_tokens_map.json``: what transformers' ``AutoTokenizer`` loads.

    Returns:
      The names written.
    """
    out, source = pathlib.Path(out), pathlib.Path(tokenizer.name)
    out.mkdir(parents=True, exist_ok=True)
    written = ["tokenizer.json"]
    if source.resolve() != (out / "tokenizer.json").resolve():
        shutil.copyfile(source, out / "tokenizer.json")
    for name in TOKENIZER_FILES:
        if (source.parent / name).is_file() and source.parent.resolve() != out.resolve():
            shutil.copyfile(source.parent / name, out / name)
            written.append(name)
    if not (out / "tokenizer_config.json").is_file():
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "eos_token": tokenizer.eos_token, "model_max_length": max_seq_len,
                  "clean_up_tokenization_spaces": False, "add_bos_token": False}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        written.append("tokenizer_config.json")
    if not (out / "special_tokens_map.json").is_file():
        (out / "special_tokens_map.json").write_text(
            json.dumps({"eos_token": tokenizer.eos_token}, indent=2) + "\n")
        written.append("special_tokens_map.json")
    return written
