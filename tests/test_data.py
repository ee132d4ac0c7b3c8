"""sp_jax.data: the byte corpus (files, split), windows as a pure function of (seed, step),
the fixed held-out set, and global batches assembled from each process's rows."""

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
from sp_jax.data import ByteCorpus, assemble, rows_held

SEQ = 8
TEXT = bytes(range(256)) * 4  # 1024 bytes, every window distinct within a period


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus.from_bytes(TEXT, seq_len=SEQ)


@pytest.fixture(scope="module")
def shardings(mesh_2x4):
    layout = Layout()
    return (NamedSharding(mesh_2x4, layout.spec(None, "batch", "length")),
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
    monkeypatch.setattr(sp_jax.data, "default_patterns",
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
