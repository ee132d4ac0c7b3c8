"""``make gpu-check``: the GPT training step on 1 to 8 real GPUs, in one command.

``python -m scripts.gpu_check --out DIR [--quick] [--platform auto|gpu|cpu]
[--devices N]`` trains the sp_jax GPT (bf16 compute, fp32 parameters, AdamW, random
tokens; ``ParallelConfig(wgrad_dtype=jnp.float32, recompute_allgather=True)``, mesh
``data=1 x tensor=N``) as six variants, all at tensor size ``N``, the number of GPUs
(at most 8):

======================  ================================================  ==============
variant                 what                                              mesh
======================  ================================================  ==============
``sp_jax``              :class:`sp_jax.models.GPT`                        1 x N Explicit
``sp_jax_cm``           the same with                                     1 x N Explicit
                        ``ParallelConfig(collective_matmul=True)``
``gspmd``               :class:`benchmarks.baseline.GspmdGPT` (sharding   1 x N Auto
                        annotations, GSPMD inserts the collectives), the
                        sp_jax GPT's weights
``unsharded``           :class:`sp_jax.models.GPT` on one GPU             1 x 1 Explicit
``sp_jax_fp8_current``  ``sp_jax`` with                                   1 x N Explicit
                        ``GPTConfig(fp8=sp_jax.Fp8Recipe("current"))``:
                        the blocks' projections in FP8, current scaling
``sp_jax_fp8_delayed``  the same with ``Fp8Recipe("delayed")`` (scales    1 x N Explicit
                        from a 16-step amax history)
``sp_jax_cudnn``        ``sp_jax`` with ``GPTConfig(attention_implementation  1 x N Explicit
                        ="cudnn")``: cuDNN's fused attention (bf16) in
                        place of sp_jax's blockwise kernel; GPUs only
======================  ================================================  ==============

Every variant starts from the same weights (parameter seed ``--seed``; the GSPMD model
gets the sp_jax model's values through :func:`benchmarks.baseline.copy_weights`) and
trains on the same batch; the loss of the first step is reported for each, so a variant
that computes something else shows.

What is measured, and how
-------------------------
- **Step time**: ``--warmup`` steps (the first compiles), then ``--steps`` steps, each
  timed on its own up to ``jax.block_until_ready`` of the new parameters, optimizer
  state and metrics; the median is reported (and every sample in the JSON).
  ``tokens/s = batch * seq / step time`` (global tokens, all devices of the variant).
- **MFU** (model FLOPs utilisation), the PaLM convention (Chowdhery et al. 2022,
  appendix B): ``flops = 6 * P * T + 12 * L * h * s * T`` per step, with ``T = batch *
  seq`` tokens, ``P`` the parameters that take part in matmuls (all parameters but the
  learned position table; the tied embedding counts once, as the LM head), ``L`` layers,
  ``h`` hidden size, ``s`` sequence length (attention counted as the full ``s x s``
  product, causal masking not subtracted; recomputation is not model FLOPs).
  ``MFU = flops / (step time * devices * peak)``, the peak dense bf16 FLOP/s per device
  looked up by ``device_kind`` in :data:`PEAK_BF16_FLOPS`; an unknown kind (and a CPU)
  gets ``null`` with the reason. The FP8 variants' MFU uses the same formula and the
  same **bf16** peak (not the FP8 peak, twice as high on H100 / H200), so FP8 GEMMs that
  run faster show as an MFU above the bf16 variant's; the report also gives each FP8
  variant's tokens/s as a ratio to the bf16 ``sp_jax`` variant's.
- **cuBLASLt FP8 GEMMs** (FP8 variants, on GPU): the number of
  ``__cublas$lt$matmul$f8`` custom calls in the compiled step's HLO
  (``compiled.as_text()``), i.e. how many of the step's GEMMs XLA handed to cuBLASLt in
  FP8 (forward, dgrad and wgrad of every FP8 projection); ``"n/a"`` on CPU (no cuBLASLt).
- **cuDNN attention** (``sp_jax_cudnn``, on GPU): its tokens/s as a ratio to the
  ``sp_jax`` variant's (the same step with sp_jax's blockwise attention), its first loss
  against ``sp_jax``'s (the same weights and batch: equal up to bf16 rounding) and the
  number of cuDNN fused-attention custom calls (``__cudnn$fmha...``, forward and
  backward of every layer) in the compiled step's HLO. Off a GPU the variant is not run
  (cuDNN's kernel exists on GPUs only). Every run also compiles the step deviceless for
  ``tensor`` H100s (``--deviceless``, in a worker: :func:`deviceless_cudnn`) and counts
  the same custom calls there, which shows the cuDNN path lowers to cuDNN's kernel on
  XLA:GPU without a GPU.
- **Real peak memory per device**: ``Device.memory_stats()["peak_bytes_in_use"]``, the
  allocator's high-water mark. JAX cannot reset it, so **each variant runs in a fresh
  subprocess** and the peak covers that process only: building the model, compiling
  and the steps. The JSON also keeps the peak reached before the first step
  (``peak_before_steps``); ``peak_set_by_steps`` says whether the steps raised it, i.e.
  whether the reported peak is the training step's (if not, set-up was the high-water
  mark and the step's own peak is at most the reported value). The table shows the
  largest peak over the variant's devices. On CPU ``memory_stats()`` is ``None``:
  reported as not measured.
- **Predicted peak per device**: the deviceless prediction for the same compiled
  program, ``step.compile(batch, key).memory_analysis()``: ``temp + argument + output -
  alias`` bytes. It covers the step's own buffers only; the allocator's peak also
  counts fragmentation, set-up transients and whatever else the process holds.
- **Trace**: ``--trace-steps`` further steps of ``sp_jax_cm`` under
  ``jax.profiler.trace(DIR/trace)`` (after its timed steps, so tracing does not touch
  the timings); open it with TensorBoard's profile plugin or Perfetto (xprof).

With one GPU (``N = 1``) there is no communication at all: collective matmul, the
sequence-parallel all-gathers / reduce-scatters and their overlap with compute are not
exercised (``sp_jax_cm`` runs the plain path); memory and single-device speed are. The
report says so.

Model shapes (:data:`FULL_SHAPE`)
---------------------------------
hidden 4096, 32 heads (head dim 128), 8 layers, sequence 2048, vocabulary 32768, global
batch 8 (16384 tokens a step): 1.75 B parameters, layers as wide as Llama-7B's at a
fraction of its depth (8 unrolled layers keep compiles short), with matmuls large enough
for tensor cores even split 8 ways (``4 * h / 8 = 2048`` columns). The unsharded variant
holds the whole model on one GPU (26 GiB of fp32 parameters, AdamW moments and fp32
gradients, plus bf16 activations): the deviceless H100 prediction of its step (jaxlib
0.10.2, parameters and optimizer state donated as :class:`~sp_jax.training.TrainStep`
does) is 47.6 GiB, within the 56 GiB of JAX's default memory pool (75%) of an 80 GB GPU;
at tensor 8 it is 6.0 GiB per device. Those deviceless compiles took 10-35 s on two CPU
cores. Should a GPU run out of memory, ``--batch 4`` halves the activations. When ``N``
does not divide the heads (or the sequence), the heads are raised to the next multiple
of ``N`` at the same head dim (and the sequence cut to a multiple of ``N``); the report
lists such changes. ``--quick`` uses a tiny GPT (:data:`QUICK_SHAPE`); ``--hidden``,
``--layers``, ... override either shape.

Flags and platforms
-------------------
On GPUs, sp_jax's recommended XLA GPU flags (:func:`sp_jax.xla_flags.apply_xla_flags`)
are set before JAX starts in the workers; on GPUs the FP8 variants' workers also get
:data:`sp_jax.xla_flags.FP8_GPU_FLAGS` (``--xla_gpu_enable_triton_gemm=false``, so that XLA
emits cuBLASLt FP8 GEMMs rather than Triton ones; those the installed jaxlib accepts, a
value already in ``XLA_FLAGS`` kept). ``--platform cpu`` (or ``auto`` on a machine without
a GPU) runs on ``--devices`` simulated CPU devices
(:func:`sp_jax.xla_flags.cpu_simulation_flags`), for testing, and only with ``--quick``
(the full shapes are sized for GPUs): step times then only show that everything runs.

Outputs: ``DIR/gpu_check.json``, ``DIR/gpu_check.md`` (the table and these notes),
``DIR/trace/`` and ``DIR/logs/`` (each worker's log and raw result).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sp_jax.xla_flags import (
    FP8_GPU_FLAGS,
    apply_xla_flags,
    cpu_simulation_flags,
    supported_xla_flags,
)

__all__ = ["FULL_SHAPE", "QUICK_SHAPE", "PEAK_BF16_FLOPS", "VARIANTS", "FP8_VARIANTS",
           "GPU_VARIANTS", "CUDNN_VARIANT", "cudnn_calls", "deviceless_cudnn",
           "ModelShape", "Settings", "fit_shape", "model_flops", "peak_bf16_flops",
           "run_check", "main"]

ROOT = Path(__file__).resolve().parents[1]
MAX_DEVICES = 8
VARIANTS = ("sp_jax", "sp_jax_cm", "gspmd", "unsharded", "sp_jax_fp8_current",
            "sp_jax_fp8_delayed")
CUDNN_VARIANT = "sp_jax_cudnn"
"""cuDNN's attention: run on GPUs only (by default there, or named with --variants)."""
GPU_VARIANTS = (CUDNN_VARIANT,)
CUDNN_TARGET = "__cudnn$fmha"
"""The prefix of XLA:GPU's cuDNN fused-attention custom calls (``__cudnn$fmhaSoftmax``,
``__cudnn$fmhaSoftmaxBackward``, ...), counted in the cuDNN step's HLO."""
FP8_VARIANTS = {"sp_jax_fp8_current": "current", "sp_jax_fp8_delayed": "delayed"}
"""The FP8 variants and their ``Fp8Recipe.scaling``: ``sp_jax`` otherwise."""
FP8_BASELINE = "sp_jax"
"""The bf16 variant the FP8 variants' tokens/s are compared with."""
FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
"""The custom call of XLA:GPU's cuBLASLt FP8 GEMMs, counted in the FP8 steps' HLO."""
NOT_APPLICABLE = "n/a"
TRACE_VARIANT = "sp_jax_cm"
LABELS = {
    "sp_jax": "sp_jax TP+SP",
    "sp_jax_cm": "sp_jax TP+SP, collective matmul",
    "gspmd": "GSPMD baseline GPT",
    "unsharded": "sp_jax GPT, one device",
    "sp_jax_fp8_current": "sp_jax TP+SP, FP8 current scaling",
    "sp_jax_fp8_delayed": "sp_jax TP+SP, FP8 delayed scaling",
    CUDNN_VARIANT: "sp_jax TP+SP, cuDNN attention",
}
MIB = 2**20
NOT_MEASURED = "not measured"

PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
)
"""Dense bf16 peak FLOP/s per device, by a substring of ``device_kind`` (first match
wins; NVIDIA datasheets: H100 / H200 SXM 989 TFLOP/s, H100 PCIe 756, A100 312). Kinds
with ``NVL`` (a lower power limit than SXM) are left unknown rather than guessed."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The GPT of the check: ``hidden``, ``heads``, ``layers``, sequence ``seq``,
    vocabulary ``vocab`` and global ``batch`` (sequences per step)."""

    hidden: int
    heads: int
    layers: int
    seq: int
    vocab: int
    batch: int

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelShape.{field.name}={value!r} must be a positive int.")
        if self.hidden % self.heads:
            raise ValueError(f"ModelShape: hidden={self.hidden} must be divisible by "
                             f"heads={self.heads} (e.g. --heads {self.hidden // 128 or 1}).")

    @property
    def tokens(self) -> int:
        """Tokens per step, ``batch * seq``."""
        return self.batch * self.seq

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


FULL_SHAPE = ModelShape(hidden=4096, heads=32, layers=8, seq=2048, vocab=32768, batch=8)
"""Default shape on GPUs: see the module docstring for the choice."""
QUICK_SHAPE = ModelShape(hidden=64, heads=4, layers=1, seq=64, vocab=256, batch=4)
"""``--quick``: a tiny GPT for smoke tests (seconds on CPU)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Repeat counts: ``warmup`` untimed steps (at least 1: the first compiles and gives
    the initial loss), ``steps`` timed steps, ``trace_steps`` traced steps of
    ``sp_jax_cm``, parameter / data ``seed``, per-variant ``timeout_s``."""

    warmup: int
    steps: int
    trace_steps: int
    seed: int = 0
    timeout_s: float = 240.0

    def __post_init__(self) -> None:
        if self.warmup < 1:
            raise ValueError(f"Settings.warmup={self.warmup} must be >= 1 (the first step "
                             "compiles and reports the initial loss).")
        if self.steps < 1:
            raise ValueError(f"Settings.steps={self.steps} must be >= 1.")
        if self.trace_steps < 0:
            raise ValueError(f"Settings.trace_steps={self.trace_steps} must be >= 0.")
        if self.timeout_s <= 0:
            raise ValueError(f"Settings.timeout_s={self.timeout_s} must be positive.")


