"""Shared helpers for the tests (independent unsharded references, script subprocesses)."""

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import COMPILE_SPEED_FLAGS
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax import Layout
from sp_jax.models import GPT, Block, GPTConfig
from sp_jax.training import TrainStep

# One persistent compilation cache for the scripts the tests start: the end-to-end runs of
# examples/ compile the same few programs again and again, in every pytest worker. The
# session's directory comes from conftest.py (made before xdist starts its workers, removed
# when the session ends); a process without it makes its own.
_COMPILE_CACHE = os.environ.get("SP_JAX_TEST_JIT_CACHE", "")
if not _COMPILE_CACHE:
    _COMPILE_CACHE = tempfile.mkdtemp(prefix="sp_jax_test_jit_cache_")
    atexit.register(shutil.rmtree, _COMPILE_CACHE, ignore_errors=True)


def script_env() -> dict[str, str]:
    """The environment of an example or script run as a subprocess: CPU, XLA_FLAGS
    holding only the suite's compile-speed flags (no LLVM optimisation of the tiny CPU
    programs and XLA:CPU's legacy fusion emitters, as in conftest.py), and a persistent
    compilation cache shared by the scripts this test process starts; no device count,
    so the script must simulate its own devices as on a user's machine."""
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=" ".join(COMPILE_SPEED_FLAGS),
                JAX_COMPILATION_CACHE_DIR=_COMPILE_CACHE,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


ROOT = Path(__file__).resolve().parents[1]
TRAIN_GPT = ROOT / "examples" / "train_gpt.py"


def free_port() -> int:
    """A free TCP port on loopback (for a jax.distributed coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env() -> dict[str, str]:
    """:func:`script_env` for a jax.distributed process: no proxy for loopback gRPC."""
    return {k: v for k, v in script_env().items() if not k.lower().endswith("_proxy")}


def launch(argv: list[str], log: Path, script: Path = TRAIN_GPT) -> subprocess.Popen:
    """Starts ``script argv`` with stdout and stderr going to ``log``."""
    with log.open("w") as out:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, str(script), *argv], cwd=ROOT,
                                env=process_env(), stdout=out, stderr=subprocess.STDOUT)


def two_processes(tmp: Path, tag: str, argv: list[str],
                  per_process: tuple[list[str], list[str]] = ([], [])
                  ) -> dict[str, subprocess.Popen]:
    """``tag0`` and ``tag1``: ``script argv`` as 2 jax.distributed processes on loopback,
    each logging JSON to ``tmp/<tag><i>.jsonl`` and its output to ``tmp/<tag><i>.out``;
    ``per_process`` adds flags to one of them."""
    port = free_port()
    return {f"{tag}{i}": launch([*argv, "--coordinator", f"127.0.0.1:{port}",
                                 "--num-processes", "2", "--process-id", str(i),
                                 "--log-json", str(tmp / f"{tag}{i}.jsonl"),
                                 *per_process[i]], tmp / f"{tag}{i}.out")
            for i in range(2)}


def wait_all(procs: dict[str, subprocess.Popen], deadline: float) -> dict[str, int | None]:
    """Waits for all of ``procs``; kills any still running at ``deadline`` (monotonic
    clock), e.g. one whose peer died; returns their exit statuses."""
    try:
        for proc in procs.values():
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return {name: proc.returncode for name, proc in procs.items()}


def wait_until(ready, procs: dict[str, subprocess.Popen], deadline: float) -> bool:
    """Polls ``ready()`` every 0.1 s until it is true; False if one of ``procs`` ended or
    ``deadline`` (monotonic clock) passed first."""
    while time.monotonic() < deadline and all(p.poll() is None for p in procs.values()):
        if ready():
            return True
        time.sleep(0.1)
    return False


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines log (none when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_an_array_file(step_dir: Path) -> str:
    """Cuts the largest array data file of a checkpoint step in half; returns its path."""
    files = [p for p in (step_dir / "params").rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    return str(biggest)


def without_jax_plugins(monkeypatch) -> None:
    """As in a plain install: no ``jax_plugins`` package at all (importlib cannot find
    ``jax_plugins.*``; looking up a submodule raises for the missing parent)."""
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *a):
        if name.startswith("jax_plugins"):
            raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")
        return real_find_spec(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


compiled_logits = nnx.jit(lambda model, tokens: model(tokens))
"""A model's logits, compiled: an eager forward runs op by op, each op a dispatch (and at
first a compile) on every device (measured: minutes on 8 simulated devices against
seconds jitted)."""

compiled_loss = nnx.jit(lambda model, tokens: model.loss(tokens, return_metrics=True))
"""A model's ``loss(tokens, return_metrics=True)``, compiled (as :data:`compiled_logits`)."""


