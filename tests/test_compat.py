"""The table of what combines (``sp_jax.compat``): complete and symmetric, each refused
cell refused by ``check`` and by the entry point that meets it (every mode's, built from
the features' declarations in tests/compat_features.py), each supported cell named by a
test that exists (the coverage rows of tests/compat_coverage.py, which the library does
not hold), combinations no other test runs compared with the same model unsharded, and
``docs/api.md`` showing the table as ``python -m sp_jax.compat`` prints it."""

import ast
import functools
import itertools
import re
import subprocess
import sys
from pathlib import Path

import chex
import compat_features
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import (
    cache_and_forward_logits,
    copy_weights,
    param_values,
    slow_except,
    to_host,
    train_gpt,
)
from conftest import make_mesh
from flax import nnx
from jax.sharding import AxisType

import sp_jax
from sp_jax import compat
from sp_jax.attention import blockwise_attention
from sp_jax.models import GPT, GPTConfig, generate
from sp_jax.training import TrainStep, lm_loss

ROOT = Path(__file__).parent.parent
COVERAGE = compat.load_coverage()  # tests/compat_coverage.py: the supported cells
B, S = 4, 16
BASE = dict(vocab_size=64, max_seq_len=S, num_layers=1, num_heads=4, hidden=32,
            attention_block_q=4, attention_block_k=4)


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[:int(np.prod(shape))])


def _context_mesh(context=2, tensor=4):
    return _mesh((1, context, tensor), ("data", "context", "tensor"))


def _stage_mesh():
    return _mesh((2, 1, 1, 4), ("stage", "data", "context", "tensor"))


# -- the table as data --------------------------------------------------------------------


def test_table_is_complete_and_symmetric():
    assert set(compat.MODES) == {"train", "eval", "generate"}
    for name, text in compat.FEATURES.items():
        assert re.fullmatch(r"[a-z0-9_]+", name) and text.strip(), name
    for mode in compat.MODES:
        for a, b in itertools.product(compat.FEATURES, repeat=2):
            cell = compat.cell(mode, a, b)
            assert cell == compat.cell(mode, b, a)
            assert cell.status in compat.STATUSES
            assert bool(cell.tests) == (cell.status == "supported"), (mode, a, b)
            assert bool(cell.fix) == (cell.status == "refused"), (mode, a, b)
    for members in compat.ALIASES.values():  # two values of one option
        for mode in compat.MODES:
            assert compat.cell(mode, *members[:2]).status == "exclusive"


def _test_names(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}


def test_every_supported_cell_names_a_test_that_exists():
    """Each node id: its file, its test function, and each part of its parameter id
    as written in that file (a dict key, a string, a number)."""
    ids = {t for cells in compat.TABLE.values() for c in cells.values() for t in c.tests}
    assert len(ids) > 30
    for node in sorted(ids):
        m = re.fullmatch(r"(tests/(?:combinations/)?test_\w+\.py)::(test_\w+)(?:\[(.+)\])?",
                         node)
        assert m, node
        path = ROOT / m[1]
        assert path.is_file() and m[2] in _test_names(path), node
        if m[1].startswith("tests/combinations/"):
            continue  # generated ids: tests/combinations/test_covering.py checks each case
        source = path.read_text()
        for part in (m[3] or "").split("-") if m[3] else ():
            assert re.search(rf"\b{re.escape(part)}\b", source) or re.fullmatch(
                r"\d+x\d+", part), (node, part)


@pytest.mark.parametrize("mode", list(compat.MODES))
def test_check_refuses_each_refused_cell_and_passes_the_others(mode):
    for m, a, b, cell in compat.refusals(mode):
        names = [a] if b is None else [a, b]
        alone = [f for f in names if compat.cell(mode, f).status == "refused"]
        if alone:  # a feature refused alone in this mode is named first
            tail, cell = f"(sp_jax.compat: {alone[0]} in {mode})", compat.cell(mode, alone[0])
        else:
            tail = f"(sp_jax.compat: {a} x {b} in {mode})"
        with pytest.raises(compat.CombinationError, match=re.escape(tail)) as info:
            compat.check(m, names, where="here")
        # the fix as written, its {feature} fields spelled as the message names them
        assert str(info.value).startswith("here: ")
        assert all(part in str(info.value) for part in re.split(r"\{\w+\}", cell.fix))
        assert isinstance(info.value, ValueError)
    for a, b in itertools.combinations_with_replacement(compat.FEATURES, 2):
        if compat.cell(mode, a, b).status in ("supported", "untested"):
            compat.check(mode, {a, b}, where="here")


