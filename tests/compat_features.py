"""Each feature of ``sp_jax.compat``'s table, declared once: how it changes the model's
configuration, its ``ParallelConfig``, the mesh and the call, for a test that builds the
smallest model with a set of features (tests/test_compat.py: every refused cell raised
at its entry point; a combination harness builds on the same declarations).

``setup(names)`` combines the declarations of ``names`` (and the features they imply) on
the smallest mesh they need; two features setting one field to different values are two
values of one option (a ValueError). ``Setup.reference()`` is the same model unsharded
(one device, the default ``ParallelConfig``): what changes the math (a window, experts,
FP8, a soft cap, packed documents, a custom loss) stays in it, what only lays the model
out (the parallel fields and mesh axes) leaves it, and a feature's ``reference`` fields
say what else the reference sets otherwise (cuDNN's kernel: XLA's; optimizer offload:
none), so tests/combinations/harness.py compares the two within the features' bounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import sp_jax
from sp_jax import compat
from sp_jax.models import GPTConfig

AXES = ("stage", "data", "expert", "context", "tensor")
"""The mesh's axes, outermost first (a size-1 axis where no feature asks for it)."""

BASE = dict(vocab_size=64, max_seq_len=16, num_layers=2, num_heads=4, hidden=32,
            attention_block_q=4, attention_block_k=4)
"""The smallest model: every feature's declaration changes it (a feature's ``config``
fields replace these)."""


@dataclasses.dataclass(frozen=True)
class Feature:
    """How one feature changes the model and the call.

    Attributes:
      config: ``GPTConfig`` fields.
      parallel: ``ParallelConfig`` fields.
      axes: mesh axes it needs, with their sizes (at least).
      call: options of the call: ``documents`` (segment_ids / positions given),
        ``custom_loss`` (a loss_fn other than lm_loss), ``offload`` (TrainStep's
        ``offload_optimizer``).
      implies: features it brings along unless one of the same option is given (a
        pipeline: scanned layers).
      reference: ``config`` or ``call`` fields the unsharded reference sets otherwise
        (its ``parallel`` and ``axes`` never reach the reference).
      bounds: looser bounds ``{quantity: (rtol, atol)}`` of the comparison with the
        reference, with the measured reason beside each (quantities: ``loss``,
        ``grads``, ``params``, ``logits``, FP8's ``amax``: the first step's amaxes,
        1e-6 relative by default); the default is fp32's ``(1e-5, 1e-5)``.
      first_step: FP8: only the first training step is bounded (:data:`FP8_BOUNDS`);
        later steps follow whole-quantum flips of fp32 rounding noise.
      device: the platform it runs on (``"gpu"``: cuDNN's kernel).
      cpu_stand_in: how a ``device="gpu"`` feature runs on another backend: a context
        manager (made by calling it) the harness runs the sharded model in, which puts
        a kernel of that backend in the GPU kernel's place; None: the harness skips the
        feature there. ``cudnn_attention``'s is :func:`xla_for_cudnn` (XLA's
        implementation of ``jax.nn.dot_product_attention`` in cuDNN's place): on CPU its
        sets check everything sp_jax does around the kernel (the call's arguments:
        ``scale``, causality, the window as ``local_window_size``, the grouped-query
        head layout; the sharding under every layout; the prefill in generate) against
        the unsharded model, whose attention is sp_jax's own kernel; cuDNN's numerics
        and its input contract (fp16/bf16 inputs, head sizes) are checked on a GPU only.
      within: features that hold this one already: with one of them its ``config`` is
        left out (``layer_windows`` with a window is a sliding window, and GPTConfig
        takes the window either per layer or once).
    """

    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    parallel: dict[str, Any] = dataclasses.field(default_factory=dict)
    axes: dict[str, int] = dataclasses.field(default_factory=dict)
    call: dict[str, bool] = dataclasses.field(default_factory=dict)
    implies: tuple[str, ...] = ()
    reference: dict[str, Any] = dataclasses.field(default_factory=dict)
    bounds: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    first_step: bool = False
    device: str = "any"
    # not in the repr: a function's repr holds its address, and covering.fingerprint
    # hashes the features' reprs
    cpu_stand_in: Callable[[], contextlib.AbstractContextManager] | None = dataclasses.field(
        default=None, repr=False)
    within: tuple[str, ...] = ()


FP32_BOUND = (1e-5, 1e-5)
"""fp32 against the unsharded model: only the reductions' summation order differs."""

FP8_BOUNDS = {"loss": (4e-4, 0.0), "grads": (2e-2, 2e-3), "logits": (2e-3, 2e-2)}
"""FP8 (tests/test_fp8.py, tests/test_compat.py): the same whole-tensor scales sharded
and unsharded, so only fp32 summation order differs, which flips a rare value by one FP8
quantum: the first step's loss within 4e-4, its gradients and the logits as in
test_compat's FP8 cases; the first step's amaxes (delayed scaling) within 1e-6. In eval a
position may be further off where the reference itself moves as far under fp32 noise of
its weights (a value on an FP8 rounding boundary: combinations/harness.py's ``_noise``)."""

