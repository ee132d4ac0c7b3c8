"""Packed documents (``segment_ids`` / ``positions``): the loss and gradients of a packed
batch equal those of its documents run one by one, unpacked, on an unsharded model; the
attention kernels skip the blocks of other documents."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import copy_weights, param_values, slow_except
from flax import nnx
from jax.sharding import AxisType, NamedSharding

import sp_jax
from sp_jax.attention.kernels import forward_blocks, kernel_segments
from sp_jax.layers import document_labels
from sp_jax.models import GPT, GPTConfig

B, S, V = 4, 32, 64
BASE = dict(vocab_size=V, max_seq_len=S, num_layers=2, num_heads=8, hidden=32,
            attention_block_q=4, attention_block_k=4)


def _mesh(data, context, tensor):
    return jax.make_mesh((data, context, tensor), ("data", "context", "tensor"),
                         axis_types=(AxisType.Explicit,) * 3,
                         devices=jax.devices()[: data * context * tensor])


def _documents(seed=0):
    """Documents of 3..20 tokens, each with its labels (the next token; the last one
    none), packed whole into ``B`` rows of ``S`` (first fit) with padding."""
    rng = np.random.default_rng(seed)
    rows = [[] for _ in range(B)]
    docs = []
    while True:
        n = int(rng.integers(3, 21))
        row = next((r for r in rows if sum(map(len, r)) + n <= S), None)
        if row is None:
            break
        doc = rng.integers(0, V, size=n).astype(np.int32)
        row.append(doc)
        docs.append(doc)
    packed = {k: np.zeros((B, S), np.int32) for k in ("tokens", "segment_ids", "positions")}
    packed["labels"] = np.full((B, S), -100, np.int32)
    for i, row in enumerate(rows):
        at = 0
        for j, doc in enumerate(row):
            n = len(doc)
            packed["tokens"][i, at:at + n] = doc
            packed["labels"][i, at:at + n - 1] = doc[1:]
            packed["segment_ids"][i, at:at + n] = j + 1
            packed["positions"][i, at:at + n] = np.arange(n)
            at += n
    return docs, packed


DOCS, PACKED = _documents()


def _unpacked():
    """Each document alone at the start of its own row (what follows it cannot reach it
    through causal attention), its labels the next token, -100 elsewhere."""
    n = len(DOCS)
    tokens = np.zeros((n, S), np.int32)
    labels = np.full((n, S), -100, np.int32)
    for i, doc in enumerate(DOCS):
        tokens[i, :len(doc)] = doc
        labels[i, :len(doc) - 1] = doc[1:]
    return tokens, labels


@nnx.jit
def _jitted_loss_and_grads(model, batch, documents):
    def f(model):
        return model.loss(batch["tokens"], batch["labels"], **documents)
    return nnx.value_and_grad(f)(model)


def _loss_and_grads(model, batch, **documents):
    loss, grads = _jitted_loss_and_grads(model, batch, documents)
    return float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


@pytest.fixture(scope="module")
def references():
    """Per model configuration: (initial params, loss, grads) of the documents run one
    by one, unpacked, on the unsharded model."""
    cache = {}

    def get(model_kw):
        key = tuple(sorted(model_kw.items()))
        if key not in cache:
            cfg = GPTConfig(**{**BASE, **model_kw})
            tokens, labels = _unpacked()
            with jax.set_mesh(_mesh(1, 1, 1)):
                model = GPT(cfg, parallel=sp_jax.ParallelConfig(data_axis=None),
                            rngs=nnx.Rngs(0))
                init = param_values(model)
                cache[key] = (init, *_loss_and_grads(
                    model, {"tokens": jnp.asarray(tokens), "labels": jnp.asarray(labels)}))
        return cache[key]

    return get


CASES = {  # id: (mesh (data, context, tensor), model options, parallel options)
    "2x4_learned": ((2, 1, 4), {}, {}),
    "2x4_rotary_gqa_fsdp": ((2, 1, 4), {"positions": "rotary", "num_kv_heads": 2},
                            {"fsdp": True}),
    "ring_zigzag_1x2x4_rotary": ((1, 2, 4), {"positions": "rotary"},
                                 {"context_parallel": "ring"}),
    "ulysses_1x4x2_scan_remat": ((1, 4, 2), {"scan_layers": True, "remat": True},
                                 {"context_parallel": "ulysses"}),
}


@pytest.mark.parametrize("case", slow_except(CASES, "2x4_learned"))
def test_packed_batch_equals_its_documents_one_by_one(case, references):
    mesh_shape, model_kw, parallel_kw = CASES[case]
    init, ref_loss, ref_grads = references(model_kw)
    mesh = _mesh(*mesh_shape)
    parallel = sp_jax.ParallelConfig(**parallel_kw)
    with jax.set_mesh(mesh):
        model = copy_weights(GPT(GPTConfig(**{**BASE, **model_kw}), parallel=parallel,
                                 rngs=nnx.Rngs(1)), init)
        place = NamedSharding(mesh, sp_jax.Layout.of(parallel).tokens)
        batch = {k: jax.device_put(v, place) for k, v in PACKED.items()}
        loss, grads = _loss_and_grads(model, batch, segment_ids=batch["segment_ids"],
                                      positions=batch["positions"])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)


def test_document_labels_drop_targets_across_documents():
    seg = jnp.array([[1, 1, 2, 2, 2, 0, 0]])
    labels = jnp.arange(7)[None] + 10
    np.testing.assert_array_equal(document_labels(labels, seg, -1),
                                  [[10, -1, 12, 13, -1, -1, -1]])
    assert document_labels(labels, None) is labels


def test_blocks_of_other_documents_are_skipped():
    """8 documents of 64 rows in blocks of 16: causal attention computes 4 x 5 / 2 = 10
    products per document (80), not the 32 x 33 / 2 = 528 of the unmasked causal kernel,
    and gives the same rows as a masked reference."""
    b, s, d = 1, 512, 8
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, 1, 1, s, d)) if i == 0
                           else rng.normal(size=(b, 1, s, d)), jnp.float32) for i in range(3))
    seg = jnp.asarray(np.repeat(np.arange(1, 9), 64)[None], jnp.int32)
    out, _, count = forward_blocks(q, k, v, causal=True, bq=16, bk=16,
                                   segments=(kernel_segments(seg),) * 2)
    _, _, unmasked = forward_blocks(q, k, v, causal=True, bq=16, bk=16)
    assert (int(count), int(unmasked)) == (80, 528)
    scores = jnp.einsum("bhgqd,bhkd->bhgqk", q, k) * d ** -0.5
    mask = np.tril(np.ones((s, s), bool)) & (np.asarray(seg)[0, :, None] == np.asarray(seg)[0])
    ref = jnp.einsum("bhgqk,bhkd->bhgqd",
                     jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), -1), v)
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_bad_document_arrays_are_refused():
    with jax.set_mesh(_mesh(1, 1, 1)):
        model = GPT(GPTConfig(**BASE), parallel=sp_jax.ParallelConfig(data_axis=None),
                    rngs=nnx.Rngs(0))
        tokens = jnp.zeros((2, 8), jnp.int32)
        with pytest.raises(ValueError, match="segment_ids must be integers of the tokens"):
            model.loss(tokens, segment_ids=jnp.zeros((2, 7), jnp.int32))
        with pytest.raises(ValueError, match="outside the learned position table"):
            model.loss(tokens, positions=jnp.full((2, 8), S, jnp.int32))