def test_check_names_values_aliases_and_bad_input():
    with pytest.raises(ValueError, match=r"^ring_attention: implementation='cudnn' is not "
                                         r"supported with the ring; attention_implementation="
                                         r"'cudnn' cannot run ring attention"):
        compat.check("train", {"cudnn_attention": "implementation='cudnn'",
                               "context_ring": "the ring"}, where="ring_attention")
    with pytest.raises(ValueError, match=r"a custom loss_fn is not supported with pipeline "
                                         r"stages; .* \(sp_jax.compat: custom_loss x pipeline "
                                         r"in train\)"):
        compat.check("train", ["custom_loss", "pipeline"], where="x")
    compat.check("train", ["pipeline", "context"], where="x")  # aliases: no self-refusal
    with pytest.raises(ValueError, match="unknown feature 'fp16'"):
        compat.check("train", ["fp16"], where="x")
    with pytest.raises(ValueError, match="unknown mode 'infer'"):
        compat.check("infer", [], where="x")


def test_features_of_a_model_configuration():
    cfg = GPTConfig(**BASE, sliding_window=4, num_experts=4, fp8=sp_jax.Fp8Recipe("delayed"))
    par = sp_jax.ParallelConfig(context_parallel="ulysses", fsdp=True, collective_matmul=True,
                                expert_axis="expert")
    assert compat.features_of(cfg, par) == {
        "tensor_sequence", "context_ulysses", "fsdp", "collective_matmul", "expert_parallel",
        "sliding_window", "experts", "fp8_delayed"}
    mesh = _context_mesh(context=1, tensor=8)  # a context axis of size 1: no context feature
    assert "context_ulysses" not in compat.features_of(None, par, mesh)
    pipe = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_schedule="1f1b")
    assert "pipeline_1f1b" in compat.features_of(GPTConfig(**BASE), pipe)
    layers = BASE["num_layers"]  # a window on some layers only is a sliding window too
    per_layer = GPTConfig(**BASE, layer_windows=(4,) + (None,) * (layers - 1))
    assert "sliding_window" in compat.features_of(per_layer, par)
    assert "sliding_window" not in compat.features_of(
        GPTConfig(**BASE, layer_windows=(None,) * layers), par)


def test_features_of_defaults_and_spellings():
    """``defaults``: the default value the refusals name (``scan_layers=False``); a
    layer's window as data is ``layer_windows``; ``grad_reduce_dtype`` over one data
    device reduces nothing; ``spelled`` names each feature by its configured value."""
    cfg, par = GPTConfig(**BASE), sp_jax.ParallelConfig(grad_reduce_dtype=jnp.bfloat16)
    assert compat.features_of(cfg, par, defaults=True) - compat.features_of(cfg, par) == {
        "unrolled_layers"}
    assert "unrolled_layers" not in compat.features_of(
        GPTConfig(**BASE, scan_layers=True), defaults=True)
    assert {"layer_windows", "sliding_window"} <= compat.features_of(
        GPTConfig(**BASE, layer_windows=(4,)))
    assert "grad_reduce_dtype" in compat.features_of(None, par)
    assert "grad_reduce_dtype" not in compat.features_of(None, par, make_mesh(1, 8))
    assert "grad_reduce_dtype" in compat.features_of(None, par, make_mesh(2, 4))
    experts = GPTConfig(**BASE, num_experts=4, moe_layer_freq=1, attention_dropout=0.1)
    assert compat.spelled(experts, par, {"experts", "attention_dropout", "grad_reduce_dtype",
                                         "custom_loss"}) == {
        "experts": "num_experts=4", "attention_dropout": "attention_dropout=0.1",
        "custom_loss": "a custom loss_fn",
        "grad_reduce_dtype": "ParallelConfig(grad_reduce_dtype=bfloat16)"}