def to_host(tree):
    """Pulls every array of ``tree`` to host numpy (drops all sharding)."""
    return jax.tree.map(np.asarray, tree)


def param_values(module) -> dict:
    """The parameter values of ``module`` as a nested dict of host arrays."""
    return to_host(nnx.to_pure_dict(nnx.state(module, nnx.Param)))


def copy_weights(dst, src):
    """Copies ``src``'s parameter values (a module, or a dict from :func:`param_values`)
    into ``dst``, keeping ``dst``'s own variable metadata (so an unsharded copy carries
    no sharding annotations)."""
    values = src if isinstance(src, dict) else param_values(src)
    state = nnx.state(dst, nnx.Param)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(dst, state)
    return dst


def reference_linear(layer) -> nnx.Linear:
    """An unsharded ``nnx.Linear`` holding ``layer``'s weights (copied to host)."""
    ref = nnx.Linear(
        layer.in_features, layer.out_features, use_bias=layer.use_bias, rngs=nnx.Rngs(0)
    )
    return copy_weights(ref, layer)


def probe(shape, seed=7):
    """A fixed random tensor used to weight outputs in losses (so gradients differ)."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def grads_dict(grads) -> dict:
    return to_host(nnx.to_pure_dict(nnx.state(grads)))


def by_path(tree) -> dict[str, np.ndarray]:
    """Host arrays of ``tree`` by key path (not treedef: nnx Variables carry creation-time
    metadata such as their sharding in the treedef, which is not part of the values)."""
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_bitwise(a, b) -> None:
    """``a`` and ``b`` hold the same paths with bitwise-equal values, dtypes and shapes."""
    a, b = by_path(a), by_path(b)
    assert sorted(a) == sorted(b)
    for path, x in a.items():
        assert x.dtype == b[path].dtype and x.shape == b[path].shape, path
        np.testing.assert_array_equal(x, b[path], err_msg=path)


def dense_attention(q, k, v, *, scale=None, softcap=None, window=None, segments=None,
                    z=None):
    """Dense causal attention in fp32 with the whole ``s x s`` score matrix, as
    transformers' Gemma 2 (eager): ``(q . k) * scale``, ``c * tanh(s / c)``, the mask
    (causal, window, documents), softmax; grouped-query k, v repeated first; ``q [b, s,
    h, d]``, ``k [b, s, hk, d]``, ``v [b, s, hk, d_v]`` -> ``[b, s, h, d_v]``. ``z [b,
    h, s, s]``: factors on the probabilities (a dropout mask), or None."""
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    s = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (
        q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    mask = (j <= i) if window is None else (j <= i) & (i - j < window)
    mask = jnp.asarray(mask)[None, None]
    if segments is not None:
        seg = jnp.asarray(segments)
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    if z is not None:
        probs = probs * z
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def token_batches(vocab: int, steps: int, rows: int, seq: int, seed: int = 0) -> list[dict]:
    """``steps`` batches of uniform token ids, one micro-batch each: ``tokens`` and
    ``labels`` (the next tokens) ``[1, rows, seq]``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, vocab, size=(rows, seq + 1)).astype(np.int32)
        out.append({"tokens": tokens[None, :, :-1], "labels": tokens[None, :, 1:]})
    return out


def slow_except(values, *fast) -> list:
    """Parameters for ``pytest.mark.parametrize``: ``values`` (a tuple: one value per
    argument name), each marked ``slow`` but those in ``fast`` (the fast tier's cases,
    ``make test-fast``). Each of ``fast`` must be one of ``values``: a renamed or removed
    case fails at collection instead of silently leaving the fast tier."""
    values = list(values)
    missing = [v for v in fast if v not in values]
    if missing:
        raise ValueError(f"fast cases {missing} are not among the parameters {values}")
    return [v if v in fast
            else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for v in values]


def check_fp8_drift(losses, ref, what: str) -> np.ndarray:
    """An FP8 run's losses against its reference's: the first step's within 4e-4
    relative (later steps printed, not bounded: FP8 turns other reduction orders' fp32
    rounding into whole-quantum flips), every loss finite and the last below the first;
    returns the relative drift per step."""
    drift = np.abs(losses - ref) / ref
    print(f"FP8 {what}: loss drift per step vs the reference {drift}")
    assert drift[0] <= 4e-4, drift
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    return drift


