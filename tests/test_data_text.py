"""sp_jax.data's text pipeline: documents from text / JSON lines / parquet files and their
errors, tokenizers (bytes, a trained byte-level BPE), and PackedText: rows whose segments,
positions and labels agree with the documents, every document read once per epoch, the
same global rows for any set of rows a process holds, resumable at any step."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax.data import (
    ByteTokenizer,
    Documents,
    PackedText,
    TrainData,
    check_vocab,
    load_tokenizer,
    merge_states,
    packing_efficiency,
)
from sp_jax.data.packed import IGNORE, KEYS
from sp_jax.data.tokenizer import main as tokenizer_main

EOS = ByteTokenizer.eos_id


def _jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _texts(count, seed=0, mean_log=3.0, longest=200):
    """``count`` distinct documents of log-normal lengths (ASCII: one byte per char)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean_log, 1.0, count), 1, longest).astype(int)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)
    return [f"<{i}>" + bytes(rng.choice(letters, n)).decode() for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSON-lines corpus of 120 documents, 4 .. ~200 bytes (some longer than a row)."""
    return _jsonl(tmp_path_factory.mktemp("corpus") / "docs.jsonl",
                  [{"text": t} for t in _texts(120)])


def _packed(corpus, **kw):
    kw = {"tokenizer": ByteTokenizer(), "seq_len": 32, **kw}
    return PackedText.from_files(corpus, **kw)


# -- sources ------------------------------------------------------------------------------

def test_documents_from_text_jsonl_parquet_and_globs(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.txt").write_text("first file\n")
    (tmp_path / "a" / "empty.txt").write_text("")  # not a document
    (tmp_path / "a" / "deep").mkdir()
    (tmp_path / "a" / "deep" / "two.txt").write_text("second file")
    (tmp_path / "b.jsonl").write_text('{"text": "j1", "id": 1}\n\n{"text": "j2"}\r\n'
                                      '{"text": ""}')  # blank line skipped, no final newline
    table = pa.table({"body": ["p0", "p1", "p2"], "n": [0, 1, 2]})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=2)
    docs = Documents.from_paths([str(tmp_path / "a" / "**" / "*.txt"), str(tmp_path / "b.jsonl"),
                                 str(tmp_path / "a" / "one.txt")], text_field="text")
    assert [docs[i] for i in range(len(docs))] == [
        "second file", "first file\n", "j1", "j2", ""]  # sorted paths, one.txt once
    assert docs.location(3) == f"{tmp_path / 'b.jsonl'}:3"
    assert len(docs.files) == 4  # empty.txt is a file without documents
    parquet = Documents.from_paths(str(tmp_path / "*.parquet"), text_field="body")
    assert [parquet[i] for i in range(len(parquet))] == ["p0", "p1", "p2"]
    assert parquet.location(2) == f"{tmp_path / 'c.parquet'}: row 2"
    with pytest.raises(IndexError, match="outside 0 .. 2"):
        parquet[3]


def test_document_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"no file matches {tmp_path}/x*.jsonl;")):
        Documents.from_paths([str(tmp_path / "x*.jsonl")])
    with pytest.raises(ValueError, match="is a directory: give its files or a glob"):
        Documents.from_paths(str(tmp_path))
    # A missing field in the first lines fails at once; later, when the line is read.
    early = _jsonl(tmp_path / "early.jsonl", [{"text": "a"}, {"content": "b", "id": 2}])
    with pytest.raises(ValueError, match=re.escape(
            f"{early}:2: no field 'text' (fields: 'content', 'id'); pass --text-field")):
        Documents.from_paths(early)
    late = _jsonl(tmp_path / "late.jsonl", [{"text": "a"}] * 16 + [{"body": "b"}])
    docs = Documents.from_paths(late)
    assert docs[15] == "a"
    with pytest.raises(ValueError, match=re.escape(f"{late}:17: no field 'text' (fields: "
                                                   "'body')")):
        docs[16]
    number = _jsonl(tmp_path / "number.jsonl", [{"text": 3}])
    with pytest.raises(ValueError, match=re.escape(f"{number}:1: field 'text' is a JSON int, "
                                                   "not a string")):
        Documents.from_paths(number)
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not a JSON object \(Expecting"):
        Documents.from_paths(str(tmp_path / "broken.jsonl"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text"):
        Documents.from_paths(str(tmp_path / "latin1.jsonl"))
    (tmp_path / "binary.txt").write_bytes(b"line one\nline two\n\xff\xfe\x00")
    with pytest.raises(ValueError, match=r"binary.txt:3: not UTF-8 text \(byte 18"):
        Documents.from_paths(str(tmp_path / "binary.txt"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p.parquet: no column 'text' \(columns: 'body'\); "
                                         "pass --text-field"):
        Documents.from_paths(str(tmp_path / "p.parquet"))
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match=r"ints.parquet: column 'text' holds int64, not "
                                         "strings"):
        Documents.from_paths(str(tmp_path / "ints.parquet"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "empty" / "b.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"no documents in .*\(2 files: empty, or blank lines"):
        Documents.from_paths(str(tmp_path / "empty" / "*"))
    blank = _jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(ValueError, match="no non-empty document in .*every text is empty"):
        Documents.from_paths(blank)


# -- tokenizers -----------------------------------------------------------------------------

def test_byte_tokenizer_and_the_vocabulary_check():
    tok = ByteTokenizer()
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.encode_batch(["a", ""]) == [[97], []]
    assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, "bytes")
    assert isinstance(tok, sp_jax.data.Tokenizer)
    check_vocab(tok, 257)
    check_vocab(tok, 320)  # a padded model vocabulary is fine
    with pytest.raises(ValueError, match=re.escape(
            "tokenizer bytes has 257 ids but the model's vocabulary is 256: give the model a "
            "vocabulary of at least 257")):
        check_vocab(tok, 256)


def test_tokenizer_command_trains_a_loadable_bpe(tmp_path, corpus):
    out = tmp_path / "tok" / "tokenizer.json"
    run = subprocess.run([sys.executable, "-m", "sp_jax.data.tokenizer", "--vocab-size", "300",
                          "--out", str(out), corpus], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0], run.stdout
    tok = load_tokenizer(out)
    assert f"{tok.vocab_size} ids" in lines[0] and 257 < tok.vocab_size <= 300
    assert tok.eos_id == tok.tokenizer.token_to_id("<|endoftext|>") == 0
    text = "<7>héllo wörld <|endoftext|>"
    ids = tok.encode(text)
    assert tok.eos_id not in ids  # a special token written in a text is text
    assert tok.tokenizer.decode(ids) == text
    assert tok.encode_batch([text, "ab"]) == [ids, tok.encode("ab")]
    assert load_tokenizer(out, eos_token="<|endoftext|>").eos_id == 0
    with pytest.raises(ValueError, match="eos_token '</s>' is not in its vocabulary"):
        load_tokenizer(out, eos_token="</s>")
    # No end-of-document token among the special tokens: named, with the fix.
    spec = json.loads(out.read_text())
    spec["added_tokens"][0]["special"] = False
    (tmp_path / "plain.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"no end-of-document token among its special tokens"
                                         r" .*pass eos_token="):
        load_tokenizer(tmp_path / "plain.json")


def test_eos_is_the_first_known_special_token(tmp_path):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.add_special_tokens(["<pad>", "</s>", "<|im_end|>", "<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert (loaded.eos_token, loaded.eos_id, loaded.vocab_size) == ("<|endoftext|>", 5, 6)
    assert load_tokenizer(tmp_path / "tokenizer.json", eos_token="</s>").eos_id == 3


def test_tokenizer_errors(tmp_path, capsys):
    (tmp_path / "bad.json").write_text('{"model": {"type": "nonsense"}}')
    with pytest.raises(ValueError, match=re.escape(
            f"tokenizer {tmp_path / 'bad.json'} does not load as a Hugging Face "
            "tokenizer.json")):
        load_tokenizer(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="missing.json: no such file"):
        load_tokenizer(tmp_path / "missing.json")
    missing = str(tmp_path / "none" / "*.txt")
    assert tokenizer_main(["--vocab-size", "300", "--out", str(tmp_path / "t.json"),
                           missing]) == 2
    assert f"error: no file matches {missing}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="vocab_size=2 must be an int >= 3"):
        sp_jax.data.train_tokenizer([missing], vocab_size=2, out=tmp_path / "t.json")


def test_tokenizer_command_makes_a_small_vocabulary(tmp_path, capsys):
    """Below 257 ids (a small checkpoint's vocabulary, e.g. the fixtures' 96): a
    character-level BPE of at most that many ids: <|endoftext|> 0, <unk> 1, the most
    frequent characters, merges; text of those characters decodes to itself, a rarer
    character is <unk>."""
    rng = np.random.default_rng(0)
    common = "abcdefgh ij"
    texts = ["".join(rng.choice(list(common), 60)) for _ in range(40)] + ["zzz rare: Ω"]
    corpus = _jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    counts = {}
    for t in texts:
        for c in t:
            counts[c] = counts.get(c, 0) + 1
    for size in (12, 40):
        out = tmp_path / f"t{size}" / "tokenizer.json"
        assert tokenizer_main(["--vocab-size", str(size), "--out", str(out), corpus]) == 0
        printed = capsys.readouterr().out
        assert "character-level BPE" in printed and str(out) in printed, printed
        tok = load_tokenizer(out)
        assert 3 <= tok.vocab_size <= size
        assert (tok.eos_id, tok.tokenizer.token_to_id("<unk>")) == (0, 1)
        chars = {t for t in tok.tokenizer.get_vocab(with_added_tokens=False) if len(t) == 1}
        # the alphabet: the size - 2 most frequent characters (space kept as "▁")
        frequent = sorted(counts, key=lambda c: -counts[c])[:size - 2]
        assert chars == {c.replace(" ", "\u2581") for c in frequent}
        text = "".join(frequent[::-1]) + "  " + "".join(frequent)  # the alphabet only
        ids = tok.encode(text)
        assert max(ids) < tok.vocab_size and tok.tokenizer.decode(ids) == text
        rare = sorted(counts, key=lambda c: counts[c])[0]  # one of the rarest
        assert (tok.encode(rare) == [1]) == (size - 2 < len(counts))  # not kept: <unk>
    assert tok.vocab_size > 12  # 40 ids: 11 characters and merges
    big = tok.encode("abcdefgh ij" * 3)
    assert len(big) < len("abcdefgh ij" * 3)  # merges shorten the ids


# -- packing ---------------------------------------------------------------------------------

def _check_rows(rows, seq_len):
    """Every row's own consistency: segments 1, 2, ... then padding (segment 0, token 0,
    label -100); positions from 0 in each segment; labels the next token of the segment,
    -100 after the end of a document; a segment not ending a document fills to the row's
    end (a cut document) or is a whole row. Returns the segments, in row order."""
    segments = []
    for tokens, labels, seg, pos in zip(*(rows[k] for k in KEYS), strict=True):
        assert tokens.shape == (seq_len,) and tokens.dtype == np.int32
        used = int(np.count_nonzero(seg))
        assert np.all(seg[:used] > 0) and np.all(seg[used:] == 0)  # padding at the end
        assert np.all(tokens[used:] == 0) and np.all(labels[used:] == IGNORE)
        ids = seg[:used]
        assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
        for s in range(1, int(ids.max()) + 1):
            where = np.flatnonzero(seg == s)
            t, lab = tokens[where], labels[where]
            assert np.array_equal(pos[where], np.arange(len(where)))
            assert np.array_equal(lab[:-1], t[1:])  # the next token of the document
            assert (lab[-1] == IGNORE) == (t[-1] == EOS)  # -100 only after a document
            assert EOS not in t[:-1]
            if t[-1] != EOS:  # a cut document: its piece ends the row
                assert where[-1] == seq_len - 1 or len(where) == seq_len
            segments.append((t, lab[-1]))
    return segments


def _stream_rows(data, stream, steps, batch_size):
    return [data.rows(s, [stream], seed=1, batch_size=batch_size) for s in range(1, steps + 1)]


@pytest.mark.parametrize("packing", ["first_fit", "concat"])
def test_rows_hold_every_document_once_per_epoch(corpus, packing):
    """Read in order (concat; first-fit with one bin), a stream's segments concatenated are
    its documents with EOS after each; over the streams, the first epoch's documents are
    every training document once, long ones split, each cut keeping its next-token label."""
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    data = _packed(corpus, packing=packing, num_packing_bins=1)
    batch, steps = 4, 64
    train = texts[:data.train_documents]
    assert data.train_documents == 114  # 5% of 120 held out
    seen = []
    rows = {k: [] for k in KEYS}
    for step in range(1, steps + 1):
        got = data.rows(step, range(batch), seed=1, batch_size=batch)
        for k in KEYS:
            rows[k].append(got[k])
    for j in range(batch):
        mine = {k: np.stack([r[j] for r in rows[k]]) for k in KEYS}
        segments = _check_rows(mine, 32)
        flat = np.concatenate([t for t, _ in segments])
        for (t, last), nxt in zip(segments, segments[1:], strict=False):
            if t[-1] != EOS:  # the cut keeps the label of its last token: the next piece's first
                assert last == nxt[0][0]
        docs = bytes(flat[flat != EOS].astype(np.uint8)).decode().split("<")[1:]  # by marker
        cuts = np.flatnonzero(flat == EOS)
        complete = ["<" + d for d in docs][:len(cuts)]
        first_epoch = len(range(j, len(train), batch))
        assert len(complete) >= first_epoch, "too few steps for an epoch"
        seen += complete[:first_epoch]
        if packing == "concat":
            assert not np.any(mine["segment_ids"] == 0)  # no padding
    assert sorted(seen) == sorted(train)


@pytest.mark.parametrize("bins", [1, 64])
def test_long_documents_are_split_into_row_pieces(tmp_path, bins):
    long = "<0>" + "x" * 100  # 104 tokens with EOS: pieces of 32, 32, 32 and 8
    path = _jsonl(tmp_path / "long.jsonl", [{"text": long}, {"text": "<1>y"}, {"text": "<2>z"}])
    data = PackedText.from_files(path, tokenizer=ByteTokenizer(), seq_len=32,
                                 held_out_fraction=0.3, num_packing_bins=bins)
    assert data.train_documents == 2
    segments = [t for step in range(1, 9)
                for t, _ in _check_rows(data.rows(step, [0], seed=0, batch_size=1), 32)]
    pieces = [t for t in segments if t[0] == ord("x") or bytes(t[:3].astype(np.uint8)) == b"<0>"]
    assert {len(t) for t in pieces} == {8, 32}  # never more than a row
    assert all(t[-1] == EOS for t in pieces if len(t) == 8)
    if bins == 1:  # in order: the document back
        whole = np.concatenate(pieces[:4])
        assert bytes(whole[:-1].astype(np.uint8)).decode() == long and whole[-1] == EOS


def test_first_fit_packs_varied_lengths_densely(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4.5, 1.0, 1200), 1, 3000).astype(int)
    path = _jsonl(tmp_path / "lognormal.jsonl", [{"text": "x" * n} for n in lengths])
    data = PackedText.from_files(path, tokenizer=ByteTokenizer(), seq_len=256)
    rows = [data.rows(s, range(4), seed=0, batch_size=4) for s in range(1, 65)]
    stacked = {k: np.concatenate([r[k] for r in rows]) for k in KEYS}
    _check_rows(stacked, 256)
    efficiency = packing_efficiency(stacked)
    print(f"first-fit efficiency, log-normal lengths (median {np.median(lengths):.0f} tokens),"
          f" seq_len 256, {data.num_packing_bins} bins: {efficiency:.3f}")
    assert efficiency >= 0.95


# -- determinism and resuming -----------------------------------------------------------------

BATCH, MICRO, STEPS = 8, 2, 6


def _train_sharding(mesh):
    return NamedSharding(mesh, P(None, "data", "tensor"))


def _global(batch):
    return {k: np.asarray(v).reshape(BATCH, -1) for k, v in batch.items()}


def _equal(a, b):
    return all(np.array_equal(a[k], b[k]) for k in KEYS)


@pytest.fixture(scope="module", params=["first_fit", "concat"])
def uninterrupted(request, corpus, mesh_2x4):
    """Steps 1..6 of one run, global rows ``[BATCH, 32]``."""
    data = _packed(corpus, packing=request.param)
    assert isinstance(data, TrainData)
    batches = [data.train_batch(s, seed=1, batch_size=BATCH, micro_batches=MICRO,
                                sharding=_train_sharding(mesh_2x4))
               for s in range(1, STEPS + 1)]
    assert batches[0]["tokens"].shape == (MICRO, BATCH // MICRO, 32)
    assert all(b[k].dtype == np.int32 for b in batches for k in KEYS)
    return request.param, [_global(b) for b in batches]


def test_row_subsets_read_the_same_global_rows(corpus, uninterrupted):
    packing, full = uninterrupted
    # b tokenizes in 2 background threads: the same rows, whatever the timing
    a, b = _packed(corpus, packing=packing), _packed(corpus, packing=packing, read_workers=2)
    for step in range(1, STEPS + 1):
        two = a.rows(step, [2, 3], seed=1, batch_size=BATCH)
        rest = b.rows(step, [7, 0], seed=1, batch_size=BATCH)
        assert _equal(two, {k: v[[2, 3]] for k, v in full[step - 1].items()})
        assert _equal(rest, {k: v[[7, 0]] for k, v in full[step - 1].items()})
    assert sorted(a.state()["streams"], key=int) == ["2", "3"]


def test_resume_gives_the_uninterrupted_batches(corpus, uninterrupted, mesh_2x4, mesh_8x1):
    packing, full = uninterrupted
    first = _packed(corpus, packing=packing)
    for step in range(1, 4):
        first.train_batch(step, seed=1, batch_size=BATCH, micro_batches=MICRO,
                          sharding=_train_sharding(mesh_2x4))
    state = json.loads(json.dumps(first.state()))  # as a checkpoint stores it
    assert state["next_step"] == 4 and len(state["streams"]) == BATCH
    again = _packed(corpus, packing=packing)
    again.restore(state)
    for step in range(4, STEPS + 1):  # another mesh, another micro-batch split
        batch = again.train_batch(step, seed=1, batch_size=BATCH, micro_batches=1,
                                  sharding=NamedSharding(mesh_8x1, P(None, "data")))
        assert batch["tokens"].shape == (1, 8, 32)
        assert _equal(_global(batch), full[step - 1]), step


def test_resume_from_two_processes_states(corpus, uninterrupted, mesh_2x4):
    packing, full = uninterrupted
    halves = [_packed(corpus, packing=packing), _packed(corpus, packing=packing)]
    for step in range(1, 4):
        for half, rows in zip(halves, ([0, 1, 2, 3], [4, 5, 6, 7]), strict=True):
            half.rows(step, rows, seed=1, batch_size=BATCH)
    states = [json.loads(json.dumps(h.state())) for h in halves]
    assert [sorted(s["streams"], key=int) for s in states] == [["0", "1", "2", "3"],
                                                             ["4", "5", "6", "7"]]
    merged = merge_states(states)
    whole = _packed(corpus, packing=packing)
    whole.restore(merged)
    for step in range(4, STEPS + 1):
        batch = whole.train_batch(step, seed=1, batch_size=BATCH, micro_batches=MICRO,
                                  sharding=_train_sharding(mesh_2x4))
        assert _equal(_global(batch), full[step - 1]), step
    # A process of another layout restores the same merged state for its own rows.
    one = _packed(corpus, packing=packing)
    one.restore(merged)
    assert _equal(one.rows(4, [5], seed=1, batch_size=BATCH),
                  {k: v[[5]] for k, v in full[3].items()})


def test_steps_and_states_are_checked(corpus, mesh_2x4):
    data = _packed(corpus)
    sharding = _train_sharding(mesh_2x4)
    with pytest.raises(ValueError, match="step 2, expected step 1 .from a fresh start"):
        data.train_batch(2, seed=1, batch_size=BATCH, micro_batches=MICRO, sharding=sharding)
    data.train_batch(1, seed=1, batch_size=BATCH, micro_batches=MICRO, sharding=sharding)
    with pytest.raises(ValueError, match="step 1, expected step 2"):
        data.train_batch(1, seed=1, batch_size=BATCH, micro_batches=MICRO, sharding=sharding)
    with pytest.raises(ValueError, match="but this run reads seed 1, batch_size 8"):
        data.train_batch(2, seed=1, batch_size=4, micro_batches=MICRO, sharding=sharding)
    with pytest.raises(ValueError, match="batch_size 8 is not divisible by micro_batches 3"):
        data.train_batch(2, seed=1, batch_size=BATCH, micro_batches=3, sharding=sharding)
    half = _packed(corpus)
    half.rows(1, [0, 1], seed=1, batch_size=BATCH)
    other = _packed(corpus)
    other.restore(half.state())
    with pytest.raises(ValueError, match=r"reads stream 2 \(row 2 of each batch\), which the "
                                         r"restored state lacks \(streams 0, 1\); restore the "
                                         "states of every process merged"):
        other.rows(2, [1, 2], seed=1, batch_size=BATCH)
    moved = _packed(corpus)
    moved.restore(data.state())
    with pytest.raises(ValueError, match="restored state was saved with seed 1, batch_size 8"):
        moved.train_batch(2, seed=1, batch_size=16, micro_batches=MICRO, sharding=sharding)
    with pytest.raises(ValueError, match="saved with packing 'first_fit'"):
        _packed(corpus, packing="concat").restore(data.state())
    with pytest.raises(ValueError, match="expected the dict of PackedText.state"):
        data.restore({"streams": {}})
    other_step = _packed(corpus)
    other_step.rows(1, [3], seed=1, batch_size=BATCH)
    other_step.rows(2, [3], seed=1, batch_size=BATCH)
    with pytest.raises(ValueError, match="state 1 has next_step=3, state 0 2"):
        merge_states([half.state(), other_step.state()])


@pytest.mark.parametrize("packing", ["first_fit", "concat"])
def test_held_out_batches_are_fixed(corpus, mesh_2x4, packing):
    data = _packed(corpus, packing=packing)
    sharding = NamedSharding(mesh_2x4, P("data", "tensor"))
    first = data.held_out_batches(2, batch_size=4, sharding=sharding)
    second = _packed(corpus, packing=packing).held_out_batches(2, batch_size=4,
                                                               sharding=sharding)
    assert len(first) == 2 and first[0]["tokens"].shape == (4, 32)
    assert all(_equal({k: np.asarray(v) for k, v in a.items()},
                      {k: np.asarray(v) for k, v in b.items()})
               for a, b in zip(first, second, strict=True))
    rows = data.held_out_rows(8)
    _check_rows(rows, 32)
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    flat = np.concatenate([rows["tokens"][i][rows["segment_ids"][i] > 0] for i in range(8)])
    assert bytes(flat[:flat.tolist().index(EOS)].astype(np.uint8)).decode() == texts[114]
    if packing == "concat":  # every held-out token, the last row padded
        total = sum(len(t) + 1 for t in texts[114:])
        every = data.held_out_rows(-(-total // 32))
        _check_rows(every, 32)
        assert np.count_nonzero(every["segment_ids"]) == total
    with pytest.warns(UserWarning, match=r"the 6 held-out documents fill \d+ rows of 32 "
                                         r"tokens, fewer than the 400 asked for"):
        many = data.held_out_batches(100, batch_size=4, sharding=sharding)
    assert len(many) == 100  # the held-out rows again, in the same order


def test_bad_arguments_are_named(corpus):
    with pytest.raises(ValueError, match="packing='best' must be one of 'first_fit', 'concat'"):
        _packed(corpus, packing="best")
    with pytest.raises(ValueError, match="seq_len=0 must be an int >= 1"):
        _packed(corpus, seq_len=0)
    with pytest.raises(ValueError, match=r"held_out_fraction=1.0 must be in \(0, 1\)"):
        _packed(corpus, held_out_fraction=1.0)
    with pytest.raises(TypeError, match="tokenizer 'bytes' lacks encode"):
        _packed(corpus, tokenizer="bytes")
    data = _packed(corpus)
    assert data.vocab_size == 257 and data.seq_len == 32
    assert data.summary() == ("120 documents in 1 files (train 114, held-out 6); tokenizer "
                              "bytes (257 ids); first-fit packing (64 bins) into rows of 32")
    with pytest.raises(ValueError, match=r"rows \[8\] outside the batch of 8 rows"):
        data.rows(1, [8], seed=0, batch_size=8)
    with pytest.raises(ValueError, match=r"rows \[1, 1\] name a row twice"):
        data.rows(1, [1, 1], seed=0, batch_size=8)


def test_parquet_and_json_lines_give_the_same_rows(tmp_path, corpus):
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    pq.write_table(pa.table({"text": texts}), tmp_path / "docs.parquet", row_group_size=16)
    a = _packed(corpus)
    b = _packed(str(tmp_path / "docs.parquet"), read_workers=2)
    for step in range(1, 4):
        assert _equal(a.rows(step, range(6), seed=2, batch_size=6),
                      b.rows(step, range(6), seed=2, batch_size=6))


def test_documents_are_checked_when_read(tmp_path):
    records = [{"text": "ok " * 5}] * 30 + [{"body": "x"}] + [{"text": "ok"}] * 9
    path = _jsonl(tmp_path / "late.jsonl", records)
    data = PackedText.from_files(path, tokenizer=ByteTokenizer(), seq_len=16)
    with pytest.raises(ValueError, match=re.escape(f"{path}:31: no field 'text'")):
        for step in range(1, 200):
            data.rows(step, range(4), seed=0, batch_size=4)