FULL_SETTINGS = Settings(warmup=3, steps=10, trace_steps=3)
QUICK_SETTINGS = Settings(warmup=1, steps=3, trace_steps=2, timeout_s=120.0)


def fit_shape(shape: ModelShape, tensor: int) -> tuple[ModelShape, list[str]]:
    """``shape`` adjusted so that tensor size ``tensor`` divides the heads and the
    sequence: heads raised to the next multiple of ``tensor`` at the same head dim (the
    hidden size grows with them), the sequence cut to a multiple of ``tensor``.

    Returns:
      the shape and one note per change (empty when nothing changed).
    """
    notes = []
    heads, hidden, seq = shape.heads, shape.hidden, shape.seq
    if heads % tensor:
        head_dim = hidden // heads
        heads = -(-heads // tensor) * tensor
        hidden = heads * head_dim
        notes.append(f"heads {shape.heads} -> {heads} (a multiple of tensor={tensor}) at head "
                     f"dim {head_dim}: hidden {shape.hidden} -> {hidden}")
    if seq % tensor:
        seq = seq // tensor * tensor
        if seq == 0:
            raise ValueError(f"fit_shape: seq={shape.seq} is shorter than tensor={tensor}; "
                             f"use --seq >= {tensor}.")
        notes.append(f"seq {shape.seq} -> {seq} (a multiple of tensor={tensor}, sequence "
                     "parallelism splits it)")
    return dataclasses.replace(shape, heads=heads, hidden=hidden, seq=seq), notes


def model_flops(shape: ModelShape, matmul_params: int) -> float:
    """Model FLOPs of one training step (PaLM appendix B): ``6 * P * T + 12 * L * h * s
    * T`` with ``T = batch * seq`` tokens and ``P = matmul_params``."""
    t = shape.tokens
    return 6.0 * matmul_params * t + 12.0 * shape.layers * shape.hidden * shape.seq * t


def peak_bf16_flops(device_kind: str) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s of one ``device_kind`` device or None, where it came from
    or why there is none), from :data:`PEAK_BF16_FLOPS`."""
    if "NVL" not in device_kind:
        for key, peak in PEAK_BF16_FLOPS:
            if key.lower() in device_kind.lower():
                return peak, f"{peak / 1e12:g} TFLOP/s dense bf16 ({key}, by device_kind)"
    return None, (f"{NOT_MEASURED}: no peak bf16 FLOP/s known for device_kind "
                  f"{device_kind!r} (known: {', '.join(k for k, _ in PEAK_BF16_FLOPS)})")


# -- worker: one variant in a fresh process ----------------------------------------------


def _mesh(n: int, axis_type: Any) -> Any:
    import jax

    if jax.device_count() < n:
        raise ValueError(f"gpu_check: need {n} devices, JAX sees {jax.device_count()} "
                         f"({jax.devices()[0].platform}).")
    return jax.make_mesh((1, n), ("data", "tensor"), axis_types=(axis_type, axis_type),
                         devices=jax.devices()[:n])


def _memory(devices: list[Any]) -> list[dict[str, int]] | None:
    """``bytes_in_use`` and ``peak_bytes_in_use`` per device; None when the backend
    keeps no allocator statistics (CPU)."""
    stats = [d.memory_stats() for d in devices]
    if any(s is None or "peak_bytes_in_use" not in s for s in stats):
        return None
    return [{"bytes_in_use": int(s.get("bytes_in_use", 0)),
             "peak_bytes_in_use": int(s["peak_bytes_in_use"])} for s in stats]


def _build(variant: str, shape: ModelShape, tensor: int, seed: int) -> tuple[Any, Any]:
    """(mesh, TrainStep) of ``variant``; the step is created under the mesh."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import AxisType

    import sp_jax
    from benchmarks.baseline import GspmdGPT, copy_weights
    from sp_jax.models import GPT, GPTConfig
    from sp_jax.training import TrainStep

    fp8 = sp_jax.Fp8Recipe(FP8_VARIANTS[variant]) if variant in FP8_VARIANTS else None
    cfg = GPTConfig(vocab_size=shape.vocab, max_seq_len=shape.seq, num_layers=shape.layers,
                    num_heads=shape.heads, hidden=shape.hidden, dtype=jnp.bfloat16,
                    param_dtype=jnp.float32, fp8=fp8,
                    attention_implementation="cudnn" if variant == CUDNN_VARIANT else "xla")
    parallel = sp_jax.ParallelConfig(wgrad_dtype=jnp.float32, recompute_allgather=True,
                                     collective_matmul=variant == "sp_jax_cm")
    tx = optax.adamw(1e-4)
    n = 1 if variant == "unsharded" else tensor
    explicit = _mesh(n, AxisType.Explicit)
    with jax.set_mesh(explicit):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(seed))
    if variant != "gspmd":
        with jax.set_mesh(explicit):
            step = TrainStep(model, tx)
        mesh = explicit
    else:
        mesh = _mesh(n, AxisType.Auto)
        with jax.set_mesh(mesh):
            # its own initial values are overwritten by the sp_jax model's
            base = GspmdGPT(cfg, layout=sp_jax.Layout.of(parallel), rngs=nnx.Rngs(seed))
            copy_weights(base, model)
            del model
            step = TrainStep(base, tx)
    # The model then refers to the step's parameter arrays (no second copy on device).
    step.sync_model()
    return mesh, step