@pytest.mark.slow  # two fresh interpreters
def test_the_library_holds_no_coverage(tmp_path):
    """Which tests run which cell lives under tests/: the library's table has no
    supported cell (built alone), and no node id is in sp_jax/; this module's coverage
    came from tests/compat_coverage.py, and so does ``python -m sp_jax.compat``'s in a
    checkout, or from ``--coverage PATH``, each saying what it read."""
    assert COVERAGE == "tests/compat_coverage.py" == compat.coverage_source()
    run = [sys.executable, "-m", "sp_jax.compat"]
    out = subprocess.run(run, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.startswith(f"Coverage: tests/compat_coverage.py ({len(compat.COVERED)} rows).")
    rows = tmp_path / "rows.py"
    rows.write_text('COVERED = [(("eval",), ("tensor_sequence",), "tests/test_x.py::test_y")]\n')
    out = subprocess.run([*run, "--coverage", str(rows)], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.startswith(f"Coverage: {rows} (1 rows).")
    bare = compat.build()
    assert all(c.status != "supported" for cells in bare.values() for c in cells.values())
    assert not [p for p in (ROOT / "sp_jax").rglob("*.py") if re.search(
        r"tests/test_\w+\.py::test_", p.read_text())]  # no pytest node id
    for mode in compat.MODES:  # the coverage only adds supported cells
        for key, c in bare[mode].items():
            assert compat.TABLE[mode][key] == c or (
                c.status == "untested" and compat.TABLE[mode][key].status == "supported")


def test_check_before_the_mode_is_known_and_refusals_lifted():
    """A constructor (mode None) refuses what is refused in every mode, a kernel of
    train and eval (a tuple) what is refused in both; the message names the modes of
    the refused cell. grad_reduce_dtype with fsdp='full' (or experts, FP8) is refused
    without a pipeline, whose schedule reduces the gradients itself."""
    with pytest.raises(compat.CombinationError, match=r"grad_reduce_dtype x fsdp in train"):
        compat.check("train", ["grad_reduce_dtype", "fsdp"], where="x")
    compat.check("train", ["grad_reduce_dtype", "fsdp", "pipeline_1f1b"], where="x")
    assert compat.cell("train", "grad_reduce_dtype", "fsdp").unless == (
        "pipeline_gpipe", "pipeline_1f1b")
    compat.check("eval", ["grad_reduce_dtype", "fsdp"], where="x")  # no reduction in eval
    with pytest.raises(compat.CombinationError, match=r"in every mode\)$"):
        compat.check(None, ["attention_softcap", "cudnn_attention"], where="x")
    compat.check(None, ["packed_documents", "cudnn_attention"], where="x")  # train, eval
    compat.check(None, ["custom_loss", "pipeline"], where="x")  # train only
    with pytest.raises(compat.CombinationError, match=r"in train and eval\)$"):
        compat.check(("train", "eval"), ["packed_documents", "cudnn_attention"], where="x")
    with pytest.raises(ValueError, match="unknown mode 'infer'"):
        compat.check(("train", "infer"), [], where="x")


def test_refusals_through_what_a_feature_brings_along():
    """Pipeline stages scan the layers, dense layers before or between experts are
    experts (compat.IMPLIES): a pair refused with what one brings is refused with it too,
    the same fix and lifting features, named in the printed table and by ``--cell``; a
    model's own pair (it has what its features bring) is named first."""
    c = compat.cell("train", "interleaved_experts", "pipeline_1f1b")
    assert (c.status, c.via, c.first) == ("refused", ("pipeline_1f1b", "unrolled_layers"),
                                          "interleaved_experts")
    assert c.fix.endswith(compat.cell("train", "pipeline_1f1b", "unrolled_layers").fix)
    reduce = compat.cell("train", "dense_layers", "grad_reduce_dtype")
    assert reduce.via == ("experts", "grad_reduce_dtype")
    assert reduce.unless == ("pipeline_gpipe", "pipeline_1f1b")
    assert compat.cell("eval", "dense_layers", "grad_reduce_dtype").status == "n/a"
    with pytest.raises(compat.CombinationError, match=r"moe_layer_freq > 1 is not supported "
                       r"with pipeline stages; moe_layer_freq > 1 brings scan_layers=False "
                       r"along: .*\(sp_jax.compat: interleaved_experts x pipeline_1f1b in "
                       r"every mode\)$"):
        compat.check(None, ["pipeline_1f1b", "interleaved_experts"], where="x")
    with pytest.raises(compat.CombinationError, match=r"interleaved_experts x scan_layers"):
        compat.check("eval", ["pipeline_1f1b", "scan_layers", "interleaved_experts"], where="x")
    compat.check("train", ["dense_layers", "grad_reduce_dtype", "pipeline_gpipe"], where="x")
    assert not [r for r in compat.refusals() if r[3].via]  # the pair it is refused as is
    assert "- train: dense_layers x grad_reduce_dtype: as experts x grad_reduce_dtype" in \
        compat.render()
    text = compat.describe("train", "dense_layers", "grad_reduce_dtype")
    assert text.startswith("train: dense_layers x grad_reduce_dtype: x refused") and \
        "(unless pipeline_gpipe or pipeline_1f1b)" in text
    supported = compat.describe("train", "tensor_sequence", "fsdp")
    row = next(r for r in compat.COVERED if "train" in r[0] and {"tensor_sequence", "fsdp"}
               <= set(r[1]))
    assert f"  {row[2]}\n    {', '.join(row[1])[:40]}" in supported


# -- each refused cell, by the entry point that meets it -----------------------------------


@functools.cache
def _pipelined_gpt():
    cfg = GPTConfig(**{**BASE, "num_layers": 2, "scan_layers": True})
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=2)
    with jax.set_mesh(_stage_mesh()):
        return GPT(cfg, parallel=par, rngs=nnx.Rngs(0))


def _on_pipeline(call):
    model = _pipelined_gpt()
    with jax.set_mesh(_stage_mesh()):
        call(model)


TOKENS = np.arange(B * S, dtype=np.int32).reshape(B, S) % 64


def _mtp_on_pipeline():
    cfg = GPTConfig(**{**BASE, "num_layers": 2, "scan_layers": True}, mtp_depth=1)
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=2)
    with jax.set_mesh(_stage_mesh()):
        TrainStep(GPT(cfg, parallel=par, rngs=nnx.Rngs(0)), optax.sgd(0.1))


