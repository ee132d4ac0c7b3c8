"""Multi-head latent attention (``GPTConfig(attention="mla")``) on H100s, deviceless
compiles: what its ring moves over the context axis against a ring of per-head keys and
values, and its latent KV cache and decode step.

- :func:`ring_bytes`: one :class:`~sp_jax.layers.MultiHeadLatentAttention` layer of
  DeepSeek-V3's shape (``bench``), forward+backward on a ``1 x context x 1`` mesh with
  ``context_parallel="ring"`` (the latent ring): the collective-permute bytes per device by
  phase in the compiled H100 program, against :func:`latent_ring_analytic`.
- :func:`per_head_ring_bytes`: the same attention with the up-projected keys and values
  travelling the ring instead (:func:`~sp_jax.attention.expand_latent`, then
  :func:`~sp_jax.attention.ring_attention`), for ``heads`` heads per device (128: tensor
  1; 16: the model at tensor 8; the tensor axis takes no part in the ring's transfers, so
  a device's program at tensor 8 is the one with 16 heads).
- :func:`latent_cache_bytes`: bytes per token and layer of the prefill's
  :class:`~sp_jax.layers.LatentCache` (read from its arrays) against per-head k/v.
- :func:`decode_peak`: one decode step's compiled peak per GPU, absorbed
  (``mla_decode="absorbed"``) and up-projecting the cached latent into per-head k/v
  (``mla_decode="expanded"``).

Bytes per token are what these figures are about: the ring's transfers scale with the
sequence length (``s`` tokens, each ``(kv_lora_rank + qk_rope_head_dim) x 2`` bytes of
latent), so a reduced ``s`` gives the per-token figure of 131,072 tokens.
``python -m benchmarks.mla [--quick]`` prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from benchmarks.context import AXES, layer_grad_compile
from sp_jax import Layout
from sp_jax.analysis import compile_for_gpu, gpu_mesh, parse_collectives
from sp_jax.attention import expand_latent, latent_ring_attention, ring_attention
from sp_jax.layers import AttentionConfig, MultiHeadLatentAttention

__all__ = ["DecodeBench", "MlaBench", "decode_peak", "latent_cache_bytes", "latent_ring_analytic",
           "per_head_ring_bytes", "ring_bytes", "run_mla", "ring_targets"]


@dataclasses.dataclass(frozen=True)
class MlaBench:
    """DeepSeek-V3's attention shape (``hidden``, ``heads``, the MLA widths) at ``s``
    tokens, batch 1, on ``context`` H100s; attention blocks of ``block``; bf16 compute,
    fp32 parameters."""

    hidden: int = 7168
    heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    s: int = 131_072
    context: int = 8
    block: int = 512
    per_head_heads: tuple[int, ...] = (16, 128)  # heads per device: tensor 8, tensor 1

    def attention_config(self, **kw: Any) -> AttentionConfig:
        return AttentionConfig(
            self.hidden, self.heads, rotary=True, norm="rmsnorm", out_bias=False,
            attention="mla", q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim, attention_block_q=self.block,
            attention_block_k=self.block, dtype=jnp.bfloat16, **kw)

    @property
    def latent_width(self) -> int:
        """Values per token of the latent ring: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def per_head_width(self, heads: int) -> int:
        """Values per token of a per-head k/v ring: ``heads x (n + p + d_v)``."""
        return heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


QUICK = MlaBench(s=8192)