def run_variant(spec: dict[str, Any]) -> dict[str, Any]:
    """Builds, compiles, times and (for :data:`TRACE_VARIANT`) traces one variant in this
    process; ``spec`` as written by :func:`_worker_spec`. JAX must not have started yet
    in this process when it is fresh (the real peak covers the whole process)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    import sp_jax
    from sp_jax.layers.fp8 import split_fp8

    variant, tensor = spec["variant"], spec["tensor"]
    shape, settings = ModelShape(**spec["shape"]), Settings(**spec["settings"])
    t_start = time.perf_counter()
    mesh, step = _build(variant, shape, tensor, settings.seed)
    devices = list(mesh.devices.flat)
    layout = sp_jax.Layout.of(sp_jax.ParallelConfig())
    ids = np.random.default_rng(settings.seed + 1).integers(
        0, shape.vocab, size=(1, shape.batch, shape.seq + 1), dtype=np.int32)
    result: dict[str, Any] = {"variant": variant, "devices": len(devices),
                              "device_kind": devices[0].device_kind,
                              "platform": devices[0].platform}
    with jax.set_mesh(mesh):
        sharding = NamedSharding(mesh, layout.micro_batched_tokens)
        batch = {"tokens": jax.device_put(ids[..., :-1], sharding),
                 "labels": jax.device_put(ids[..., 1:], sharding)}
        key = jax.random.key(settings.seed + 2)
        # the model's parameters: an FP8 step's amax histories are state, not parameters
        trainable, histories = split_fp8(step.params)
        sizes = {jax.tree_util.keystr(path): int(p.size)
                 for path, p in jax.tree_util.tree_leaves_with_path(trainable)}
        result["params"] = sum(sizes.values())
        # the learned position table is added, not multiplied: no model FLOPs
        result["matmul_params"] = sum(n for k, n in sizes.items() if "position" not in k)
        t0 = time.perf_counter()
        compiled = step.compile(batch, key)
        result["compile_s"] = time.perf_counter() - t0
        if variant in FP8_VARIANTS:
            result["fp8_scaling"] = FP8_VARIANTS[variant]
            result["fp8_history_values"] = sum(int(h.size) for h in jax.tree.leaves(histories))
            result["xla_flags"] = os.environ.get("XLA_FLAGS", "")
            if result["platform"] == "gpu":
                result["fp8_gemms"] = compiled.as_text().count(
                    f'custom_call_target="{FP8_GEMM_TARGET}"')
                result["fp8_gemms_note"] = (f"{FP8_GEMM_TARGET} custom calls in the "
                                            "compiled step's HLO")
            else:
                result["fp8_gemms"] = NOT_APPLICABLE
                result["fp8_gemms_note"] = (f"{NOT_APPLICABLE}: no cuBLASLt on "
                                            f"{result['platform']} (XLA has no FP8 GEMMs there)")
        if variant == CUDNN_VARIANT:
            result["cudnn_calls"] = cudnn_calls(compiled.as_text())
        try:
            ma = compiled.memory_analysis()
            parts = {name: int(getattr(ma, f"{name}_size_in_bytes"))
                     for name in ("temp", "argument", "output", "alias")}
            result["predicted"] = parts
            result["predicted_peak_bytes"] = (parts["temp"] + parts["argument"]
                                              + parts["output"] - parts["alias"])
        except Exception as e:  # noqa: BLE001 - memory_analysis is optional per backend
            result["predicted"] = None
            result["predicted_peak_bytes"] = None
            result["predicted_note"] = f"{NOT_MEASURED}: memory_analysis() failed: {e}"
        try:  # XLA's own count (per device; recomputation and the optimizer included)
            result["xla_flops_per_device"] = float(compiled.cost_analysis()["flops"])
        except Exception:  # noqa: BLE001 - cost_analysis is optional per backend
            result["xla_flops_per_device"] = None
        result["memory_before_steps"] = _memory(devices)

        def one_step() -> dict[str, Any]:
            metrics = step(batch, key)
            jax.block_until_ready((step.params, step.opt_state, metrics))
            return metrics

        t0 = time.perf_counter()
        losses = [float(one_step()["loss"])]
        result["first_step_s"] = time.perf_counter() - t0
        for _ in range(settings.warmup - 1):
            one_step()
        samples = []
        for _ in range(settings.steps):
            t0 = time.perf_counter()
            metrics = one_step()
            samples.append(time.perf_counter() - t0)
        losses.append(float(metrics["loss"]))
        result["memory_after_steps"] = _memory(devices)
        if spec.get("trace_dir") and settings.trace_steps:
            try:  # a profiler that cannot start (e.g. no CUPTI) must not cost the timings
                with jax.profiler.trace(spec["trace_dir"]):
                    for _ in range(settings.trace_steps):
                        one_step()
            except Exception as e:  # noqa: BLE001 - reported, not raised
                result["trace_error"] = f"{type(e).__name__}: {e}"
    result.update(step_s_samples=samples, step_s=statistics.median(samples),
                  first_loss=losses[0], last_loss=losses[1],
                  wall_s=time.perf_counter() - t_start)
    return result


def cudnn_calls(hlo: str) -> int:
    """cuDNN fused-attention custom calls (:data:`CUDNN_TARGET` ...) in compiled HLO."""
    return hlo.count(f'custom_call_target="{CUDNN_TARGET}')


def deviceless_cudnn(spec: dict[str, Any]) -> dict[str, Any]:
    """The cuDNN variant's training step compiled for ``spec["tensor"]`` H100s without a
    GPU (:func:`sp_jax.analysis.compile_for_gpu`, the CUDA plugin's deviceless
    compiler): the number of cuDNN fused-attention custom calls in its HLO, or a
    ``note`` saying why there is no count (no CUDA plugin installed).

    Measured (jax 0.10.2, the CUDA plugin installed without NVIDIA's libraries, as
    ../shared/gpu-targets/ says): ``jax.nn.dot_product_attention(implementation=
    "cudnn")`` asks the cuDNN library for its version when it is traced
    (``check_cudnn_version``), which raises "cuDNN not found." where no libcudnn is
    loaded; nothing else of the lowering or of XLA:GPU's compile needs cuDNN (the
    custom call is built from the version number alone). So this compile answers that
    question with cuDNN 9.1.0 (a version this JAX accepts, whose feature gates it
    checks), in this worker process only."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    import sp_jax
    from sp_jax.analysis import compile_for_gpu, cuda_plugin_available
    from sp_jax.models import GPT, GPTConfig

    if not cuda_plugin_available():
        return {"cudnn_calls": None,
                "note": f"{NOT_MEASURED}: no deviceless XLA:GPU compiler (the CUDA plugin "
                        "is not installed; ../shared/gpu-targets/README.md says how)"}
    cudnn_attention.check_cudnn_version = lambda: 90100  # see the docstring
    shape, n = ModelShape(**spec["shape"]), spec["tensor"]
    cfg = GPTConfig(vocab_size=shape.vocab, max_seq_len=shape.seq, num_layers=shape.layers,
                    num_heads=shape.heads, hidden=shape.hidden, dtype=jnp.bfloat16,
                    attention_implementation="cudnn")
    parallel = sp_jax.ParallelConfig(wgrad_dtype=jnp.float32, recompute_allgather=True)
    tokens = jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32,
                                  sharding=jax.P())

    def grads(tokens):
        graph, params, rest = nnx.split(GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)),
                                        nnx.Param, ...)
        return jax.grad(lambda p: nnx.merge(graph, p, rest).loss(tokens))(params)

    report = compile_for_gpu(grads, tokens, mesh_shape=(1, n), axis_names=("data", "tensor"))
    return {"cudnn_calls": cudnn_calls(report.hlo), "target": "h100", "tensor": n,
            "note": "deviceless XLA:GPU compile of the model's loss gradients"}