def _custom_loss_step(model):
    step = TrainStep(model, optax.sgd(0.1), loss_fn=lambda m, b, k: (m.loss(b["tokens"]), 1))
    step({"tokens": TOKENS.reshape(2, 2, S), "labels": TOKENS.reshape(2, 2, S)},
         jax.random.key(0))


def _ring_gpt(**config):
    with jax.set_mesh(_context_mesh()):
        GPT(GPTConfig(**BASE, **config), parallel=sp_jax.ParallelConfig(context_parallel="ring"),
            rngs=nnx.Rngs(0))


def _cudnn_with_documents():
    q = jnp.zeros((1, 8, 2, 4), jnp.bfloat16)
    blockwise_attention(q, q, q, segment_ids=jnp.ones((1, 8), jnp.int32),
                        implementation="cudnn")


def _reduce_step(parallel, shape=(2, 2), **config):
    with jax.set_mesh(make_mesh(*shape) if len(shape) == 2 else _mesh(
            shape, ("data", "expert", "tensor"))):
        model = GPT(GPTConfig(**{**BASE, **config}), parallel=sp_jax.ParallelConfig(
            grad_reduce_dtype=jnp.bfloat16, **parallel), rngs=nnx.Rngs(0))
        TrainStep(model, optax.sgd(0.1))


def _stages_unrolled():
    with jax.set_mesh(_stage_mesh()):
        GPT(GPTConfig(**{**BASE, "num_layers": 2}), parallel=sp_jax.ParallelConfig(
            pipeline_axis="stage", pipeline_microbatches=2), rngs=nnx.Rngs(0))


_REDUCE = "ParallelConfig\\(grad_reduce_dtype=bfloat16\\) without a pipeline reduces the gradients"

