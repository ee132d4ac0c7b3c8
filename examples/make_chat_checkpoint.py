"""Writes a tiny Hugging Face chat checkpoint and chat data to try LoRA fine-tuning on.

    python examples/make_chat_checkpoint.py --out runs/tiny-chat

``--out`` gets a randomly initialised Llama-shaped model (2 layers, hidden 64, grouped-query
attention; ``config.json`` + ``model.safetensors``, as ``sp_jax.models.hf.to_hf`` writes
it: transformers loads it), a word-level ``tokenizer.json`` (``w0`` ... ``w88``, ``user``,
``assistant``, ``system``, the special tokens ``<pad>``, ``<s>``, ``<|im_start|>`` and
``<|im_end|>``, the end of a turn and the checkpoint's ``eos_token_id``), a
``tokenizer_config.json`` with a ChatML ``chat_template`` (Qwen's), and ``chats.jsonl``:
``--conversations`` conversations (``{"messages": [{"role", "content"}, ...]}``) whose
assistant answers each user word plus one (``w7 w9`` -> ``w8 w10``): something to learn.
Nothing here needs torch or transformers."""

from __future__ import annotations

import sp_jax  # noqa: F401 - first: on a machine without a GPU, JAX then starts quietly

# isort: split
import argparse
import json
import pathlib

import jax
import numpy as np
from flax import nnx

from sp_jax.models import GPT, GPTConfig, hf
from sp_jax.training import cli

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = {"<pad>": 0, "<s>": 1, "<|im_end|>": 2, "<|im_start|>": 3}
VOCAB = {**SPECIAL, "user": 4, "assistant": 5, "system": 6,
         **{f"w{i}": i for i in range(7, 96)}}


def conversation(rng: np.random.Generator) -> list[dict[str, str]]:
    """A user turn of 3-5 words and the assistant's answer (each word + 1), sometimes
    after a system turn."""
    words = rng.integers(7, 60, rng.integers(3, 6))
    turns = [{"role": "user", "content": " ".join(f"w{w}" for w in words)},
             {"role": "assistant", "content": " ".join(f"w{w + 1}" for w in words)}]
    if rng.random() < 0.3:
        turns.insert(0, {"role": "system", "content": "w90 w91"})
    return turns


def write_tokenizer(out: pathlib.Path) -> None:
    """The word-level ``tokenizer.json`` and the ``tokenizer_config.json`` with the chat
    template (``AutoTokenizer.from_pretrained`` loads the directory)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
        "bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>"}, indent=2))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=cli.description(__doc__),
                                formatter_class=cli.HelpFormatter)
    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--conversations", type=int, default=128, metavar="N",
                   help="conversations in chats.jsonl")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    config = GPTConfig.llama("llama-tiny", vocab_size=len(VOCAB), hidden=64, num_layers=2,
                             num_heads=4, num_kv_heads=2, mlp_hidden=128, max_seq_len=64,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
    mesh = jax.make_mesh((1, 1), ("data", "tensor"), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        hf.to_hf(GPT(config, rngs=nnx.Rngs(args.seed)), out)
    write_tokenizer(out)
    rng = np.random.default_rng(args.seed)
    with open(out / "chats.jsonl", "w") as f:
        for _ in range(args.conversations):
            f.write(json.dumps({"messages": conversation(rng)}) + "\n")
    print(f"wrote {out}: a tiny Llama-shaped checkpoint with a ChatML template, and "
          f"{args.conversations} conversations in {out / 'chats.jsonl'}")


if __name__ == "__main__":
    main()