# -- parent: platform, workers, report -------------------------------------------------


def _probe(timeout_s: float) -> dict[str, Any]:
    """Backend, device count and kind as a fresh JAX process sees them (the parent never
    starts JAX itself: on a GPU that would take memory from the workers)."""
    code = ("import json, jax; d = jax.devices(); print(json.dumps({'backend': "
            "jax.default_backend(), 'count': len(d), 'kind': d[0].device_kind}))")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"gpu_check: probing JAX's devices failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _resolve_platform(platform: str, devices: int | None, timeout_s: float
                      ) -> tuple[str, int, str]:
    """(``"gpu"`` or ``"cpu"``, device count ``N`` to use, device kind)."""
    if platform == "cpu":
        return "cpu", devices or MAX_DEVICES, "cpu"
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        if platform == "gpu":
            raise ValueError("gpu_check: --platform gpu with JAX_PLATFORMS=cpu in the "
                             "environment; unset JAX_PLATFORMS (make gpu-check does not set it).")
        return "cpu", devices or MAX_DEVICES, "cpu"
    found = _probe(timeout_s)
    if found["backend"] != "gpu":
        if platform == "gpu":
            raise ValueError(f"gpu_check: --platform gpu but JAX found no GPU (backend "
                             f"{found['backend']!r}); check the CUDA jaxlib plugin and driver, "
                             "or run with --platform cpu.")
        return "cpu", devices or MAX_DEVICES, "cpu"
    n = devices or min(found["count"], MAX_DEVICES)
    if n > found["count"]:
        raise ValueError(f"gpu_check: --devices {n} but JAX sees {found['count']} GPU(s).")
    return "gpu", n, found["kind"]


def _worker_spec(variant: str, tensor: int, shape: ModelShape, settings: Settings,
                 trace_dir: Path | None) -> dict[str, Any]:
    return {"variant": variant, "tensor": tensor, "shape": shape.as_dict(),
            "settings": dataclasses.asdict(settings),
            "trace_dir": str(trace_dir) if trace_dir is not None else None}


def _run_worker(spec: dict[str, Any], env: dict[str, str], log_dir: Path,
                timeout_s: float) -> dict[str, Any]:
    """Runs :func:`run_variant` in a fresh Python process; its result, or
    ``{"error": ...}`` with the end of its log."""
    variant = spec["variant"]
    result_path, log_path = log_dir / f"{variant}.json", log_dir / f"{variant}.log"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "scripts.gpu_check", "--worker", json.dumps(spec),
           "--worker-result", str(result_path)]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout_s:g} s"
    wall = time.perf_counter() - t0
    if rc == 0 and result_path.exists():
        result = json.loads(result_path.read_text())
        result["process_s"] = wall
        return result
    tail = log_path.read_text()[-3000:]
    return {"variant": variant, "error": f"worker exit {rc}; log {log_path}:\n{tail}",
            "process_s": wall}


def _worker_env(platform: str, n: int) -> dict[str, str]:
    """The workers' environment: XLA flags set here, before any JAX starts."""
    if platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        apply_xla_flags(cpu_simulation_flags(n))
    else:
        apply_xla_flags()  # sp_jax's recommended XLA GPU flags that this jaxlib accepts
    return dict(os.environ)


def _fp8_flags(platform: str) -> list[str]:
    """The XLA flags the FP8 variants' workers get besides :func:`_worker_env`'s: the
    :data:`~sp_jax.xla_flags.FP8_GPU_FLAGS` this jaxlib accepts on GPUs (cuBLASLt FP8
    GEMMs instead of Triton ones); none on CPU (GPU flags, nothing to steer there)."""
    if platform != "gpu":
        return []
    return supported_xla_flags(f.flag for f in FP8_GPU_FLAGS)


def _with_flags(env: dict[str, str], flags: list[str]) -> dict[str, str]:
    """``env`` with ``flags`` added to its ``XLA_FLAGS``; a flag already set there keeps
    its value (as :func:`~sp_jax.xla_flags.apply_xla_flags` does)."""
    current = env.get("XLA_FLAGS", "").strip()
    present = {word.lstrip("-").partition("=")[0] for word in current.split()}
    added = [f for f in flags if f.lstrip("-").partition("=")[0] not in present]
    if not added:
        return env
    return dict(env, XLA_FLAGS=" ".join([current, *added]).strip())


def _finish(result: dict[str, Any], shape: ModelShape, peak: float | None,
            peak_note: str, platform: str) -> dict[str, Any]:
    """Adds tokens/s, FLOPs, MFU and the real-peak summary to a worker's result."""
    if "error" in result:
        return result
    step_s, n = result["step_s"], result["devices"]
    flops = model_flops(shape, result["matmul_params"])
    result["step_ms"] = 1e3 * step_s
    result["tokens_per_s"] = shape.tokens / step_s
    result["flops_per_step"] = flops
    if peak is None:
        result["mfu"], result["mfu_note"] = None, peak_note
    else:
        result["mfu"] = flops / (step_s * n * peak)
        result["mfu_note"] = f"flops / (step time * {n} device(s) * {peak_note})"
        if result["variant"] in FP8_VARIANTS:
            result["mfu_note"] += (" (FP8 variant quoted against the bf16 peak: FP8 GEMMs "
                                   "faster than bf16 ones raise it above the bf16 MFU)")
    before, after = result["memory_before_steps"], result["memory_after_steps"]
    if after is None:
        result["real_peak_bytes"] = None
        result["real_peak_note"] = (f"{NOT_MEASURED}: Device.memory_stats() is None on "
                                    f"{platform} (no allocator statistics; simulated CPU "
                                    "devices share host memory)")
        result["peak_set_by_steps"] = None
    else:
        peaks = [d["peak_bytes_in_use"] for d in after]
        result["real_peak_bytes"] = max(peaks)
        result["real_peak_per_device"] = peaks
        result["peak_before_steps"] = [d["peak_bytes_in_use"] for d in before]
        raised = max(peaks) > max(result["peak_before_steps"])
        result["peak_set_by_steps"] = raised
        result["real_peak_note"] = (
            "peak_bytes_in_use of a fresh process, max over devices; set by the steps"
            if raised else "peak_bytes_in_use of a fresh process, max over devices; set "
            "before the first step (set-up or compile), so the step's own peak is at most this")
    return result


def caveats(platform: str, tensor: int, fp8: bool = False) -> list[str]:
    """What this run cannot measure, in words."""
    notes = []
    if tensor == 1:
        notes.append(
            "Single device (tensor = 1): there is no communication at all. Collective "
            "matmul, the sequence-parallel all-gathers / reduce-scatters and their overlap "
            "with compute are not exercised (sp_jax_cm runs the plain path, GSPMD inserts "
            "no collectives); memory and single-device speed are measured.")
    if platform == "cpu":
        notes.append(
            "CPU run (simulated devices share the host's cores and memory): step times only "
            "show that every variant runs; real peak memory and MFU are not measured; "
            f"{CUDNN_VARIANT} (cuDNN's attention) is not run, only compiled deviceless.")
        if fp8:
            notes.append(
                "FP8 variants on CPU: XLA:CPU has no FP8 GEMM kernels (no cuBLASLt), so "
                "their tokens/s ratio to sp_jax says nothing about a GPU, and the cuBLASLt "
                "FP8 GEMM count is n/a.")
    return notes


def run_check(out: Path, *, quick: bool = False, platform: str = "auto",
              devices: int | None = None, variants: tuple[str, ...] | None = None,
              shape: ModelShape | None = None, settings: Settings | None = None
              ) -> dict[str, Any]:
    """Runs every variant in its own process and writes ``out/gpu_check.{json,md}``.

    ``variants``: None: :data:`VARIANTS`, and on GPUs :data:`GPU_VARIANTS` too.

    Returns:
      the report (what ``gpu_check.json`` holds).
    """
    t_start, started = time.perf_counter(), time.time()
    if devices is not None and not 1 <= devices <= MAX_DEVICES:
        raise ValueError(f"gpu_check: --devices {devices} must be in 1..{MAX_DEVICES}.")
    unknown = [v for v in variants or () if v not in (*VARIANTS, *GPU_VARIANTS)]
    if unknown or variants == ():
        raise ValueError(f"gpu_check: unknown variant(s) {unknown or variants}; choose from "
                         f"{[*VARIANTS, *GPU_VARIANTS]}.")
    settings = settings or (QUICK_SETTINGS if quick else FULL_SETTINGS)
    requested = shape or (QUICK_SHAPE if quick else FULL_SHAPE)
    platform, n, kind = _resolve_platform(platform, devices, min(settings.timeout_s, 120.0))
    if platform == "cpu" and not quick:
        raise ValueError("gpu_check: no GPU in use (platform cpu), and the full GPT "
                         f"({requested.hidden} hidden, {requested.layers} layers, seq "
                         f"{requested.seq}) is sized for GPUs; on CPU run with --quick "
                         "(tiny shapes on simulated devices, overridable with --hidden, ...).")
    if variants is None:
        variants = (*VARIANTS, *GPU_VARIANTS) if platform == "gpu" else VARIANTS
    if platform != "gpu" and set(variants) & set(GPU_VARIANTS):
        raise ValueError(f"gpu_check: --variants {CUDNN_VARIANT} runs cuDNN's attention, "
                         f"which needs a GPU (platform {platform}); leave it out.")
    shape, shape_notes = fit_shape(requested, n)
    deviceless_env = dict(os.environ, JAX_PLATFORMS="cpu")  # before _worker_env sets flags
    env = _worker_env(platform, n)
    fp8_flags = _fp8_flags(platform) if any(v in FP8_VARIANTS for v in variants) else []
    out.mkdir(parents=True, exist_ok=True)
    log_dir, trace_dir = out / "logs", out / "trace"
    log_dir.mkdir(exist_ok=True)
    peak, peak_note = peak_bf16_flops(kind) if platform == "gpu" else (
        None, f"{NOT_MEASURED}: no peak bf16 FLOP/s for a CPU (MFU is a GPU measure)")
    results = {}
    for variant in variants:
        print(f"gpu_check: {variant} ({LABELS[variant]}) on {n if variant != 'unsharded' else 1}"
              f" {platform} device(s) ...", flush=True)
        spec = _worker_spec(variant, n, shape, settings,
                            trace_dir if variant == TRACE_VARIANT else None)
        result = _run_worker(spec, _with_flags(env, fp8_flags) if variant in FP8_VARIANTS
                             else env, log_dir, settings.timeout_s)
        results[variant] = _finish(result, shape, peak, peak_note, platform)
        r = results[variant]
        print("  " + (r["error"].splitlines()[0] if "error" in r else
                      f"{r['step_ms']:.1f} ms/step, {r['tokens_per_s']:.0f} tokens/s"),
              flush=True)
    _compare_fp8(results)
    print(f"gpu_check: cuDNN attention compiled deviceless for {n} H100(s) ...", flush=True)
    deviceless = _run_worker({"variant": "deviceless_cudnn", "deviceless": True, "tensor": n,
                              "shape": shape.as_dict()}, deviceless_env, log_dir,
                             settings.timeout_s)
    # this run's trace files (earlier runs' stay beside them)
    trace_files = sorted(str(p.relative_to(out)) for p in trace_dir.rglob("*")
                         if p.is_file() and p.stat().st_mtime >= started - 1
                         ) if trace_dir.exists() else []
    report = {
        "tool": "python -m scripts.gpu_check",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": quick, "platform": platform, "device_kind": kind, "tensor": n,
        "jax_version": _jax_version(), "xla_flags": env.get("XLA_FLAGS", ""),
        "shape": shape.as_dict(), "requested_shape": requested.as_dict(),
        "shape_notes": shape_notes, "settings": dataclasses.asdict(settings),
        "flops_formula": "6 * matmul_params * tokens + 12 * layers * hidden * seq * tokens "
                         "(PaLM appendix B; matmul_params = all parameters but the learned "
                         "position table)",
        "peak_flops_per_device": peak, "peak_flops_note": peak_note,
        "memory_method": "real: Device.memory_stats()['peak_bytes_in_use'] in a fresh "
                         "process per variant (max over its devices); predicted: "
                         "memory_analysis() of the compiled step, temp + argument + output "
                         "- alias, per device",
        "caveats": caveats(platform, n, fp8=any(v in FP8_VARIANTS for v in variants)),
        "fp8": {"variants": [v for v in variants if v in FP8_VARIANTS],
                "baseline": FP8_BASELINE,
                "xla_flags": fp8_flags,
                "xla_flags_note": ("added to the FP8 variants' XLA_FLAGS (values already set "
                                   "kept)" if platform == "gpu" else
                                   f"none: {platform} run (FP8_GPU_FLAGS are XLA:GPU flags)"),
                "mfu_note": "FP8 MFU uses the same model FLOPs and the dense bf16 peak"},
        "cudnn": _cudnn_summary(results, deviceless, platform, shape),
        "trace": {"variant": TRACE_VARIANT, "dir": str(trace_dir), "files": trace_files,
                  "steps": settings.trace_steps,
                  "error": results.get(TRACE_VARIANT, {}).get("trace_error")},
        "variants": results,
        "ok": all("error" not in r for r in (*results.values(), deviceless)),
        "total_s": time.perf_counter() - t_start,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    return report


def _compare_fp8(results: dict[str, dict[str, Any]]) -> None:
    """Adds each FP8 variant's tokens/s ratio to the bf16 :data:`FP8_BASELINE`'s."""
    base = results.get(FP8_BASELINE, {})
    for variant, r in results.items():
        if variant not in FP8_VARIANTS or "error" in r:
            continue
        if "tokens_per_s" in base:
            r["tokens_per_s_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
        else:
            r["tokens_per_s_vs_bf16"] = None
            r["tokens_per_s_vs_bf16_note"] = (
                f"{NOT_MEASURED}: {FP8_BASELINE} " +
                ("failed" if FP8_BASELINE in results else "not run (--variants)"))


def _cudnn_summary(results: dict[str, dict[str, Any]], deviceless: dict[str, Any],
                   platform: str, shape: ModelShape) -> dict[str, Any]:
    """cuDNN's attention against sp_jax's kernel (:data:`FP8_BASELINE`, the same step
    with ``attention_implementation="xla"``): tokens/s ratio, first-loss difference and
    the custom calls of the real step; the deviceless compile's count."""
    out: dict[str, Any] = {"variant": CUDNN_VARIANT, "baseline": FP8_BASELINE,
                           "expected_calls": 2 * shape.layers,
                           "expected_note": "a forward and a backward call a layer",
                           "deviceless": deviceless}
    r, base = results.get(CUDNN_VARIANT), results.get(FP8_BASELINE, {})
    if r is None:
        out["note"] = (f"{NOT_MEASURED}: cuDNN's attention runs on GPUs only ({platform} run)"
                       if platform != "gpu" else f"{NOT_MEASURED}: not run (--variants)")
    elif "error" in r:
        out["note"] = f"failed: {r['error'].splitlines()[0]}"
    else:
        out["cudnn_calls"] = r["cudnn_calls"]
        if "tokens_per_s" in base:
            out["tokens_per_s_vs_xla"] = r["tokens_per_s"] / base["tokens_per_s"]
            out["first_loss_difference"] = r["first_loss"] - base["first_loss"]
    return out


def _jax_version() -> str:
    import jax

    return jax.__version__


def _mib(x: int | None) -> str:
    if x is None:
        return NOT_MEASURED
    return f"{x / MIB:,.0f}" if x >= 100 * MIB else f"{x / MIB:.2f}"


def markdown(report: dict[str, Any]) -> str:
    """``gpu_check.md``: the table, the shape, the methods and the caveats."""
    s, n = report["shape"], report["tensor"]
    lines = [
        "# GPU check: the sp_jax GPT training step",
        "",
        f"{report['platform']} x {n} ({report['device_kind']}), jax {report['jax_version']}, "
        f"{report['created']}{', --quick' if report['quick'] else ''}. GPT: hidden "
        f"{s['hidden']}, {s['heads']} heads, {s['layers']} layers, seq {s['seq']}, vocab "
        f"{s['vocab']}, batch {s['batch']} ({s['batch'] * s['seq']} tokens/step); bf16 "
        "compute, fp32 parameters, AdamW, `ParallelConfig(wgrad_dtype=float32, "
        "recompute_allgather=True)`, mesh data=1 x tensor.",
        "",
    ]
    for note in report["shape_notes"]:
        lines.append(f"- shape changed for tensor={n}: {note}")
    if report["shape_notes"]:
        lines.append("")
    lines += ["| variant | tensor size | step ms | tokens/s | MFU | real peak MiB "
              "| predicted peak MiB | first loss |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in report["variants"].items():
        if "error" in r:
            lines.append(f"| {name} | | failed: {r['error'].splitlines()[0]} | | | | | |")
            continue
        mfu = (NOT_MEASURED if r["mfu"] is None else
               f"{100 * r['mfu']:.1f}%" if r["mfu"] >= 0.01 else f"{100 * r['mfu']:.3f}%")
        real = _mib(r["real_peak_bytes"])
        if r.get("peak_set_by_steps") is False:
            real += " (set before the steps)"
        lines.append(
            f"| {name} | {r['devices']} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{mfu} | {real} | {_mib(r['predicted_peak_bytes'])} | {r['first_loss']:.4f} |")
    fp8 = [(name, r) for name, r in report["variants"].items()
           if name in FP8_VARIANTS and "error" not in r]
    if fp8:
        lines += ["", f"FP8 (`GPTConfig(fp8=Fp8Recipe(...))`) against bf16 `{FP8_BASELINE}`:", "",
                  "| variant | scaling | tokens/s | vs bf16 sp_jax | MFU (of bf16 peak) "
                  "| cuBLASLt FP8 GEMMs |",
                  "|---|---|---:|---:|---:|---:|"]
        for name, r in fp8:
            ratio = r.get("tokens_per_s_vs_bf16")
            ratio = NOT_MEASURED if ratio is None else f"{ratio:.2f}x"
            mfu = (NOT_MEASURED if r["mfu"] is None else
                   f"{100 * r['mfu']:.1f}%" if r["mfu"] >= 0.01 else f"{100 * r['mfu']:.3f}%")
            lines.append(f"| {name} | {r['fp8_scaling']} | {r['tokens_per_s']:,.0f} | "
                         f"{ratio} | {mfu} | {r['fp8_gemms']} |")
    first = [r for r in report["variants"].values() if "error" not in r]
    lines += ["", "How it was measured:", "",
              f"- step time: median of {report['settings']['steps']} steps after "
              f"{report['settings']['warmup']} warm-up step(s), each up to "
              "`block_until_ready`; tokens/s = batch * seq / step time.",
              f"- MFU: {report['flops_formula']}, over step time * devices * peak "
              f"({report['peak_flops_note']}).",
              f"- memory: {report['memory_method']}.",
              ]
    if first and first[0]["real_peak_bytes"] is None:
        lines.append(f"- real peak: {first[0]['real_peak_note']}.")
    elif first:
        lines.append("- real peak: the largest `peak_bytes_in_use` over the variant's devices "
                     "in its own fresh process; \"(set before the steps)\" marks a peak reached "
                     "while building or compiling, which then bounds the step's peak from above.")
    lines.append("- first loss: loss of the first step at the shared initial weights "
                 "(equal across variants up to bf16 rounding).")
    if fp8:
        info = report["fp8"]
        flags = " ".join(f"`{f}`" for f in info["xla_flags"]) or info["xla_flags_note"]
        lines.append(
            "- FP8: the blocks' q/k/v, output, up and down projections in FP8 (e4m3 inputs "
            "and weights, e5m2 output gradients, per-tensor scales; embeddings, attention and "
            "the LM head in bf16); their first loss differs from bf16 by the FP8 rounding. "
            "MFU is quoted against the dense bf16 peak, with the same model FLOPs, so FP8 "
            "GEMMs faster than bf16 ones show as an MFU above the bf16 figure; \"vs bf16 "
            "sp_jax\" is tokens/s over those of "
            f"`{FP8_BASELINE}`. cuBLASLt FP8 GEMMs: `{FP8_GEMM_TARGET}` custom calls in the "
            f"compiled step's HLO (n/a off GPU). FP8 workers' extra XLA flags: {flags}.")
    cudnn = report["cudnn"]
    dl = cudnn["deviceless"]
    dl_text = (f"failed: {dl['error'].splitlines()[0]}" if "error" in dl else
               dl["note"] if dl["cudnn_calls"] is None else
               f"{dl['cudnn_calls']} `{CUDNN_TARGET}...` custom calls in the step compiled "
               f"deviceless for {dl['tensor']} H100(s)")
    if "cudnn_calls" in cudnn:
        ratio = cudnn.get("tokens_per_s_vs_xla")
        real = (f"{cudnn['cudnn_calls']} `{CUDNN_TARGET}...` custom calls in the compiled "
                f"step, tokens/s {NOT_MEASURED if ratio is None else f'{ratio:.2f}x'} those of "
                f"`{FP8_BASELINE}` (sp_jax's blockwise kernel), first loss "
                + (NOT_MEASURED if ratio is None else
                   f"{cudnn['first_loss_difference']:+.4f} from it"))
    else:
        real = cudnn["note"]
    lines.append(f"- cuDNN attention (`{CUDNN_VARIANT}`, bf16; expected "
                 f"{cudnn['expected_calls']} calls: {cudnn['expected_note']}): {real}; "
                 f"{dl_text}.")
    trace = report["trace"]
    lines.append(f"- trace: {trace['steps']} steps of `{trace['variant']}` in `{trace['dir']}` "
                 f"({len(trace['files'])} file(s)"
                 + (f"; failed: {trace['error']}" if trace.get("error") else "") + ").")
    if report["caveats"]:
        lines += ["", "What this run cannot measure:", ""]
        lines += [f"- {c}" for c in report["caveats"]]
    failed = [r for r in report["variants"].values() if "error" in r]
    if failed:
        lines += ["", "Failures:", ""]
        for r in failed:
            lines += [f"`{r['variant']}`:", "", "```", r["error"], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.gpu_check",
        description="Times the sp_jax GPT training step (sp_jax, collective matmul, GSPMD, "
                    "unsharded, FP8 current and delayed scaling) on 1-8 GPUs; writes "
                    "OUT/gpu_check.{json,md} and a trace.")
    p.add_argument("--out", type=Path, help="output directory (required)")
    p.add_argument("--quick", action="store_true", help="tiny GPT, few steps (smoke test)")
    p.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: GPUs if JAX finds any, else simulated CPU devices")
    p.add_argument("--devices", type=int, default=None,
                   help=f"tensor size N (default: every GPU up to {MAX_DEVICES}; "
                        f"{MAX_DEVICES} simulated CPU devices)")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of {','.join((*VARIANTS, *GPU_VARIANTS))} "
                        f"(default: all; {CUDNN_VARIANT} on GPUs only)")
    for name in ("hidden", "heads", "layers", "seq", "vocab", "batch"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"override the GPT's {name}")
    for name in ("warmup", "steps", "trace-steps"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"override {name}")
    p.add_argument("--timeout", type=float, default=None, help="seconds per variant")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None and args.out is None:
        p.error("--out DIR is required")
    return args


def main(argv: list[str] | None = None) -> int:
    """Command line entry; returns the exit status (1 when a variant failed)."""
    args = _parse(argv)
    if args.worker is not None:
        spec = json.loads(args.worker)
        result = deviceless_cudnn(spec) if spec.get("deviceless") else run_variant(spec)
        args.worker_result.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    base = QUICK_SHAPE if args.quick else FULL_SHAPE
    overrides = {k: getattr(args, k) for k in ("hidden", "heads", "layers", "seq", "vocab",
                                              "batch") if getattr(args, k) is not None}
    base_settings = QUICK_SETTINGS if args.quick else FULL_SETTINGS
    changes = {k: v for k, v in (("warmup", args.warmup), ("steps", args.steps),
                                 ("trace_steps", args.trace_steps),
                                 ("timeout_s", args.timeout)) if v is not None}
    try:
        shape = dataclasses.replace(base, **overrides)
        settings = dataclasses.replace(base_settings, **changes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    variants = None if args.variants is None else tuple(
        v.strip() for v in args.variants.split(",") if v.strip())
    try:
        report = run_check(args.out, quick=args.quick, platform=args.platform,
                           devices=args.devices, variants=variants, shape=shape,
                           settings=settings)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"gpu_check: wrote {args.out / 'gpu_check.md'} and gpu_check.json in "
          f"{report['total_s']:.0f} s")
    for note in report["caveats"]:
        print(f"gpu_check: {note}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