# (first feature, second or None) of each entry of compat.REFUSALS -> (what meets it, the
# message it raises)
ENTRY_POINTS = {
    ("cudnn_attention", "context_ring"): (lambda: _ring_gpt(attention_implementation="cudnn",
                                                            dtype=jnp.bfloat16),
                                          "cannot run ring attention"),
    ("packed_documents", "cudnn_attention"): (_cudnn_with_documents,
                                              r"segment_ids \(packed documents\) need "
                                              "implementation='xla'"),
    ("attention_dropout", "cudnn_attention"): (
        lambda: GPTConfig(**BASE, attention_dropout=0.1, attention_implementation="cudnn"),
        "attention_dropout=0.1 needs attention_implementation='xla'"),
    ("mla_attention", "cudnn_attention"): (
        lambda: GPTConfig(**BASE, attention="mla", kv_lora_rank=16, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=6, attention_implementation="cudnn"),
        "multi-head latent attention .attention='mla'. needs attention_implementation='xla'"),
    ("grouped_query", "mla_attention"): (
        lambda: GPTConfig(**BASE, attention="mla", kv_lora_rank=16, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=6, num_kv_heads=2),
        "num_kv_heads=2 is not supported with multi-head latent attention"),
    ("attention_softcap", "cudnn_attention"): (
        lambda: GPTConfig(**BASE, attention_softcap=5.0, attention_implementation="cudnn"),
        "attention_softcap=5.0 needs attention_implementation='xla'"),
    ("mtp", "pipeline"): (_mtp_on_pipeline, "the pipeline's schedule does not carry"),
    ("lora", "fp8"): (
        lambda: GPTConfig(**BASE, lora=sp_jax.LoRAConfig(rank=2),
                          fp8=sp_jax.Fp8Recipe("current")),
        "LoRA adapters .lora=LoRAConfig.*. multiply in the compute dtype"),
    ("lora", "experts"): (
        lambda: GPTConfig(**BASE, lora=sp_jax.LoRAConfig(rank=2), num_experts=4,
                          experts_per_token=2),
        "the experts' grouped GEMMs take no adapters yet"),
    ("lora", "mla_attention"): (
        lambda: GPTConfig(**BASE, lora=sp_jax.LoRAConfig(rank=2), attention="mla",
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                          v_head_dim=6),
        "latent attention's low-rank projections take no adapters yet"),
    ("custom_loss", "pipeline"): (lambda: _on_pipeline(_custom_loss_step),
                                  "a custom loss_fn cannot run on it"),
    ("layer_windows", "cudnn_attention"): (
        lambda: GPTConfig(**BASE, layer_windows=(4,), attention_implementation="cudnn"),
        "layer_windows \\(a window per layer\\) needs attention_implementation='xla': cuDNN's "
        "kernel takes a static window"),
    ("pipeline", "unrolled_layers"): (_stages_unrolled, r"GPT: ParallelConfig\(pipeline_axis="
                                      r"'stage'\) is not supported with scan_layers=False; "
                                      r".* needs GPTConfig\(scan_layers=True\)"),
    ("dense_layers", "interleaved_experts"): (
        lambda: GPTConfig(**{**BASE, "num_layers": 3}, num_experts=4, moe_layer_freq=2,
                          num_dense_layers=1),
        "num_dense_layers=1 is not supported with moe_layer_freq=2; num_dense_layers=1 makes "
        "every layer after the first num_dense_layers a mixture of experts; use "
        "moe_layer_freq=1"),
    ("interleaved_experts", "scan_layers"): (
        lambda: GPTConfig(**{**BASE, "num_layers": 2}, num_experts=4, moe_layer_freq=2,
                          scan_layers=True),
        "moe_layer_freq=2 mixes dense and expert layers; use moe_layer_freq=1 or "
        "scan_layers=False"),
    ("grad_reduce_dtype", "fsdp"): (lambda: _reduce_step(dict(fsdp=True)),
                                    f"{_REDUCE}.*fsdp='full'"),
    ("grad_reduce_dtype", "experts"): (
        lambda: _reduce_step({}, num_experts=2, moe_mlp_hidden=16), f"{_REDUCE}"),
    ("grad_reduce_dtype", "expert_parallel"): (
        lambda: _reduce_step(dict(expert_axis="expert"), (2, 2, 2), num_experts=2,
                             moe_mlp_hidden=16), f"{_REDUCE}"),
    ("grad_reduce_dtype", "fp8"): (
        lambda: _reduce_step({}, fp8=sp_jax.Fp8Recipe("current")), f"{_REDUCE}"),
}
_FIRST_ENTRY_POINTS = ["train_eval_generate-cudnn_attention-context_ring",
                       "train_eval-packed_documents-cudnn_attention",
                       "train_eval_generate-attention_dropout-cudnn_attention",
                       "train_eval_generate-attention_softcap-cudnn_attention",
                       "train-custom_loss-pipeline"]  # the fast tier's


def test_every_refusal_has_an_entry_point():
    assert set(ENTRY_POINTS) == {(r.first, r.second) for r in compat.REFUSALS}


@pytest.mark.parametrize("name", slow_except(
    [f"{'_'.join(r.modes)}-{r.first}-{r.second}" for r in compat.REFUSALS],
    *_FIRST_ENTRY_POINTS))
def test_each_refusal_is_raised_where_it_is_met(name):
    _, a, b = name.split("-")
    meet, pattern = ENTRY_POINTS[a, None if b == "None" else b]
    with pytest.raises(ValueError, match=pattern):
        meet()


# -- each refused cell of each mode, at that mode's entry point ------------------------------


def _custom_loss(model, batch, key):
    return model.loss(batch["tokens"], batch["labels"]), jnp.asarray(1, jnp.int32)