def latent_ring_analytic(bench: MlaBench, width: int | None = None,
                         itemsize: int = 2) -> dict[str, int]:
    """Bytes per device and layer a ring of ``width`` values per token (the latent's
    ``kv_lora_rank + qk_rope_head_dim`` when None) moves over the context axis: with
    ``L = s x width x itemsize`` (the whole sequence's), the forward sends ``L (c - 1) /
    c`` (each chunk to the ``c - 1`` other devices); the backward sends it again, plus
    fp32 accumulators of its gradient for the same ``c - 1`` steps and their return home
    (``L / c``; XLA casts it to the gradient's dtype before that last transfer)."""
    c = bench.context
    whole = bench.s * (bench.latent_width if width is None else width) * itemsize
    sent = whole * (c - 1) // c
    return {"forward": sent, "backward": sent + 2 * sent + whole // c}


def _permute_bytes(hlo: str) -> dict[str, Any]:
    """Collective-permute bytes per device by phase, and the count of ops."""
    out: dict[str, Any] = {"forward": 0, "backward": 0, "unknown": 0, "ops": 0}
    for col in parse_collectives(hlo):
        if col.kind == "collective-permute":
            out[col.phase] += col.bytes
            out["ops"] += 1
    return out


def _parallel() -> sp_jax.ParallelConfig:
    return sp_jax.ParallelConfig(data_axis=None, recompute_allgather=True,
                                 wgrad_dtype=jnp.float32, context_parallel="ring")


def ring_bytes(bench: MlaBench) -> dict[str, Any]:
    """The latent ring: one MLA layer's forward+backward (input and parameter gradients)
    on a ``1 x context x 1`` H100 mesh; context-axis bytes per device by phase against
    :func:`latent_ring_analytic`."""
    parallel = _parallel()
    t0 = time.perf_counter()
    report = layer_grad_compile(lambda: MultiHeadLatentAttention(
        bench.attention_config(), parallel=parallel, rngs=nnx.Rngs(0)), parallel,
        (1, bench.context, 1), bench.s, bench.hidden)
    return {"s": bench.s, "context": bench.context, "compile_s": time.perf_counter() - t0,
            "measured": _permute_bytes(report.hlo), "analytic": latent_ring_analytic(bench),
            "bytes_per_token": bench.latent_width * 2}


def per_head_ring_bytes(bench: MlaBench, heads: int, *, latent: bool = False
                        ) -> dict[str, Any]:
    """The ring of up-projected keys and values: per device, ``heads`` heads' queries
    and this device's latent chunk, expanded (:func:`~sp_jax.attention.expand_latent`)
    into keys ``[.., heads, n + p]`` and values ``[.., heads, d_v]`` before
    :func:`~sp_jax.attention.ring_attention` (what travels); forward+backward compiled on
    a ``1 x context x 1`` H100 mesh; context-axis bytes per device by phase. ``latent``:
    :func:`~sp_jax.attention.latent_ring_attention` of the same arguments instead."""
    c, s = bench.context, bench.s
    n, p, r = bench.qk_nope_head_dim, bench.qk_rope_head_dim, bench.kv_lora_rank
    dv = bench.v_head_dim
    mesh = gpu_mesh((1, c, 1), AXES)
    spec = P(None, "context")
    kw = dict(axis_name="context", block_q=bench.block, block_k=bench.block)

    def attend(q, lat, k_rope, kv_b):
        if latent:
            return latent_ring_attention(q, lat, k_rope, kv_b, **kw)
        k, v = expand_latent(lat, k_rope, kv_b, n, heads)
        return ring_attention(q, k, v, **kw)

    ring = jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec, P()),
                         out_specs=spec)

    def grad(q, lat, k_rope, kv_b):
        return jax.grad(lambda *a: jnp.mean(ring(*a).astype(jnp.float32) ** 2),
                        argnums=(0, 1, 2, 3))(q, lat, k_rope, kv_b)

    bf16 = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((1, s, heads, n + p), bf16, sharding=spec),
            jax.ShapeDtypeStruct((1, s, r), bf16, sharding=spec),
            jax.ShapeDtypeStruct((1, s, p), bf16, sharding=spec),
            jax.ShapeDtypeStruct((r, heads * (n + dv)), bf16, sharding=P()))
    t0 = time.perf_counter()
    report = compile_for_gpu(grad, *args, mesh_shape=(1, c, 1), axis_names=AXES)
    width = bench.latent_width if latent else bench.per_head_width(heads)
    return {"heads": heads, "s": s, "context": c, "compile_s": time.perf_counter() - t0,
            "measured": _permute_bytes(report.hlo),
            "analytic": latent_ring_analytic(bench, width), "bytes_per_token": width * 2}


