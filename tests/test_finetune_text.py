"""Fine-tuning a Hugging Face checkpoint on text (issue 40): completion-only labels against
a batch masked by hand, pairs cut off by the row length, the checkpoint's tokenizer checked
against its vocabulary and eos_token_id, the tokenizer files written back, and
examples/finetune_hf.py end to end on the Llama fixture."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
from _util import ROOT, script_env
from tokenizers import Tokenizer, models, pre_tokenizers

from sp_jax.data import ByteTokenizer, PackedText, PromptCompletions
from sp_jax.data.completions import IGNORE
from sp_jax.training import finetune

LLAMA = ROOT / "tests" / "fixtures" / "hf" / "llama"  # vocabulary 96, eos_token_id 2
EOS = ByteTokenizer.eos_id


def _pairs(path, pairs, prompt="q", completion="a"):
    path.write_text("".join(json.dumps({prompt: p, completion: c}) + "\n" for p, c in pairs))
    return path


def _word_tokenizer(path, size=96, eos_id=2):
    """A word-level tokenizer.json: "w<i>" is id i, <|endoftext|> is ``eos_id``."""
    words = {f"w{i}": i for i in range(size) if i != eos_id}
    tok = Tokenizer(models.WordLevel({**words, "<|endoftext|>": eos_id}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


def test_completion_only_labels_match_a_batch_masked_by_hand(tmp_path):
    """Two held-out pairs first-fit packed into one row: the labels that predict prompt
    tokens are ignored, those of the completion and its end of document kept."""
    data = _pairs(tmp_path / "sft.jsonl",
                  [("zzzz", "y")] * 8 + [("ab", "c"), ("x", "yz")])
    packed = PackedText.from_files(data, tokenizer=ByteTokenizer(), seq_len=12,
                                   held_out_fraction=0.2, prompt_field="q",
                                   completion_field="a")
    row = packed.held_out_rows(1)
    a, b, c, x, y, z = (ord(ch) for ch in "abcxyz")
    tokens = [a, b, c, EOS, x, y, z, EOS, 0, 0, 0, 0]
    # by hand: label i is token i + 1 of the same pair where that token is no prompt token
    labels = [IGNORE, c, EOS, IGNORE, y, z, EOS, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]
    np.testing.assert_array_equal(row["tokens"][0], tokens)
    np.testing.assert_array_equal(row["labels"][0], labels)
    np.testing.assert_array_equal(row["segment_ids"][0], [1] * 4 + [2] * 4 + [0] * 4)
    np.testing.assert_array_equal(row["positions"][0], [0, 1, 2, 3] * 2 + [0] * 4)
    # the same pairs as plain documents train every next token of the document
    plain = PackedText.from_files(_pairs(tmp_path / "plain.jsonl", [("", "zzzz" "y")] * 8
                                         + [("", "abc"), ("", "xyz")]),
                                  tokenizer=ByteTokenizer(), seq_len=12,
                                  held_out_fraction=0.2, text_field="a")
    np.testing.assert_array_equal(plain.held_out_rows(1)["labels"][0][:8],
                                  [b, c, EOS, IGNORE, y, z, EOS, IGNORE])
    # training rows: every kept label is a completion token or the end of document
    rows = packed.rows(1, range(4), seed=0, batch_size=4)
    kept = rows["labels"][rows["labels"] != IGNORE]
    assert set(kept.tolist()) == {ord("y"), EOS}


def test_pairs_cut_off_by_seq_len_are_counted_and_none_left_is_an_error(tmp_path):
    data = _pairs(tmp_path / "sft.jsonl",
                  [("abcd", "e"), ("abc", "de"), ("a", "b"), ("ab", "c")])
    pairs = PromptCompletions.from_paths(data, prompt_field="q", completion_field="a")
    fitted = pairs.fit(ByteTokenizer(), 4)
    assert (len(fitted), fitted.dropped, fitted.shortened) == (3, 1, 1)
    packed = PackedText(pairs, tokenizer=ByteTokenizer(), seq_len=4, held_out_fraction=0.3)
    assert "1 pairs dropped (the prompt fills all 4 positions), 1 cut to 4" in packed.summary()
    assert fitted[0] == ("abc", "de")
    with pytest.raises(ValueError, match=r"every one of the 4 prompts .* fills the 1 "
                                         r"positions of a row \(--seq-len 1\): no completion"):
        pairs.fit(ByteTokenizer(), 1)


def test_a_missing_field_names_the_file_line_and_flag(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text('{"q": "a", "a": "b"}\n\n{"q": "c", "answer": "d"}\n')
    with pytest.raises(ValueError, match=r"sft.jsonl:3: no field 'a' .*pass "
                                         r"--completion-field naming"):
        PromptCompletions.from_paths(data, prompt_field="q", completion_field="a")
    with pytest.raises(ValueError, match=r"sft.jsonl:1: no field 'p' .*--prompt-field"):
        PromptCompletions.from_paths(data, prompt_field="p", completion_field="a")


def test_a_small_held_out_set_is_reused_with_a_warning(tmp_path):
    data = _pairs(tmp_path / "docs.jsonl", [("", f"doc {i}") for i in range(30)])
    packed = PackedText.from_files(data, tokenizer=ByteTokenizer(), seq_len=16, text_field="a")
    with pytest.warns(UserWarning, match=r"the 1 held-out documents fill 1 rows .* fewer "
                                         r"than the 5 asked for .*--held-out-fraction"):
        rows = packed.held_out_rows(5)
    assert all(np.array_equal(rows["tokens"][0], rows["tokens"][i]) for i in range(5))


def test_the_checkpoint_tokenizer_is_checked_against_vocabulary_and_eos(tmp_path):
    config = json.loads((LLAMA / "config.json").read_text())
    ckpt = tmp_path / "ckpt"
    shutil.copytree(LLAMA, ckpt)
    with pytest.raises(ValueError, match=r"tokenizer.json: no such file.*--tokenizer PATH"):
        finetune.checkpoint_tokenizer(ckpt, config)
    tok = finetune.checkpoint_tokenizer(ckpt, config, path=str(_word_tokenizer(
        tmp_path / "ok.json")))
    assert (tok.eos_id, tok.eos_token, tok.vocab_size) == (2, "<|endoftext|>", 96)
    with pytest.raises(ValueError, match=r"has 200 ids but the checkpoint .* embeds 96 "
                                         r"\(vocab_size in config.json\)"):
        finetune.checkpoint_tokenizer(ckpt, config, path=str(_word_tokenizer(
            tmp_path / "big.json", size=200)))
    with pytest.raises(ValueError, match=r"ends documents with '<\|endoftext\|>' \(id 0\) "
                                         r"but the checkpoint's eos_token_id is 2 .*pass "
                                         r"--eos-token 'w2'"):
        finetune.checkpoint_tokenizer(ckpt, config, path=str(_word_tokenizer(
            tmp_path / "eos0.json", eos_id=0)))


def test_the_tokenizer_files_load_and_encode_the_same(tmp_path):
    from sp_jax.data import load_tokenizer

    tok = load_tokenizer(_word_tokenizer(tmp_path / "tokenizer.json"))
    out = tmp_path / "out"
    written = finetune.save_tokenizer(tok, out, max_seq_len=64)
    assert written == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == "<|endoftext|>" and config["model_max_length"] == 64
    again = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert again.encode("w5 w6 w7").ids == tok.encode("w5 w6 w7") == [5, 6, 7]


def test_the_data_flags_are_checked_by_name():
    def args(**kw):
        base = {"prompt_field": None, "completion_field": None, "held_out_fraction": 0.05,
                "seq_len": None, "tokenizer": None, "eos_token": None, "data": None}
        return argparse.Namespace(**{**base, **kw})

    for kw, message in [({"prompt_field": "q"}, "--prompt-field and --completion-field go"),
                        ({"held_out_fraction": 1.0}, "--held-out-fraction 1.0 must be in"),
                        ({"tokenizer": "t.json", "data": ["ids.npy"]},
                         "--tokenizer needs --data naming text")]:
        with pytest.raises(ValueError, match=message):
            finetune.check_data_args(args(**kw))
    assert finetune.seq_len_for(args(), 64) == 64 and finetune.seq_len_for(args(), 512) == 128
    with pytest.raises(ValueError, match="--seq-len 128 exceeds the model's 64 positions"):
        finetune.seq_len_for(args(seq_len=128), 64)


@pytest.mark.slow
def test_finetune_hf_trains_completions_of_a_jsonl_and_writes_the_tokenizer(tmp_path):
    """The README's path: the Llama fixture (64 positions) with its tokenizer.json and 30
    JSON lines, the default --seq-len and evaluation settings, completions only."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(LLAMA, ckpt)
    _word_tokenizer(ckpt / "tokenizer.json")
    rng = np.random.default_rng(0)
    pairs = [(" ".join(f"w{s + j}" for j in range(3)), " ".join(f"w{s + 50 + j}"
                                                               for j in range(3)))
             for s in rng.integers(3, 40, 30)]
    data = _pairs(tmp_path / "sft.jsonl", pairs)
    out = tmp_path / "out"
    with warnings.catch_warnings():
        run = subprocess.run(
            [sys.executable, "examples/finetune_hf.py", "--hf-dir", str(ckpt), "--data",
             str(data), "--prompt-field", "q", "--completion-field", "a", "--steps", "8",
             "--lr", "3e-3", "--mesh", "2,4", "--no-progress", "--out", str(out)],
            cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "completions only (prompt 'q', completion 'a')" in run.stdout
    assert "--seq-len 64" in run.stdout
    m = re.search(r"held-out loss after 8 steps: (\S+) \(before (\S+)\); perplexity (\S+) "
                  r"\(before (\S+)\)", run.stdout)
    assert m, run.stdout
    after, before, ppl, ppl_before = map(float, m.groups())
    assert after < before and np.isclose(ppl, np.exp(after), rtol=1e-3)
    assert np.isclose(ppl_before, np.exp(before), rtol=1e-3)
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).is_file(), name
    assert (Tokenizer.from_file(str(out / "tokenizer.json")).encode(pairs[0][0]).ids
            == Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(pairs[0][0]).ids)

    # then examples/generate.py decodes text with the tokenizer.json found in --out
    gen = subprocess.run(
        [sys.executable, "examples/generate.py", "--hf-dir", str(out), "--prompt",
         pairs[0][0], "--max-new-tokens", "4", "--ignore-eos", "--mesh", "1,4"],
        cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    words = gen.stdout.splitlines()[0].split()
    assert words[:3] == pairs[0][0].split() and len(words) == 3 + 4, gen.stdout
    assert all(re.fullmatch(r"w\d+|<\|endoftext\|>", w) for w in words), gen.stdout


def _generate_example():
    """examples/generate.py as a module, its flags parsed in-process (before JAX starts)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_flags",
                                                  ROOT / "examples" / "generate.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_generate_finds_the_checkpoint_tokenizer_for_text_prompts(tmp_path, capsys):
    """``--prompt`` without ``--tokenizer`` takes the tokenizer.json beside config.json;
    ``--tokenizer`` still wins; a directory without one is a usage error naming the fix."""
    example = _generate_example()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(LLAMA, ckpt)
    with pytest.raises(SystemExit) as e:
        example.parse(["--hf-dir", str(ckpt), "--prompt", "w1 w2"])
    assert e.value.code == 2
    assert f"--hf-dir {ckpt} has no tokenizer.json; pass --tokenizer" in capsys.readouterr().err
    _word_tokenizer(ckpt / "tokenizer.json")
    args = example.parse(["--hf-dir", str(ckpt), "--prompt", "w1 w2"])
    assert args.tokenizer == str(ckpt / "tokenizer.json")
    assert example.parse(["--hf-dir", str(ckpt), "--prompt", "w1", "--tokenizer",
                          "bytes"]).tokenizer == "bytes"
    assert example.parse(["--hf-dir", str(ckpt), "--prompt-ids", "1,2"]).tokenizer is None