def _train(model, call):
    """A TrainStep of ``model`` and one step (its trace checks the batch's features)."""
    step = TrainStep(model, optax.sgd(0.1), loss_fn=_custom_loss if call.get(
        "custom_loss") else lm_loss, offload_optimizer=call.get("offload", False))
    micro = model.parallel.pipeline_microbatches
    rows = {"tokens": TOKENS, "labels": TOKENS} | (
        {"segment_ids": DOCS, "positions": POSITIONS} if call.get("documents") else {})
    step({k: v.reshape(micro, B // micro, S) for k, v in rows.items()}, jax.random.key(0))


def _eval(model, call):
    docs = dict(segment_ids=DOCS, positions=POSITIONS) if call.get("documents") else {}
    model(TOKENS, **docs)


def _generate(model, call):
    generate(model, [[1, 2, 3]], max_new_tokens=1)


MODE_ENTRY_POINTS = {"train": _train, "eval": _eval, "generate": _generate}
"""Each mode's entry point: ``(model, call options) -> None``."""


def _refused_cells() -> list[str]:
    return [f"{m}-{a}-{b}" for m, a, b, _ in compat.refusals()]


@pytest.mark.slow  # ~1 s a cell (the fast tier: test_each_refusal_is_raised_where_it_is_met)
@pytest.mark.parametrize("case", _refused_cells())
def test_each_refused_cell_raises_at_its_entry_point(case):
    """The smallest model with the cell's two features (tests/compat_features.py; the
    features they imply too), run at the mode's entry point: a CombinationError naming a
    refused pair of its features (the cell's, unless an implied feature's is met
    first). A pair refused in every mode is refused when the model is built (its
    configuration, its layers), naming every mode; any other at the mode's entry point,
    naming the mode, the model built."""
    mode, a, b = case.split("-")
    made = compat_features.setup([a] if b == "None" else [a, b])
    every = all(compat.cell(m, a, None if b == "None" else b).status == "refused"
                for m in compat.MODES)
    with jax.set_mesh(made.mesh()), pytest.raises(compat.CombinationError) as info:
        model = GPT(made.gpt_config(), parallel=made.parallel, rngs=nnx.Rngs(0))
        assert not every, f"{case}: refused in every mode, but the model was built"
        MODE_ENTRY_POINTS[mode](model, made.call)
    tag = re.search(r"\(sp_jax\.compat: (\w+)(?: x (\w+))? in ([\w ]+)\)$", str(info.value))
    assert tag, str(info.value)
    named = {f for f in tag.groups()[:2] if f}
    assert named == {a, b} - {"None"} or (named <= set(made.names) and compat.cell(
        mode, *named).status == "refused"), str(info.value)
    assert tag[3] == ("every mode" if every else mode), str(info.value)


# -- combinations no other test runs: the same model sharded and unsharded -----------------

DOCS = np.where(np.arange(S) < 10, 1, 2)[None].repeat(B, 0).astype(np.int32)
DOCS[1] = 1  # one row holds a single document
POSITIONS = np.where(DOCS == 1, np.arange(S), np.arange(S) - 10).astype(np.int32)

CASES = {  # id: (mesh shape, axis names, model options, parallel options)
    "2x4_cm_fsdp": ((2, 4), ("data", "tensor"), dict(sliding_window=3),
                    dict(collective_matmul=True, recompute_allgather=True, fsdp=True)),
    "2x2x2_ulysses_cm_fsdp": ((2, 2, 2), ("data", "context", "tensor"), dict(sliding_window=3),
                              dict(context_parallel="ulysses", collective_matmul=True,
                                   recompute_allgather=True, fsdp=True)),
    "1x2x4_ring_cm_fp8": ((1, 2, 4), ("data", "context", "tensor"),
                          dict(fp8=sp_jax.Fp8Recipe("current")),
                          dict(context_parallel="ring", collective_matmul=True,
                               recompute_allgather=True)),
    "2x2x1x2_experts_fsdp_cm_fp8": ((2, 2, 1, 2), ("data", "expert", "context", "tensor"),
                                    dict(sliding_window=3, num_experts=4, moe_mlp_hidden=16,
                                         fp8=sp_jax.Fp8Recipe("delayed", 4)),
                                    dict(expert_axis="expert", fsdp=True,
                                         collective_matmul=True, recompute_allgather=True)),
    # ring attention with a sliding window on packed rows: key blocks wholly outside the
    # window skipped by the ring loop, the segment ids travelling with the keys
    "1x2x4_ring_window": ((1, 2, 4), ("data", "context", "tensor"), dict(sliding_window=3),
                          dict(context_parallel="ring")),
}


@nnx.jit
def _logits_loss_grads(model, tokens, segment_ids, positions):
    docs = dict(segment_ids=segment_ids, positions=positions)
    logits = model(tokens, **docs)
    loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens, **docs))(model)
    return logits, loss, grads


def _run(cfg, parallel, mesh, init=None):
    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))
        if init is not None:
            copy_weights(model, init)
        init = param_values(model)
        logits, loss, grads = _logits_loss_grads(model, TOKENS, DOCS, POSITIONS)
        return init, to_host(logits), float(loss), to_host(nnx.to_pure_dict(grads))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_combination_equals_unsharded(case):
    """Logits (eval) and the loss with its gradients (train) of one model with the
    case's features together, packed documents in every case, against the same model on
    one device. FP8: the same whole-tensor scales sharded and unsharded, so only the
    fp32 summation order differs (a rare one-quantum flip)."""
    shape, names, model_kw, parallel_kw = CASES[case]
    cfg = GPTConfig(**BASE, **model_kw)
    parallel = sp_jax.ParallelConfig(**parallel_kw)
    assert compat.features_of(cfg, parallel, defaults=True) | {"packed_documents"} >= set(
        next(f for _, f, t in compat.COVERED if t.endswith(f"[{case}]")))
    init, logits, loss, grads = _run(cfg, parallel, _mesh(shape, names))
    _, ref_logits, ref_loss, ref_grads = _run(cfg, sp_jax.ParallelConfig(), make_mesh(1, 1),
                                              init)
    tol = 2e-3 if cfg.fp8 else 1e-5
    np.testing.assert_allclose(loss, ref_loss, rtol=tol)
    np.testing.assert_allclose(logits, ref_logits, rtol=tol, atol=tol * 10)
    chex.assert_trees_all_close(grads, ref_grads, rtol=tol * 10, atol=tol)