_FP8 = dict(bounds=FP8_BOUNDS, first_step=True)


def _pipeline(schedule: str) -> Feature:
    return Feature(parallel=dict(pipeline_axis="stage", pipeline_microbatches=2,
                                 pipeline_schedule=schedule), axes={"stage": 2},
                   implies=("scan_layers",))


_EXPERTS = dict(num_experts=4, moe_mlp_hidden=16)


@contextlib.contextmanager
def xla_for_cudnn() -> Iterator[None]:
    """``jax.nn.dot_product_attention`` with XLA's implementation where a caller asks for
    cuDNN's (``implementation="cudnn"`` becomes ``"xla"``; every other argument, and
    every other call, passed through unchanged), restored on exit: the stand-in of
    ``cudnn_attention`` off a GPU (:attr:`Feature.cpu_stand_in`). JAX's caches of
    traced and compiled functions are cleared on entry and on exit, so that nothing
    traced inside (the ``"cudnn"`` branch of sp_jax's kernels calls the function at
    trace time) is reused outside, or the other way round."""
    original = jax.nn.dot_product_attention

    def dot_product_attention(*args, implementation=None, **kwargs):
        return original(*args, implementation="xla" if implementation == "cudnn"
                        else implementation, **kwargs)

    jax.clear_caches()
    jax.nn.dot_product_attention = dot_product_attention
    try:
        yield
    finally:
        jax.nn.dot_product_attention = original
        jax.clear_caches()


