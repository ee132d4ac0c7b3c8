"""Chat SFT with LoRA from the command line: a checkpoint's own ``chat_template`` rendered
as transformers' ``apply_chat_template`` renders it (the same ids), the assistant's tokens
the only targets; ``examples/finetune_hf.py --lora-rank 8 --messages-field messages``
lowers the held-out loss and writes a PEFT adapter that ``peft`` loads onto the base and
generates the same greedy tokens as sp_jax; ``--dpo`` trains on preference pairs."""

import json
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from _util import ROOT, script_env
from conftest import make_mesh

from examples.make_chat_checkpoint import VOCAB, conversation, write_tokenizer
from sp_jax.data.chat import ChatRows, ChatTemplate, PreferenceRows
from sp_jax.data.completions import IGNORE

pytestmark = pytest.mark.slow

FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama"  # vocabulary 96, eos 2, bos 1


def _checkpoint(path):
    """The Llama fixture (transformers-made) with make_chat_checkpoint.py's word-level
    tokenizer (its end of turn <|im_end|> the checkpoint's eos, 2) and ChatML template."""
    shutil.copytree(FIXTURE, path)
    write_tokenizer(path)
    return path


def _chats(path, n=64, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"messages": conversation(rng)}) + "\n")
    return path


def test_the_chat_template_renders_transformers_ids_and_trains_the_assistant(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    template = ChatTemplate.from_checkpoint(ckpt)
    rng = np.random.default_rng(1)
    messages = conversation(rng)[:2] + [{"role": "user", "content": "w9"},
                                        {"role": "assistant", "content": "w10 w11"}]
    example = template.example(messages)
    tokens, labels = example["tokens"], example["labels"]
    # the targets: each assistant turn's words and its end of turn, nothing else
    targets = [int(t) for t in labels if t != IGNORE]
    answer = [VOCAB[w] for w in messages[1]["content"].split()] + [2] + \
        [VOCAB["w10"], VOCAB["w11"], 2]
    assert targets == answer
    assert np.array_equal(labels[:-1][labels[:-1] != IGNORE], tokens[1:][labels[:-1] != IGNORE])
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert template.render(messages) == hf_tok.apply_chat_template(messages, tokenize=False)
    ids = hf_tok.apply_chat_template(messages, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(tokens) == list(ids)
    head = hf_tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert template.render(messages[:1], add_generation_prompt=True) == head


def test_rows_and_pairs_batches(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    template = ChatTemplate.from_checkpoint(ckpt)
    rows = ChatRows.from_files(_chats(tmp_path / "c.jsonl", 10), template, seq_len=32,
                               pad_id=0, held_out_fraction=0.2)
    mesh = make_mesh(2, 1)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
    a = rows.train_batch(3, seed=0, batch_size=4, micro_batches=2, sharding=sharding)
    b = rows.train_batch(3, seed=0, batch_size=4, micro_batches=2, sharding=sharding)
    assert a["tokens"].shape == (2, 2, 32)
    np.testing.assert_array_equal(np.asarray(a["labels"]), np.asarray(b["labels"]))
    pairs = PreferenceRows([("w7 w8", "w9", "w10 w11"), ("w20", "w21", "w22")],
                           None, eos_id=2, seq_len=16, pad_id=0, template=template,
                           held_out_fraction=0.5)
    chosen = pairs.train["chosen_labels"][0]
    assert [int(t) for t in chosen if t != IGNORE] == [VOCAB["w9"], 2]
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate.from_checkpoint(FIXTURE, tokenizer_json=ckpt / "tokenizer.json")


def _finetune(*flags, timeout=600):
    out = subprocess.run([sys.executable, "examples/finetune_hf.py", *flags], cwd=ROOT,
                         env=script_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_lora_chat_sft_lowers_the_loss_and_peft_generates_the_same(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    data = _chats(tmp_path / "chats.jsonl", 96)
    stdout = _finetune("--hf-dir", str(ckpt), "--mesh", "2,2", "--lora-rank", "8",
                       "--messages-field", "messages", "--data", str(data), "--steps", "30",
                       "--seq-len", "32", "--lr", "1e-2", "--batch-size", "8",
                       "--no-dropout", "--out", str(tmp_path / "adapter"))
    assert "LoRA rank 8, alpha 16 on q k v o gate up down" in stdout, stdout
    m = re.search(r"held-out loss after 30 steps: (\S+) \(before (\S+)\)", stdout)
    assert m, stdout
    after, before = float(m.group(1)), float(m.group(2))
    assert after < before - 0.1, stdout
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["base_model_name_or_path"] == str(ckpt.resolve())

    # sp_jax: the base with the adapter read back, greedy decoding of a new conversation
    from sp_jax.models import generate, hf

    template = ChatTemplate.from_checkpoint(ckpt)
    prompt = template.encode(template.render([{"role": "user", "content": "w20 w21 w22"}],
                                             add_generation_prompt=True))
    with jax.set_mesh(make_mesh(2, 2)):
        model = hf.from_peft(hf.from_hf(ckpt), tmp_path / "adapter")
        ours = np.asarray(generate(model, [prompt], max_new_tokens=6,
                                   eos_token_id=None).tokens)[0]
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs = out[0, len(prompt):].numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_dpo_from_the_command_line(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    rng = np.random.default_rng(2)
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for _ in range(96):
            words = rng.integers(7, 60, 3)
            f.write(json.dumps({"prompt": " ".join(f"w{w}" for w in words),
                                "chosen": " ".join(f"w{w + 1}" for w in words),
                                "rejected": " ".join(f"w{w + 2}" for w in words)}) + "\n")
    stdout = _finetune("--hf-dir", str(ckpt), "--mesh", "2,2", "--lora-rank", "4", "--dpo",
                       "--dpo-beta", "1.0", "--data", str(tmp_path / "pairs.jsonl"),
                       "--steps", "20", "--seq-len", "16", "--lr", "2e-2", "--batch-size", "8",
                       "--no-dropout", "--held-out-fraction", "0.2", "--eval-batches", "4",
                       "--out", str(tmp_path / "adapter"))
    m = re.search(r"held-out loss after 20 steps: (\S+) \(before (\S+)\)", stdout)
    assert m, stdout
    after, before = float(m.group(1)), float(m.group(2))
    assert before == pytest.approx(np.log(2), rel=1e-3)  # policy = reference at the start
    assert after < before - 0.05, stdout


@pytest.mark.parametrize("flags,message", [
    (["--lora-alpha", "8"], "--lora-alpha needs --lora-rank"),
    (["--lora-rank", "0"], "--lora-rank 0 must be at least 1"),
    (["--dpo", "--lora-rank", "4"], "--dpo needs --data"),
    (["--dpo", "--data", "x.jsonl"], "--dpo needs --lora-rank"),
    (["--messages-field", "m"], "--messages-field needs --data"),
])
def test_adapter_flags_are_checked_by_name(flags, message):
    out = subprocess.run([sys.executable, "examples/finetune_hf.py", "--hf-dir", str(FIXTURE),
                          *flags], cwd=ROOT, env=script_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr
