"""sp_jax.data: the byte corpus (files, split), windows as a pure function of (seed, step),
the fixed held-out set, global batches assembled from each process's rows, and token ids
(.npy / .bin files, synthetic progressions) checked against the vocabulary."""

from __future__ import annotations

import os
import re
import sysconfig

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax.data
from sp_jax import Layout
from sp_jax.data import ByteCorpus, TokenIds, TrainData, assemble, rows_held

SEQ = 8
TEXT = bytes(range(256)) * 4  # 1024 bytes, every window distinct within a period


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus.from_bytes(TEXT, seq_len=SEQ)


@pytest.fixture(scope="module")
def shardings(mesh_2x4):
    layout = Layout()
    return (NamedSharding(mesh_2x4, layout.micro_batched_tokens),
            NamedSharding(mesh_2x4, layout.tokens))


def _write(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)
    return str(path)


def _contains(stream: np.ndarray, window: np.ndarray) -> bool:
    return stream.tobytes().find(window.astype(np.uint8).tobytes()) >= 0


def test_split_holds_out_the_last_five_percent(corpus):
    cut = int(len(TEXT) * 0.95)
    assert corpus.train.dtype == np.uint8
    assert corpus.train.tobytes() == TEXT[:cut] and corpus.held_out.tobytes() == TEXT[cut:]
    assert "1.0 kB from 1 files" in corpus.summary()


def test_files_sorted_and_cut_at_max_bytes(tmp_path):
    b = _write(tmp_path / "b.txt", b"B" * 400)
    _write(tmp_path / "a.txt", b"A" * 400)
    _write(tmp_path / "sub" / "c.txt", b"C" * 400)
    corpus = ByteCorpus.from_files([str(tmp_path / "**" / "*.txt"), b], seq_len=SEQ,
                                   max_bytes=1000)
    stream = corpus.train.tobytes() + corpus.held_out.tobytes()
    assert stream == b"A" * 400 + b"B" * 400 + b"C" * 200  # sorted paths, b.txt once
    assert corpus.files == 3


def test_default_patterns_are_the_stdlib_sources():
    (pattern,) = sp_jax.data.default_patterns()
    assert pattern == os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")


def test_default_leaves_out_site_and_dist_packages(tmp_path, monkeypatch):
    _write(tmp_path / "lib" / "mod.py", b"x = 1\n" * 100)
    _write(tmp_path / "lib" / "site-packages" / "pkg.py", b"y = 2\n" * 100)
    _write(tmp_path / "lib" / "dist-packages" / "pkg.py", b"z = 3\n" * 100)
    monkeypatch.setattr(sp_jax.data.corpus, "default_patterns",
                        lambda: [str(tmp_path / "lib" / "**" / "*.py")])
    corpus = ByteCorpus.from_files(seq_len=SEQ)
    assert corpus.files == 1
    assert set((corpus.train.tobytes() + corpus.held_out.tobytes()).split()) == {b"x", b"=",
                                                                                 b"1"}
    # Given patterns are taken as they are.
    explicit = ByteCorpus.from_files([str(tmp_path / "lib" / "**" / "*.py")], seq_len=SEQ)
    assert explicit.files == 3


def test_bad_input_is_named(tmp_path):
    missing = str(tmp_path / "nothing" / "*.txt")
    with pytest.raises(ValueError, match=re.escape(f"no files match {missing};")):
        ByteCorpus.from_files([missing], seq_len=SEQ)
    short = _write(tmp_path / "short.txt", b"0123456789" * 10)  # held-out: 5 bytes
    with pytest.raises(ValueError, match=r"100 bytes of text .* too few for seq_len 8 "
                                         r"\(train 95, held-out 5"):
        ByteCorpus.from_files([short], seq_len=SEQ)
    with pytest.raises(ValueError, match="max_bytes=0 must be a positive int"):
        ByteCorpus.from_files([short], seq_len=SEQ, max_bytes=0)
    with pytest.raises(ValueError, match="held_out_fraction=1.0"):
        ByteCorpus.from_bytes(TEXT, seq_len=SEQ, held_out_fraction=1.0)
    with pytest.raises(TypeError, match="1-D uint8"):
        ByteCorpus.from_bytes(np.arange(1000), seq_len=SEQ)


def test_train_batch_is_a_pure_function_of_seed_and_step(corpus, shardings):
    sharding = shardings[0]
    kwargs = dict(batch_size=8, micro_batches=2, sharding=sharding)
    a = corpus.train_batch(5, seed=0, **kwargs)
    assert a["tokens"].shape == a["labels"].shape == (2, 4, SEQ)
    assert a["tokens"].dtype == np.int32 and a["tokens"].sharding == sharding
    np.testing.assert_array_equal(a["tokens"], corpus.train_batch(5, seed=0, **kwargs)["tokens"])
    assert not np.array_equal(a["tokens"], corpus.train_batch(6, seed=0, **kwargs)["tokens"])
    assert not np.array_equal(a["tokens"], corpus.train_batch(5, seed=1, **kwargs)["tokens"])
    tokens, labels = np.asarray(a["tokens"]), np.asarray(a["labels"])
    np.testing.assert_array_equal(labels[..., :-1], tokens[..., 1:])  # next byte
    # Row k of micro-batch m is the window at offset starts[m * 4 + k] of the train bytes.
    starts = corpus.train_starts(5, seed=0, batch_size=8).reshape(2, 4)
    for m in range(2):
        for k in range(4):
            s = starts[m, k]
            np.testing.assert_array_equal(tokens[m, k], corpus.train[s:s + SEQ])
            np.testing.assert_array_equal(labels[m, k], corpus.train[s + 1:s + SEQ + 1])
    assert starts.max() + SEQ + 1 <= len(corpus.train)
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by micro_batches 4"):
        corpus.train_batch(0, seed=0, batch_size=6, micro_batches=4, sharding=sharding)


def test_held_out_batches_are_fixed_and_span_the_held_out_bytes(shardings):
    corpus = ByteCorpus.from_bytes(np.random.default_rng(0).integers(
        0, 256, 4000, dtype=np.uint8), seq_len=SEQ)
    sharding = shardings[1]
    batches = corpus.held_out_batches(3, batch_size=4, sharding=sharding)
    assert len(batches) == 3
    assert all(b["tokens"].shape == (4, SEQ) and b["tokens"].sharding == sharding
               for b in batches)
    held = corpus.held_out
    np.testing.assert_array_equal(np.asarray(batches[0]["tokens"])[0], held[:SEQ])  # at 0
    np.testing.assert_array_equal(np.asarray(batches[-1]["labels"])[-1], held[-SEQ:])  # end
    for b in batches:
        for row in np.asarray(b["tokens"]):
            assert _contains(held, row) and not _contains(corpus.train, row)
    again = corpus.held_out_batches(3, batch_size=4, sharding=sharding)
    for x, y in zip(batches, again, strict=True):
        np.testing.assert_array_equal(x["labels"], y["labels"])


def test_rows_held_and_assemble(mesh_2x4):
    sharding = NamedSharding(mesh_2x4, P("data", "tensor"))
    shape = (6, 8)
    rows = rows_held(sharding, shape, axis=0)
    np.testing.assert_array_equal(rows, np.arange(6))  # one process holds every row
    full = np.arange(48, dtype=np.int32).reshape(shape)
    # The local part may list its rows in any order: each shard is cut by row number.
    order = np.array([4, 1, 5, 0, 3, 2])
    out = assemble(full[order], order, shape=shape, sharding=sharding, axis=0)
    assert out.sharding == sharding
    np.testing.assert_array_equal(np.asarray(out), full)
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(shard.data, full[shard.index])
    with pytest.raises(ValueError, match=r"local part of shape \(5, 8\), expected \(6, 8\)"):
        assemble(full[:5], rows, shape=shape, sharding=sharding, axis=0)


def test_rows_held_along_another_axis(mesh_2x4):
    """Rows along axis 1 (the batch of a [micro, batch, seq] array)."""
    sharding = NamedSharding(mesh_2x4, P(None, "data", None))
    rows = rows_held(sharding, (2, 4, 3), axis=1)
    np.testing.assert_array_equal(rows, np.arange(4))