FEATURES: dict[str, Feature] = {
    "tensor_sequence": Feature(axes={"tensor": 2}),
    "collective_matmul": Feature(parallel=dict(collective_matmul=True)),
    "recompute_allgather": Feature(parallel=dict(recompute_allgather=True)),
    "fsdp": Feature(parallel=dict(fsdp=True), axes={"data": 2}),
    "context_ring": Feature(parallel=dict(context_parallel="ring"), axes={"context": 2}),
    "context_ulysses": Feature(parallel=dict(context_parallel="ulysses"), axes={"context": 2}),
    "pipeline_gpipe": _pipeline("gpipe"),
    "pipeline_1f1b": _pipeline("1f1b"),
    "scan_layers": Feature(config=dict(scan_layers=True)),
    "unrolled_layers": Feature(config=dict(scan_layers=False)),
    "experts": Feature(config=_EXPERTS),
    "expert_parallel": Feature(parallel=dict(expert_axis="expert"), axes={"expert": 2},
                               implies=("experts",)),
    "interleaved_experts": Feature(config=dict(_EXPERTS, moe_layer_freq=2),
                                   implies=("experts",)),
    "dense_layers": Feature(config=dict(_EXPERTS, num_dense_layers=1), implies=("experts",)),
    # DeepSeek-V3's routing at the smallest size: 2 groups of 2 experts, 1 chosen
    "sigmoid_routing": Feature(config=dict(_EXPERTS, moe_scoring="sigmoid", moe_groups=2,
                                           moe_topk_groups=1, moe_routed_scale=2.5),
                               implies=("experts",)),
    "aux_free_bias": Feature(config=dict(_EXPERTS, moe_bias_update_rate=0.01),
                             implies=("experts",)),
    "seq_aux_loss": Feature(config=dict(_EXPERTS, moe_seq_aux_loss_coef=0.01),
                            implies=("experts",)),
    "fp8_current": Feature(config=dict(fp8=sp_jax.Fp8Recipe("current")), **_FP8),
    "fp8_delayed": Feature(config=dict(fp8=sp_jax.Fp8Recipe("delayed", 4)), **_FP8),
    "packed_documents": Feature(call=dict(documents=True)),
    "sliding_window": Feature(config=dict(sliding_window=3), within=("layer_windows",)),
    "layer_windows": Feature(config=dict(layer_windows=(3, None))),
    # cuDNN's kernel takes fp16 / bf16 only (fp32 compute is refused at construction): bf16
    # compute, fp32 parameters, against the same bf16 model unsharded with sp_jax's kernel,
    # so only the kernel and the sharding differ. Each bf16 GEMM output is rounded to 8
    # significant bits, in another summation order sharded. Measured (XLA:CPU, the stand-in;
    # the first 6 of the 18 cudnn cases, 2026-12-07): losses 2.8e-4 relative; first-step
    # gradients within 2.4e-3 + 1e-2 x |g| (up to 0.29); logits and hidden states within
    # 3.4e-2 + 1e-2 x |x| (up to 3.7: about two bf16 quanta), the cache's next-token logits
    # within 1.4e-2 of both references; the greedy tokens equal. Parameters after 3 AdamW
    # steps moved by up to 8.2e-3: an entry whose gradient is near zero moves by up to lr
    # (3e-3) a step either way, as with grad_reduce_dtype. Bounds: about 3x of these
    "cudnn_attention": Feature(config=dict(attention_implementation="cudnn",
                                           dtype=jnp.bfloat16), device="gpu",
                               cpu_stand_in=xla_for_cudnn,
                               reference=dict(attention_implementation="xla"),
                               bounds=dict(loss=(1e-3, 1e-5), grads=(1e-2, 7e-3),
                                           params=(1e-2, 2e-2), logits=(1e-2, 1e-1))),
    # grouped-query attention: 8 query heads in 4 groups (head size 4), so that every mesh
    # of the array splits the key/value heads whole (tensor 2 x Ulysses' context 2: one
    # key/value head a device; BASE's 4 heads in 2 groups would leave Ulysses half a one)
    "grouped_query": Feature(config=dict(num_heads=8, num_kv_heads=4)),
    "attention_dropout": Feature(config=dict(attention_dropout=0.1)),
    "attention_softcap": Feature(config=dict(attention_softcap=5.0)),
    "custom_loss": Feature(call=dict(custom_loss=True)),
    "zero1": Feature(parallel=dict(fsdp="optimizer"), axes={"data": 2}),
    # bf16 reduce: each device's gradient is rounded to bf16 (8 significant bits) before
    # the sum over data, and the sum is bf16: an entry differs by up to ~2^-8 of the
    # largest partials (measured: 5.7e-4 with gradients up to 0.17; the loss of later
    # steps 6e-5 relative). AdamW divides by sqrt(v) + eps, so an entry whose gradient is
    # near zero moves by up to lr a step either way (measured: 2.8e-3 after 3 steps at
    # lr 3e-3): the parameters are bounded by STEPS * lr, the gradients are the strict
    # check of the reduction
    "grad_reduce_dtype": Feature(parallel=dict(grad_reduce_dtype="bfloat16"), axes={"data": 2},
                                 bounds=dict(grads=(1e-2, 1e-3), params=(1e-3, 1e-2),
                                             loss=(2e-4, 1e-5))),
    "offload_optimizer": Feature(call=dict(offload=True), reference=dict(offload=False)),
    "offload_activations": Feature(parallel=dict(offload_activations=True)),
    "mla_attention": Feature(config=dict(attention="mla", q_lora_rank=12, kv_lora_rank=16,
                                         qk_nope_head_dim=8, qk_rope_head_dim=4,
                                         v_head_dim=6)),
    "mtp": Feature(config=dict(mtp_depth=1, mtp_loss_weight=0.3)),
    # rank 4 on every target; B drawn at random (PEFT's init_lora_weights=False), so the
    # adapters change every mode's output from the start and both A and B have gradients
    "lora": Feature(config=dict(lora=sp_jax.LoRAConfig(rank=4, alpha=8,
                                                       init_lora_weights=False))),
}
"""Every feature of ``sp_jax.compat.FEATURES``, declared."""

_FP8_IN_BF16 = dict(loss=(3e-3, 0.0), grads=(2e-2, 7e-2), logits=(1e-2, 0.5),
                    amax=(0.2, 0.0))
PAIR_BOUNDS: dict[frozenset[str], dict[str, tuple[float, float]]] = {
    frozenset({"cudnn_attention", fp8}): _FP8_IN_BF16 for fp8 in ("fp8_current", "fp8_delayed")}