PIPE_AXES = ("stage", "data", "expert", "context", "tensor")
PIPE_STEPS = 3
PIPE_CASES = {  # id: ((stage, data, expert, context, tensor), schedule, model / parallel options)
    "2x1x2x1x2_1f1b_experts_window": ((2, 1, 2, 1, 2), "1f1b",
                                      dict(num_experts=4, moe_mlp_hidden=16, sliding_window=3),
                                      dict(expert_axis="expert")),
    "2x1x1x2x2_ulysses_gpipe_fp8_window": ((2, 1, 1, 2, 2), "gpipe",
                                           dict(fp8=sp_jax.Fp8Recipe("delayed", 4),
                                                sliding_window=3),
                                           dict(context_parallel="ulysses")),
    "2x1x2x2x1_ring_gpipe_experts": ((2, 1, 2, 2, 1), "gpipe",
                                     dict(num_experts=4, moe_mlp_hidden=16),
                                     dict(expert_axis="expert", context_parallel="ring")),
}


def _pipe_batches():
    """``PIPE_STEPS`` batches of the packed rows ``DOCS`` / ``POSITIONS`` (random tokens),
    2 micro-batches ``[2, B / 2, S]`` each."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(PIPE_STEPS):
        tokens = rng.integers(0, BASE["vocab_size"], (B, S + 1)).astype(np.int32)
        rows = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "segment_ids": DOCS,
                "positions": POSITIONS}
        out.append({k: v.reshape(2, B // 2, S) for k, v in rows.items()})
    return out


def _histories(params):
    return {jax.tree_util.keystr(path): np.asarray(v) for path, v in
            jax.tree_util.tree_flatten_with_path(params)[0] if "fp8_history" in str(path)}


@pytest.mark.slow  # ~30 s a case on 2 CPU cores: two models' logits and 2 x 3 steps
@pytest.mark.parametrize("case", list(PIPE_CASES))
def test_pipelined_combination_equals_unsharded(case):
    """A pipelined model (2 stages, 2 micro-batches) with the case's features together,
    packed documents in every case, against the same parameters unpipelined on one
    device: the logits of ``model(tokens)`` (eval: a forward through the stages) and
    three AdamW steps of a ``TrainStep`` (train: losses and parameters, fp32, 1e-5).
    FP8 (delayed): the first step's loss within 4e-4 and its amaxes equal (1e-6), as
    tests/test_fp8.py's pipelined case; the later steps follow FP8 flips of fp32
    rounding noise, so only their finiteness and fall are asserted."""
    shape, schedule, model_kw, parallel_kw = PIPE_CASES[case]
    cfg = GPTConfig(**{**BASE, "num_layers": 2, "scan_layers": True}, **model_kw)
    parallel = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=2,
                                     pipeline_schedule=schedule, **parallel_kw)
    assert compat.features_of(cfg, parallel, defaults=True) | {"packed_documents"} >= set(
        next(f for _, f, t in compat.COVERED if t.endswith(f"[{case}]")))
    mesh, flat = _mesh(shape, PIPE_AXES), make_mesh(1, 1)
    batches, tokens = _pipe_batches(), _pipe_batches()[0]["tokens"].reshape(B, S)
    forward = nnx.jit(lambda m, t: m(t, segment_ids=DOCS, positions=POSITIONS))
    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))
        init = param_values(model)
        model.eval()
        logits = to_host(forward(model, tokens))
    with jax.set_mesh(flat):
        ref = copy_weights(GPT(cfg, rngs=nnx.Rngs(1)), init)
        ref.eval()
        ref_logits = to_host(forward(ref, tokens))
    tol = 2e-3 if cfg.fp8 else 1e-5
    np.testing.assert_allclose(logits, ref_logits, rtol=tol, atol=tol * 10)
    start, losses, params, _ = train_gpt(cfg, parallel, mesh, batches, init=init)
    _, ref_losses, ref_params, _ = train_gpt(cfg, sp_jax.ParallelConfig(), flat, batches,
                                             init=init)
    chex.assert_trees_all_equal(start, init)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    if cfg.fp8 is None:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-5)
        return
    np.testing.assert_allclose(losses[0], ref_losses[0], rtol=4e-4)
    got, want = _histories(params), _histories(ref_params)
    assert got.keys() == want.keys() and got
    for name, h in got.items():  # newest first: the first step's amaxes in column STEPS - 1
        np.testing.assert_allclose(h[..., PIPE_STEPS - 1], want[name][..., PIPE_STEPS - 1],
                                   rtol=1e-6, err_msg=name)


@pytest.mark.slow
def test_custom_loss_fn_trains_like_lm_loss():
    """A TrainStep with a loss_fn of its own (the cross entropy written out from the
    logits) takes the steps the default lm_loss takes."""
    def custom(model, batch, key):
        logits = model(batch["tokens"]).astype(jnp.float32)
        labels = jax.nn.one_hot(batch["labels"], logits.shape[-1])
        nll = -jnp.sum(jax.nn.log_softmax(logits) * labels)
        return nll, jnp.asarray(batch["labels"].size, jnp.int32)

    batch = {"tokens": TOKENS[None], "labels": np.roll(TOKENS, -1, axis=1)[None]}
    losses = []
    for loss_fn in (lm_loss, custom):
        with jax.set_mesh(make_mesh(2, 4)):
            step = TrainStep(GPT(GPTConfig(**BASE), rngs=nnx.Rngs(0)), optax.sgd(0.1),
                             loss_fn=loss_fn)
            losses.append([float(step(batch, jax.random.key(i))["loss"]) for i in range(2)])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert losses[0][1] < losses[0][0]


GEN_CASES = {  # id: (mesh shape, axis names, model options, parallel options)
    "2x4_cm_fsdp_window_dropout": ((2, 4), ("data", "tensor"),
                                   dict(sliding_window=3, attention_dropout=0.1),
                                   dict(collective_matmul=True, recompute_allgather=True,
                                        fsdp=True)),
    # the KV cache split over the context axis (ring prefill, log-sum-exp decode merge)
    "1x2x2x2_experts_ring": ((1, 2, 2, 2), ("data", "expert", "context", "tensor"),
                             dict(num_experts=4, moe_mlp_hidden=16),
                             dict(expert_axis="expert", context_parallel="ring")),
    "1x2x4_ring_window": ((1, 2, 4), ("data", "context", "tensor"), dict(sliding_window=3),
                          dict(context_parallel="ring")),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GEN_CASES))
def test_generation_with_features_reads_its_cache_like_a_full_forward(case):
    """Generation of a model with the case's features together (attention dropout is
    off in eval): after the prefill and decode steps, the next-token logits from the
    cache equal the logits of a forward over each row's prompt and tokens (rows at
    different positions), and greedy generation is the argmax of those forward
    logits."""
    shape, names, model_kw, parallel_kw = GEN_CASES[case]
    cfg = GPTConfig(**{**BASE, "max_seq_len": 32}, **model_kw)
    parallel = sp_jax.ParallelConfig(**parallel_kw)
    mesh = _mesh(shape, names)
    assert compat.features_of(cfg, parallel, mesh, defaults=True) >= set(
        next(f for _, f, t in compat.COVERED if t.endswith(f"[{case}]")))
    rng = np.random.default_rng(0)
    lengths, steps = np.array([5, 3]), 4
    full = rng.integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))
        out = generate(model, [list(full[b, :lengths[b]]) for b in range(2)],
                       max_new_tokens=steps)
        model.eval()
        logits, reference = cache_and_forward_logits(model, full, lengths, steps)
    for b in range(2):
        np.testing.assert_allclose(logits[b], reference[b, lengths[b] + steps - 1],
                                   rtol=1e-5, atol=1e-5)
    # greedy: each new token is the argmax of a forward over the prompt and the tokens
    # chosen before it
    tokens = np.asarray(out.tokens)
    with jax.set_mesh(mesh):
        for b in range(2):
            row = list(full[b, :lengths[b]])
            for n in range(steps):
                padded = np.zeros((2, 16 * ((len(row) + 15) // 16)), np.int32)
                padded[:, :len(row)] = row
                ahead = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(padded)))
                assert tokens[b, n] == int(np.argmax(ahead[0, len(row) - 1])), (b, n)
                row.append(int(tokens[b, n]))


# -- the printed table and docs/api.md -----------------------------------------------------


def test_docs_api_shows_the_table_as_rendered():
    """docs/api.md's section holds exactly ``compat.markdown()`` (regenerate it with
    ``python -m sp_jax.compat --markdown``), after the command that prints it."""
    text = (ROOT / "docs" / "api.md").read_text()
    assert ".venv/bin/python -m sp_jax.compat\n```\n\n" + compat.markdown() in text
    rendered = compat.render()
    assert all(len(line) <= 100 for line in rendered.splitlines())
    for mode in compat.MODES:
        assert f"\n{mode}: " in rendered