def ring_targets(latent: dict[str, Any], per_head: list[dict[str, Any]]) -> list[dict]:
    """The issue's targets: the latent ring's bytes equal the analytic volume, forward and
    backward; at most 1/8 of a per-head k/v ring's at tensor 8 (16 heads a device)."""
    m, a = latent["measured"], latent["analytic"]
    out = [{"target": f"latent ring {phase} bytes = analytic", "met": m[phase] == a[phase],
            "measured": f"{m[phase]:,} B vs {a[phase]:,} B"} for phase in ("forward",
                                                                              "backward")]
    for row in per_head:
        ours = m["forward"] + m["backward"]
        theirs = row["measured"]["forward"] + row["measured"]["backward"]
        out.append({"target": f"latent ring <= 1/8 of per-head ring ({row['heads']} heads "
                              "a device)",
                    "met": ours * 8 <= theirs, "ratio": ours / theirs,
                    "measured": f"{ours:,} B vs {theirs:,} B: 1/{theirs / ours:.2f}"})
    return out


def latent_cache_bytes(bench: MlaBench, *, length: int = 64) -> dict[str, Any]:
    """Bytes per token and layer of the latent cache of a one-layer DeepSeek-V3-shaped GPT
    (bf16 parameters, so a bf16 cache; abstract: ``jax.eval_shape`` of the prefill on a
    one-device mesh), read from the :class:`~sp_jax.layers.LatentCache` arrays, against
    per-head k/v (``heads x (n + p + d_v) x 2``)."""
    from sp_jax.models import GPT
    from sp_jax.models.decode import prefill

    cfg = _gpt_config(bench, layers=1, seq=length)
    mesh = jax.make_mesh((1, 1), ("data", "tensor"), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
        model.eval()
        graphdef, state = nnx.split(model)
        tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        last = jax.ShapeDtypeStruct((1,), jnp.int32)
        cache = jax.eval_shape(
            lambda st, t, n: prefill(nnx.merge(graphdef, st), t, n, length)[1],
            state, tokens, last)
    arrays = {"latent": cache.latent, "k_rope": cache.k_rope}
    per_token = sum(a.dtype.itemsize * a.shape[-1] for a in arrays.values())
    return {"bytes_per_token_layer": per_token, "analytic": bench.latent_width * 2,
            "per_head_kv": bench.per_head_width(bench.heads) * 2,
            "arrays": {k: [list(a.shape), str(a.dtype)] for k, a in arrays.items()}}


def _gpt_config(bench: MlaBench, *, layers: int, seq: int, **kw: Any) -> Any:
    """A DeepSeek-V3-shaped GPT of ``layers`` MLA layers with a dense SwiGLU MLP of
    DeepSeek-V3's dense width (18432), a 1024-entry vocabulary, bf16 throughout."""
    from sp_jax.models import GPTConfig

    return GPTConfig(
        vocab_size=1024, max_seq_len=seq, num_layers=layers, num_heads=bench.heads,
        hidden=bench.hidden, mlp_hidden=18432, positions="rotary", norm="rmsnorm",
        mlp_activation="swiglu", qkv_bias=False, out_bias=False, mlp_bias=False,
        tie_embeddings=False, attention="mla", q_lora_rank=bench.q_lora_rank,
        kv_lora_rank=bench.kv_lora_rank, qk_nope_head_dim=bench.qk_nope_head_dim,
        qk_rope_head_dim=bench.qk_rope_head_dim, v_head_dim=bench.v_head_dim,
        dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, scan_layers=layers > 1, **kw)


@dataclasses.dataclass(frozen=True)
class DecodeBench:
    """One decode step on ``1 x tensor`` H100s: ``layers`` DeepSeek-V3-shaped MLA layers
    (dense MLPs, :func:`_gpt_config`), ``batch`` rows, a ``cache``-token latent cache."""

    layers: int = 4
    tensor: int = 8
    batch: int = 8
    cache: int = 32_768


def decode_peak(bench: MlaBench, decode: DecodeBench, *, absorb: bool) -> dict[str, Any]:
    """Deviceless compile of one :func:`~sp_jax.models.decode.decode_step` (eval mode, the
    latent cache ``[layers, batch, cache, r]`` / ``[.., p]`` donated, whole over the
    tensor axis) with ``mla_absorb=absorb``: per-GPU ``memory_analysis()``."""
    from sp_jax.layers import LatentCache
    from sp_jax.models import GPT
    from sp_jax.models.decode import decode_step

    cfg = _gpt_config(bench, layers=decode.layers, seq=decode.cache, mla_absorb=absorb)
    par, axes, t = sp_jax.ParallelConfig(), ("data", "tensor"), decode.tensor
    layout = Layout.of(par)
    mesh = gpu_mesh((1, t), axes)
    with jax.set_mesh(mesh):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=par, rngs=nnx.Rngs(0)))
        gpt.eval()
        graph, state = nnx.split(gpt)
        specs = LatentCache.entry_specs(layout)
        cache = LatentCache(*(jax.ShapeDtypeStruct(
            (decode.layers, decode.batch, decode.cache, width), jnp.bfloat16,
            sharding=NamedSharding(mesh, P(None, *specs[name])))
            for name, width in (("latent", bench.kv_lora_rank),
                                ("k_rope", bench.qk_rope_head_dim))))
        ids = jax.ShapeDtypeStruct((decode.batch,), jnp.int32, sharding=NamedSharding(
            mesh, layout.spec("activation_batch")))

    def step(state, cache, tokens, positions):
        return decode_step(nnx.merge(graph, state), cache, tokens, positions)

    t0 = time.perf_counter()
    report = compile_for_gpu(step, state, cache, ids, ids, mesh_shape=(1, t), axis_names=axes,
                             donate_argnums=(1,))
    return {"absorb": absorb, **dataclasses.asdict(decode),
            "compile_s": time.perf_counter() - t0,
            **{k: getattr(report, k) for k in ("argument_bytes", "output_bytes", "temp_bytes",
                                                "alias_bytes", "peak_bytes")},
            "cache_bytes": 2 * decode.layers * decode.batch * decode.cache
            * bench.latent_width}


