"""The combination harness itself: one small feature set per mode against the unsharded
model, the sets the table says cannot run refused before anything is built, and a
sharded model made wrong on purpose caught (the harness can fail)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compat_features import FEATURES
from flax import nnx

from combinations import harness
from sp_jax import compat
from sp_jax.attention import blockwise_attention


@pytest.mark.parametrize("features, mode", [
    (("tensor_sequence", "zero1", "packed_documents"), "train"),
    (("context_ring", "packed_documents", "sliding_window"), "eval"),
    (("fsdp", "attention_softcap"), "generate"),
    # attention dropout's rows in pipeline stages split over an expert axis (train-c22
    # found their masks drawn for the expert axis's first shard on every shard)
    pytest.param(("pipeline_gpipe", "experts", "expert_parallel", "attention_dropout"),
                 "train", marks=pytest.mark.slow)])
def test_a_feature_set_equals_the_unsharded_model(features, mode):
    harness.run(features, mode)


def test_sets_that_cannot_run_are_refused_before_anything_is_built():
    with pytest.raises(compat.CombinationError, match=r"custom_loss x pipeline_gpipe in train"):
        harness.check(["custom_loss", "pipeline_gpipe"], "train")
    with pytest.raises(ValueError, match=r"fsdp x zero1 is exclusive in train"):
        harness.check(["fsdp", "zero1"], "train")
    with pytest.raises(ValueError, match=r"zero1 alone is n/a in eval"):
        harness.check(["zero1"], "eval")
    with pytest.raises(ValueError, match=r"unknown features \['fp16'\]"):
        harness.check(["fp16"], "train")
    with pytest.raises(ValueError, match=r"unknown mode 'infer'"):
        harness.check(["fsdp"], "infer")
    with pytest.raises(ValueError, match=re.escape("(32 devices); there are 8")):
        harness.check(["pipeline_gpipe", "fsdp", "expert_parallel", "context_ring",
                       "tensor_sequence"], "train")
    made = harness.check(["pipeline_1f1b"], "train")  # what a feature implies is added
    assert made.names == ("pipeline_1f1b", "scan_layers") and made.shape == (2, 1, 1, 1, 1)


def _perturb(model, by: float = 1e-3):
    """One entry of the first MLP's kernel changed by ``by`` (of weights ~0.02)."""
    state = nnx.state(model, nnx.Param)
    leaf = next(p for p, _ in nnx.to_flat_state(state) if "mlp" in str(p))
    flat = dict(nnx.to_flat_state(state))
    value = flat[leaf][...]
    flat[leaf].set_value(value.at[(0,) * value.ndim].add(by))


@pytest.mark.parametrize("mode", ["eval", pytest.param("train", marks=pytest.mark.slow)])
def test_the_harness_catches_a_wrong_model(mode):
    """The same run with one weight of the sharded model off by 1e-3 fails (its
    reference is the one the passing case above computed)."""
    features = {"eval": ("context_ring", "packed_documents", "sliding_window"),
                "train": ("tensor_sequence", "zero1", "packed_documents")}[mode]
    with pytest.raises(AssertionError, match=re.escape("+".join(features) + f" in {mode}")):
        harness.run(features, mode, tamper=_perturb)


def test_cudnn_stand_in_is_sp_jax_cudnn_call_with_xla_kernel():
    """Off a GPU, ``cudnn_attention`` runs in its declared stand-in: sp_jax's cuDNN call
    (scale, causality, the window as ``local_window_size``, grouped-query heads) with
    XLA's implementation in cuDNN's place equals sp_jax's own kernel; outside it the
    call is cuDNN's again (nothing traced inside is reused)."""
    stand_in = FEATURES["cudnn_attention"].cpu_stand_in
    assert FEATURES["cudnn_attention"].device == "gpu" and stand_in is not None
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    # bf16: cuDNN's kernel takes fp16 / bf16 only (fp32 is refused before the call)
    q = jax.random.normal(kq, (2, 16, 4, 8), jnp.bfloat16)
    k = jax.random.normal(kk, (2, 16, 2, 8), jnp.bfloat16)
    v = jax.random.normal(kv, (2, 16, 2, 8), jnp.bfloat16)
    run = jax.jit(blockwise_attention, static_argnames=("implementation", "sliding_window",
                                                         "scale"))
    for window, scale in ((None, None), (3, 0.7)):
        want = blockwise_attention(q, k, v, block_q=4, block_k=4, sliding_window=window,
                                   scale=scale)
        with stand_in():
            got = run(q, k, v, implementation="cudnn", sliding_window=window, scale=scale)
        # two bf16 kernels (outputs of magnitude ~1): a bf16 quantum or two apart
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=2e-2, atol=2e-2,
                                   err_msg=f"window {window}, scale {scale}")
        if window:  # the arguments reach the kernel
            assert not np.allclose(np.float32(got), np.float32(blockwise_attention(q, k, v)),
                                   atol=1e-1)
    if jax.default_backend() == "cpu":
        with pytest.raises(RuntimeError, match="cuDNN.*implementation='xla'"):
            run(q, k, v, implementation="cudnn", sliding_window=3, scale=0.7)


def test_greedy_tokens_may_differ_only_at_a_near_tie_of_the_reference():
    """fp32: the tokens equal. A looser logits bound (bf16 / FP8): equal up to a row's
    first difference, where the reference's logits of the two tokens are within twice
    the bound; a difference elsewhere fails, whatever follows it."""
    want = np.array([[1, 2, 3], [4, 5, 6]])
    picked = np.zeros((2, 3, 8))
    picked[0, 1, 2], picked[0, 1, 7] = 1.0, 0.95  # row 0, token 1: 2 over 7 by 0.05
    picked[1, 0, 4], picked[1, 0, 7] = 1.0, 0.5  # row 1, token 0: 4 over 7 by 0.5
    tie = np.array([[1, 7, 0], [4, 5, 6]])  # then anything: the contexts differ
    with pytest.raises(AssertionError, match="greedy tokens"):
        harness._greedy(tie, want, picked, (1e-5, 1e-5), "fp32")
    harness._greedy(tie, want, picked, (1e-2, 2e-2), "bf16")
    with pytest.raises(AssertionError, match="row 0 differ at new token 1 .* 0.05 apart"):
        harness._greedy(tie, want, picked, (1e-3, 1e-2), "bf16, a tighter bound")
    with pytest.raises(AssertionError, match="row 1 differ at new token 0 .* 0.5 apart"):
        harness._greedy(np.array([[1, 2, 3], [7, 5, 6]]), want, picked, (1e-2, 1e-1), "bf16")


@pytest.mark.slow
def test_an_fp8_value_on_a_quantum_boundary_is_told_from_a_wrong_model():
    """tensor_sequence + grouped_query + FP8 current scaling in eval: 5 of 64 positions
    differ by 0.043 from the reference, past FP8's logits bound, because a value of the
    reference lies within fp32 rounding of an FP8 rounding boundary (the reference with
    fp32 noise in its weights moves the same positions as far: ``harness._noise``): the
    case passes. The same set with one weight made wrong fails: its positions are off by
    more than the reference's own noise ever moves them."""
    features = ("tensor_sequence", "grouped_query", "fp8_current", "unrolled_layers")
    harness.run(features, "eval")
    with pytest.raises(AssertionError, match=r"more within the reference's fp32 noise"):
        harness.run(features, "eval", tamper=lambda model: _perturb(model, 2e-2))