def train_gpt(cfg, parallel, mesh, batches, *, init=None, train_mode=False, tx=None):
    """Trains a GPT on ``batches`` (AdamW(3e-3, eps=1e-5) unless ``tx``), each batch placed
    ``P(None, batch, length)``; returns (initial params, per-step losses, final params,
    the :class:`TrainStep`). ``init``: parameter values to start from.

    AdamW's ``eps`` is 1e-5: Adam divides each update by ``sqrt(v) + eps``, so for an
    entry whose gradient is nearly zero it turns the fp32 summation-order noise of any
    two correct implementations (here: sharded vs unsharded reductions, ~1e-9) into
    updates of order ``lr``. With the default 1e-8, one entry in a few thousand then
    differs by ~1e-4 after 5 steps (~1e-5 with eps=1e-6); 1e-5 bounds the amplification
    to ``lr / eps``.
    """
    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))
        if init is not None:
            copy_weights(model, init)
        init = param_values(model)
        if train_mode:
            model.train()
        step = TrainStep(model, tx or optax.adamw(3e-3, eps=1e-5))
        place = NamedSharding(mesh, Layout.of(parallel).micro_batched_tokens)
        losses = [float(step({k: jax.device_put(v, place) for k, v in b.items()},
                             jax.random.key(i))["loss"]) for i, b in enumerate(batches)]
        return init, np.array(losses), to_host(nnx.to_pure_dict(step.params)), step


def restore_onto(directory, cfg, parallel, mesh):
    """The checkpoint in ``directory`` restored onto a fresh GPT ``cfg`` under ``parallel``
    on ``mesh`` (AdamW state), each array laid out as that model wants (asserted)."""
    from sp_jax.checkpoint import abstract_like, restore_checkpoint

    with jax.set_mesh(mesh):
        other = TrainStep(GPT(cfg, parallel=parallel, rngs=nnx.Rngs(5)),
                          optax.adamw(3e-3, eps=1e-5))
    restored = restore_checkpoint(directory, params_like=abstract_like(other.params),
                                  opt_state_like=abstract_like(other.opt_state))
    for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(other.params),
                         strict=True):
        assert got.sharding == want.sharding  # the target's layout, sharded or not
    return restored


def assert_restores(directory, cfg, step, params, tokens, targets) -> None:
    """The checkpoint in ``directory``, saved from the :class:`TrainStep` ``step`` (its
    parameters ``params``, host arrays), restored onto a GPT ``cfg`` under each
    ``(parallel, mesh)`` of ``targets`` (:func:`restore_onto`): every parameter and
    optimizer moment equal, and the restored model's ``GPT.loss`` of ``tokens`` the
    trained one's (1e-6)."""
    with jax.set_mesh(step.mesh):
        want = float(nnx.jit(lambda m, t: m.loss(t))(step.sync_model(), tokens))
    for parallel, mesh in targets:
        restored = restore_onto(directory, cfg, parallel, mesh)
        assert_bitwise(to_host(nnx.to_pure_dict(restored.params)), params)
        for got, moment in zip(jax.tree.leaves(restored.opt_state),
                               jax.tree.leaves(step.opt_state), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(moment))
        with jax.set_mesh(mesh):
            model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(9))
            nnx.update(model, restored.params)
            got = float(nnx.jit(lambda m, t: m.loss(t))(model, tokens))
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=str(mesh.shape))