def run_mla(bench: MlaBench, decode: DecodeBench = DecodeBench(), log=print) -> dict[str, Any]:
    """Every figure of this module for ``bench``."""
    out: dict[str, Any] = {"bench": bench.as_dict()}
    out["latent_ring"] = ring_bytes(bench)
    log(f"  latent ring: {out['latent_ring']['measured']}")
    out["per_head_ring"] = []
    for heads in bench.per_head_heads:
        out["per_head_ring"].append(per_head_ring_bytes(bench, heads))
        log(f"  per-head ring, {heads} heads: {out['per_head_ring'][-1]['measured']}")
    out["targets"] = ring_targets(out["latent_ring"], out["per_head_ring"])
    out["cache"] = latent_cache_bytes(bench)
    out["decode"] = [decode_peak(bench, decode, absorb=a) for a in (True, False)]
    for row in out["decode"]:
        log(f"  decode, absorb={row['absorb']}: peak {row['peak_bytes'] / 2**30:.2f} GiB, "
            f"temp {row['temp_bytes'] / 2**30:.2f} GiB")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"s={QUICK.s}")
    args = parser.parse_args(argv)
    res = run_mla(QUICK, DecodeBench(layers=2, cache=4096)) if args.quick else run_mla(
        MlaBench())
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()

