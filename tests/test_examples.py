"""The examples as subprocesses: the small MLP trains and matches its unsharded twin; a
Hugging Face checkpoint is fine-tuned, written back, and generated from with a
tokenizer.json."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _util import script_env

pytestmark = pytest.mark.slow  # the whole file: make test only, not make test-fast
ROOT = Path(__file__).resolve().parent.parent


def test_train_mlp_matches_unsharded():
    env = script_env()
    out = subprocess.run(
        [sys.executable, "examples/train_mlp.py", "--steps", "6", "--recompute-allgather"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    m = re.search(r"loss (\S+) -> (\S+); max \|SP - unsharded\| over 6 steps: (\S+)", out.stdout)
    assert m, out.stdout
    first, last, diff = (float(v) for v in m.groups())
    assert last < first
    assert diff < 1e-5
    assert "mesh: {'data': 2, 'tensor': 4}" in out.stdout


def test_finetune_hf_continues_a_checkpoint_and_writes_it_back(tmp_path):
    """The Llama fixture (grouped-query) fine-tuned on 2x4 devices: the held-out loss
    drops and the written checkpoint reads back as the same model shape."""
    import json

    import numpy as np
    from safetensors.numpy import load_file

    from sp_jax.models import hf

    fixture = ROOT / "tests" / "fixtures" / "hf" / "llama"
    env = script_env()
    out = subprocess.run(
        [sys.executable, "examples/finetune_hf.py", "--hf-dir", str(fixture), "--mesh", "2,4",
         "--steps", "12", "--seq-len", "32", "--lr", "1e-3", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = re.search(r"held-out loss after 12 steps: (\S+) \(before (\S+)\)", out.stdout)
    assert m, out.stdout
    after, before = float(m.group(1)), float(m.group(2))
    assert after < before - 0.05
    config = json.loads((tmp_path / "config.json").read_text())
    source = json.loads((fixture / "config.json").read_text())
    assert hf.config_from_hf(config) == hf.config_from_hf(source)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    for key in ("model_type", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == source[key], key  # the fixture has all three ids
        assert key == "model_type" or generation[key] == source[key], key
    old, new = load_file(fixture / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert old.keys() == new.keys()
    assert all(old[k].shape == new[k].shape for k in old)
    assert not np.array_equal(old["lm_head.weight"], new["lm_head.weight"])

    # then generate from it with a tokenizer.json (word-level, the fixture's 96 ids)
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(95)}
    tok = Tokenizer(models.WordLevel({**words, "<|endoftext|>": 95}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    out = subprocess.run(
        [sys.executable, "examples/generate.py", "--hf-dir", str(tmp_path), "--tokenizer",
         str(tmp_path / "tokenizer.json"), "--prompt", "w5 w6 w7", "--prompt", "w1",
         "--max-new-tokens", "5", "--ignore-eos", "--mesh", "2,4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("w5 w6 w7 ") and lines[1].startswith("w1 "), out.stdout
    assert [len(line.split()) for line in lines[:2]] == [3 + 5, 1 + 5], out.stdout
    assert "10 tokens in" in lines[2]


@pytest.mark.slow
def test_generate_decodes_a_mixture_of_experts_on_an_expert_mesh():
    """examples/generate.py on the Mixtral fixture with its experts over an expert axis
    (data=1,expert=2,tensor=2): transformers' greedy tokens (the fixture's goldens)."""
    fixture = ROOT / "tests" / "fixtures" / "hf" / "mixtral"
    golden = np.load(fixture / "golden.npz")
    prompts = [golden[f"gen_prompt_{i}"].tolist() for i in (0, 2)]
    out = subprocess.run(
        [sys.executable, "examples/generate.py", "--hf-dir", str(fixture),
         *[a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))],
         "--max-new-tokens", "8", "--ignore-eos", "--mesh", "data=1,expert=2,tensor=2"],
        cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for i, line in zip((0, 2), lines[:2], strict=True):
        assert line.split(" -> ")[1] == ",".join(map(str, golden[f"gen_tokens_{i}"][:8]))
    assert "expert=2" in lines[2], out.stdout