def h100_block_stack(layers: int, *, h: int = 256, s: int = 512, heads: int = 8, t: int = 8,
                     recompute: bool = True, collective_matmul: bool = False,
                     live_buffers: bool = False, compiler_options: dict | None = None,
                     **config):
    """Deviceless 8 x H100 compile (tensor ``t``, bf16 compute) of the gradients of a
    sum-of-squares loss through ``layers`` :class:`~sp_jax.models.Block` s, w.r.t. the
    parameters and the ``[1, s, h]`` input; ``config`` adds GPTConfig fields. Returns the
    :class:`~sp_jax.analysis.GpuCompileReport`."""
    from sp_jax.analysis import compile_for_gpu, gpu_mesh

    cfg = GPTConfig(vocab_size=256, max_seq_len=s, num_layers=1, num_heads=heads, hidden=h,
                    dtype=jnp.bfloat16, **config)
    parallel = sp_jax.ParallelConfig(recompute_allgather=recompute, data_axis=None,
                                     wgrad_dtype=jnp.float32,
                                     collective_matmul=collective_matmul)
    with jax.set_mesh(gpu_mesh((t,), ("tensor",))):
        blocks = nnx.eval_shape(lambda: nnx.List(
            [Block(cfg, parallel, rngs=nnx.Rngs(i)) for i in range(layers)]))
        graphdef, params = nnx.split(blocks)
    x = jax.ShapeDtypeStruct((1, s, h), jnp.bfloat16, sharding=P(None, "tensor", None))

    def grad(params, x):
        def loss(p, x):
            for block in nnx.merge(graphdef, p):
                x = block(x)
            return jnp.sum(x.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    return compile_for_gpu(grad, params, x, mesh_shape=(t,), axis_names=("tensor",),
                           live_buffers=live_buffers, compiler_options=compiler_options)


# The FSDP check's GPT (tests/test_fsdp.py; the quick shape of benchmarks/fsdp.py):
# sp_jax.analysis.checks.fsdp_step_report(FSDP_QUICK, data, tensor, scan, fsdp)
from sp_jax.analysis.checks import StepShape  # noqa: E402

FSDP_QUICK = StepShape(layers=2, h=512, heads=8, s=256, vocab=1024)


def decoded_logits(model, full: np.ndarray, lengths: np.ndarray, steps: int,
                   prompt: int = 8, cache: int = 16) -> np.ndarray:
    """An eval-mode GPT under the current mesh: the next-token logits ``[b, steps + 1,
    V]`` from its KV cache, after the prefill of each row's first ``lengths[b]`` tokens
    of ``full`` (right-padded to ``prompt``, a cache of ``cache`` positions) and after
    each of ``steps`` decode steps of the row's next tokens (entry ``n``: the logits
    that pick token ``lengths[b] + n``)."""
    from sp_jax.models.decode import decode_step, prefill

    rows = np.arange(full.shape[0])
    prompts = jnp.asarray(np.where(np.arange(prompt) < lengths[:, None], full[:, :prompt], 0))
    logits, kv = nnx.jit(prefill, static_argnums=(3,))(model, prompts,
                                                       jnp.asarray(lengths - 1), cache)
    out = [np.asarray(logits)]
    step = nnx.jit(decode_step, donate_argnums=(1,))
    for n in range(steps):
        logits, kv = step(model, kv, jnp.asarray(full[rows, lengths + n]),
                          jnp.asarray(lengths + n))
        out.append(np.asarray(logits))
    return np.stack(out, axis=1)


def cache_and_forward_logits(model, full: np.ndarray, lengths: np.ndarray, steps: int,
                             prompt: int = 8, cache: int = 16):
    """An eval-mode GPT under the current mesh: the next-token logits ``[b, V]`` from its
    KV cache after the prefill of each row's first ``lengths[b]`` tokens of ``full``
    (right-padded to ``prompt``, a cache of ``cache`` positions) and ``steps`` decode
    steps of the row's next tokens (:func:`decoded_logits`' last), and the logits
    ``[b, s, V]`` of a forward over ``full``."""
    logits = decoded_logits(model, full, lengths, steps, prompt, cache)[:, -1]
    forward = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(full))
    return logits, np.asarray(forward)


def perturb_adapters(model, seed: int = 1, scale: float = 0.1) -> None:
    """Every LoRA ``lora_b`` of ``model`` drawn at random (``scale`` times a normal), zero
    outside each adapter's part of a fused kernel (as training keeps it): the adapted
    model then differs from its base."""
    from sp_jax.layers.lora import LoRAParam, masked_b

    for i, (_, layer) in enumerate(nnx.iter_graph(model)):
        if not isinstance(getattr(layer, "lora_a", None), LoRAParam):
            continue
        for j, name in enumerate(("lora_b", "q_lora_b", "kv_lora_b")):
            var = getattr(layer, name, None)
            if isinstance(var, LoRAParam):
                var[...] = scale * jax.random.normal(jax.random.key(seed + 3 * i + j),
                                                     var[...].shape, var[...].dtype)
        if hasattr(layer, "lora_b_masked"):
            layer.q_lora_b[...], layer.kv_lora_b[...] = layer.lora_b_masked()
        else:
            layer.lora_b[...] = masked_b(layer.lora_b[...], layer.lora_parts, layer.lora)