# -- token ids (TokenIds: ByteCorpus is its byte-level case) ----------------------------

def test_token_ids_from_npy_and_bin_files(tmp_path, shardings):
    ids = np.random.default_rng(0).integers(0, 1000, 4000)
    np.save(tmp_path / "ids.npy", ids.reshape(40, 100))  # any shape: flattened
    ids.astype(np.uint16).tofile(tmp_path / "ids.bin")  # nanoGPT's format
    for name in ("ids.npy", "ids.bin"):
        data = TokenIds.from_file(tmp_path / name, seq_len=SEQ, vocab_size=1000)
        assert data.source == str(tmp_path / name) and data.vocab_size == 1000
        np.testing.assert_array_equal(np.concatenate([data.train, data.held_out]), ids)
        assert len(data.held_out) == 200  # the last 5%
        batch = data.train_batch(3, seed=0, batch_size=8, micro_batches=2,
                                 sharding=shardings[0])
        starts = data.train_starts(3, seed=0, batch_size=8).reshape(2, 4)
        np.testing.assert_array_equal(np.asarray(batch["tokens"])[1, 2],
                                      ids[starts[1, 2]:starts[1, 2] + SEQ])
        held = data.held_out_batches(2, batch_size=4, sharding=shardings[1])
        np.testing.assert_array_equal(np.asarray(held[-1]["labels"])[-1], ids[-SEQ:])
    assert "4.0k token ids from 1 files" in data.summary()


def test_token_ids_outside_the_vocabulary_are_named(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(-1, 2000))
    with pytest.raises(ValueError, match=re.escape(
            f"{tmp_path / 'ids.npy'}: token ids range over [-1, 1999], outside the "
            "vocabulary of 1000 (ids 0 .. 999)")):
        TokenIds.from_file(tmp_path / "ids.npy", seq_len=SEQ, vocab_size=1000)
    np.save(tmp_path / "floats.npy", np.ones(1000))
    with pytest.raises(ValueError, match="holds float64 values, not integer token ids"):
        TokenIds.from_file(tmp_path / "floats.npy", seq_len=SEQ, vocab_size=1000)
    with pytest.raises(ValueError, match="cannot read token ids from .*missing.bin"):
        TokenIds.from_file(tmp_path / "missing.bin", seq_len=SEQ, vocab_size=1000)
    with pytest.raises(ValueError, match=r"30 token ids \(array\) are too few for seq_len 8"):
        TokenIds.from_array(np.arange(30), seq_len=SEQ, vocab_size=1000)
    with pytest.raises(TypeError, match="TokenIds: train must be a 1-D integer numpy array"):
        TokenIds.from_array(np.ones(1000), seq_len=SEQ, vocab_size=1000)


def test_synthetic_token_ids_are_progressions_fixed_by_the_seed():
    data = TokenIds.synthetic(96, seq_len=SEQ, tokens=10_000, seed=3)
    assert data.train.dtype == np.uint8 and len(data.train) + len(data.held_out) == 10_000
    again = TokenIds.synthetic(96, seq_len=SEQ, tokens=10_000, seed=3)
    np.testing.assert_array_equal(data.train, again.train)
    assert not np.array_equal(data.train,
                              TokenIds.synthetic(96, seq_len=SEQ, tokens=10_000).train)
    run = data.train[:4 * (SEQ + 1)].astype(np.int64)  # the first run of 4 windows
    stride = (run[1] - run[0]) % 96
    assert 1 <= stride <= 7
    np.testing.assert_array_equal(np.diff(run) % 96, stride)
    assert int(data.train.max()) < 96 and "synthetic progressions" in data.summary()


def test_byte_corpus_is_the_byte_level_token_ids(corpus):
    assert isinstance(corpus, TokenIds) and isinstance(corpus, TrainData)
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
    assert isinstance(TokenIds.synthetic(50, seq_len=SEQ, tokens=1000), TrainData)