"""Bounds of two features together looser than either's. FP8 with cuDNN's bf16 compute:
the activations are rounded to bf16 before their amax and quantisation, in another order
sharded, so more values flip by an FP8 quantum (e4m3: 3 mantissa bits) than at fp32
compute (FP8_BOUNDS). Measured (XLA:CPU stand-in, cudnn-04 / cudnn-05 train, 2026-12-07):
the first step's loss 1.1e-3 relative, its gradients within 2.2e-2 + 1e-2 x |g| (up to
0.29); the later losses 6.3e-3 relative (the harness's 1e-2). Bounds: about 3x.
Eval (cudnn-05 / cudnn-06, 2026-12-07; one device both, so only the attention kernel
differs: a bf16 difference of the attention's output moves an activation across an FP8
rounding boundary, one e4m3 quantum, ~6%, which the later layers carry): logits within
0.221 + 1e-2 x |x| (largest difference 0.224 of logits up to ~4), hidden states within
0.221 + 1e-2 x |x|; the cache's next-token logits 6.1e-2 from the reference's. Bound:
about 2.3x (atol 0.5). The first step's amaxes (delayed scaling; fp32 compute: 1e-6)
are amaxes of bf16 tensors, which the other attention kernel (its backward too) moves:
measured (cudnn-05 train, 2026-12-07, every history) the weights' equal, the
activations' within 2.3e-2 relative, the output gradients' within 7.7e-2 (block 0's
qkv: 1.508 against 1.633; its gradients themselves are within the ``grads`` bound);
bound 0.2 (``amax``). Generate: cudnn-06's greedy
tokens differ at one position, where the reference's logits of the two tokens are
0.0197 apart (a near-tie; the harness's ``_greedy``); cudnn-05's are equal."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """What ``setup`` gives: the configuration's fields, the ``ParallelConfig``, the mesh
    shape over :data:`AXES` and the call's options; ``names``: the features (the given
    ones and those they imply); ``bounds``: the comparison's ``{quantity: (rtol, atol)}``
    (the loosest of the features', fp32's otherwise); ``first_step``: FP8 (only the
    first training step bounded); ``device``: ``"gpu"`` where a feature needs one, else
    ``"any"``; ``reference_fields``: the config / call fields the reference sets
    otherwise."""

    names: tuple[str, ...]
    config: dict[str, Any]
    parallel: sp_jax.ParallelConfig
    shape: tuple[int, ...]
    call: dict[str, bool]
    bounds: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    first_step: bool = False
    device: str = "any"
    reference_fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    cpu_stand_in: Callable[[], contextlib.AbstractContextManager] | None = None

    def gpt_config(self) -> GPTConfig:
        """The ``GPTConfig`` (its construction checks what is refused in every mode)."""
        return GPTConfig(**self.config)

    def mesh(self) -> jax.sharding.Mesh:
        """The mesh, Explicit axes, over the first devices."""
        return jax.make_mesh(self.shape, AXES, axis_types=(AxisType.Explicit,) * len(AXES),
                             devices=jax.devices()[:int(np.prod(self.shape))])

    @property
    def devices(self) -> int:
        """How many devices the mesh spans."""
        return int(np.prod(self.shape))

    def bound(self, quantity: str) -> tuple[float, float]:
        """``(rtol, atol)`` of ``quantity`` (``loss``, ``grads``, ``params``,
        ``logits``)."""
        return self.bounds.get(quantity, FP32_BOUND)

    def reference(self) -> Setup:
        """The same model unsharded: one device, the default ``ParallelConfig``, the
        configuration and call with the features' ``reference`` fields."""
        config = dict(self.config)
        call = dict(self.call)
        for k, v in self.reference_fields.items():
            (call if k in call else config)[k] = v
        return Setup(self.names, config, sp_jax.ParallelConfig(), (1,) * len(AXES), call,
                     self.bounds, self.first_step, self.device)


def _merge(into: dict[str, Any], new: dict[str, Any], what: str) -> None:
    for k, v in new.items():
        if k in into and into[k] != v:
            raise ValueError(f"compat_features: {what} sets {k}={v!r} against {into[k]!r} "
                             "(two values of one option)")
        into[k] = v


def _loosen(bounds: dict[str, tuple[float, float]],
            new: dict[str, tuple[float, float]]) -> None:
    """``bounds`` widened in place to hold ``new`` too (each quantity's larger rtol and
    atol; fp32's where it has none yet)."""
    for quantity, (rtol, atol) in new.items():
        old = bounds.get(quantity, FP32_BOUND)
        bounds[quantity] = (max(old[0], rtol), max(old[1], atol))


def setup(names: Iterable[str]) -> Setup:
    """The model and call with the features ``names`` (and what they imply) together."""
    chosen = list(dict.fromkeys(names))
    for name in list(chosen):
        for implied in FEATURES[name].implies:
            others = [f for f in chosen if compat.cell("train", implied, f).status ==
                      "exclusive"]
            if implied not in chosen and not others:
                chosen.append(implied)
    config, parallel, axes, call, reference, bounds = {}, {}, {}, {}, {}, {}
    for name in chosen:
        feature = FEATURES[name]
        if not set(feature.within) & set(chosen):
            _merge(config, feature.config, name)
        _merge(parallel, feature.parallel, name)
        _merge(call, feature.call, name)
        _merge(reference, feature.reference, name)
        for axis, size in feature.axes.items():
            axes[axis] = max(axes.get(axis, 1), size)
        _loosen(bounds, feature.bounds)
    for pair, loose in PAIR_BOUNDS.items():
        if pair <= set(chosen):
            _loosen(bounds, loose)
    features = [FEATURES[n] for n in chosen]
    gpu = next((f for f in features if f.device != "any"), None)
    return Setup(tuple(chosen), BASE | config, sp_jax.ParallelConfig(**parallel),
                 tuple(axes.get(a, 1) for a in AXES), call, bounds,
                 any(f.first_step for f in features), gpu.device if gpu else "any",
                 reference, gpu.cpu_stand_in if gpu else None)
