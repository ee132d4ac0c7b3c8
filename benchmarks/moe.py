"""Mixture of experts: a Mixtral-8x7B-shaped stack on 8 x H100 (deviceless compiles) and the
dropless layer's CPU step time against a dense MLP of the same active FLOPs.

    python -m benchmarks.moe [--quick] [--json PATH] [--markdown PATH]

GPU: 2 layers of h=4096, 32 heads over 8 key/value heads, E=8 experts of
F=14336, k=2, s=4096, global batch 8, bf16 compute, fp32 parameters and weight gradients,
``recompute_allgather``; the forward+backward of the stack (gradients of a sum of squares
w.r.t. the parameters and the input) on ``expert 8`` and ``data 2 x expert 2 x tensor
2``: per-GPU peak (temp + arguments + outputs - aliased), the ragged all-to-alls per
layer and their payload against the analytic ``2 k T h bytes (ep - 1) / ep`` (forward:
dispatch and return; ``T`` the tokens of a device's tensor group), the static receive
buffer (``ep T min(k, E / ep)`` rows) and the largest buffers of the program.

Aux-loss-free balancing (1 CPU device): the max/mean expert load of a one-layer
DeepSeek-routed model after 50 steps on skewed tokens, the selection bias updated and not.

CPU (1 device, fp32): the dropless layer (E=8, k=2, F) forward+backward vs a
dense MLP of width ``k F`` (the same active FLOPs) on the same tokens, and the dropless
layer with its grouped GEMMs replaced by one dense GEMM of the sorted rows (same FLOPs
as a true grouped GEMM, wrong values): the difference is the masked lowering's part
(XLA:CPU computes a ``ragged_dot`` as a dense dot over every group with the other
groups' rows masked: ``E`` times the FLOPs).
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import sp_jax
from benchmarks.records import MIXTRAL, fmt_mib
from sp_jax.analysis import compile_for_gpu, gpu_mesh, parse_collectives
from sp_jax.models import Block, GPTConfig

__all__ = ["BALANCE", "FULL", "MESHES", "MIXTRAL", "QUICK", "MoEBench", "compile_moe_stack",
           "cpu_step_times", "load_balance", "mixtral_config", "run_moe"]

AXES = ("data", "expert", "context", "tensor")
MESHES = {"expert 8": (1, 8, 1, 1), "data 2 x expert 2 x tensor 2": (2, 2, 1, 2)}
"""(data, expert, context, tensor) meshes of the targets."""


def mixtral_config(*, h: int, F: int, E: int, k: int, s: int, heads: int, kv_heads: int,
                   **_: Any) -> GPTConfig:
    """One Mixtral-shaped layer (bf16 compute) of these shapes."""
    return GPTConfig(vocab_size=256, max_seq_len=s, num_layers=1, num_heads=heads,
                     num_kv_heads=kv_heads, hidden=h, mlp_hidden=F, dtype=jnp.bfloat16,
                     positions="rotary", norm="rmsnorm", mlp_activation="swiglu",
                     qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False,
                     num_experts=E, experts_per_token=k, moe_mlp_hidden=F)


def _send_operand_bytes(hlo: str, name: str) -> int:
    """Bytes of the first operand (what is sent) of the ragged all-to-all ``name``."""
    m = re.search(r"%" + re.escape(name) + r" = \(\((\w+)\[([\d,]+)\]", hlo)
    if m is None:
        return 0
    return math.prod(int(d) for d in m.group(2).split(",")) * (
        2 if m.group(1) in ("bf16", "f16") else 4)


def compile_moe_stack(mesh_shape: tuple[int, ...], *, recompute: bool = True,
                      **shapes: Any) -> dict[str, Any]:
    """Deviceless 8 x H100 compile of ``MIXTRAL`` (``shapes`` override it) on the
    ``(data, expert, context, tensor)`` mesh ``mesh_shape``."""
    m = {**MIXTRAL, **shapes}
    cfg = mixtral_config(**m)
    par = sp_jax.ParallelConfig(expert_axis="expert", recompute_allgather=recompute,
                                wgrad_dtype=jnp.float32)
    with jax.set_mesh(gpu_mesh(mesh_shape, AXES)):
        blocks = nnx.eval_shape(lambda: nnx.List(
            [Block(cfg, par, rngs=nnx.Rngs(i)) for i in range(m["layers"])]))
        graphdef, params = nnx.split(blocks)
    x = jax.ShapeDtypeStruct((m["batch"], m["s"], m["h"]), jnp.bfloat16,
                             sharding=P(("data", "expert"), "tensor", None))

    def grad(params, x):
        def loss(p, x):
            for block in nnx.merge(graphdef, p):
                x = block(x)
            return jnp.sum(x.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    started = time.perf_counter()
    report = compile_for_gpu(grad, params, x, mesh_shape=mesh_shape, axis_names=AXES,
                             live_buffers=True)
    seconds = time.perf_counter() - started
    data, ep, context, t = mesh_shape
    tokens = m["batch"] * m["s"] // (data * ep * context)  # a tensor group's tokens
    ragged = [c for c in parse_collectives(report.hlo) if c.kind == "ragged-all-to-all"]
    # the dispatches' send operand: [k T, h], every routed row once (the return sends the
    # same rows back); (ep - 1) / ep of them leave the device under balanced routing
    sends = [_send_operand_bytes(report.hlo, c.name) for c in ragged]
    dispatch = [b for b in sends if b == tokens * m["k"] * m["h"] * 2]
    off_device = (dispatch[0] if dispatch else 0) * (ep - 1) / ep
    live = report.peak_live
    at_peak = sorted(live.live_at(live.peak_position), key=lambda b: -b.bytes)[:4] \
        if live is not None else []
    return {
        "mesh": mesh_shape, "compile_s": seconds, "peak_bytes": report.peak_bytes,
        "temp_bytes": report.temp_bytes, "argument_bytes": report.argument_bytes,
        "output_bytes": report.output_bytes, "alias_bytes": report.alias_bytes,
        "ragged_all_to_alls": len(ragged),
        "ragged_per_layer": len(ragged) / m["layers"],
        "dispatch_sends": len(dispatch),
        "send_rows": tokens * m["k"],
        "receive_rows": ep * tokens * min(m["k"], m["E"] // ep),
        "receive_buffer_bytes": max((c.bytes for c in ragged), default=0),
        "a2a_forward_bytes_per_layer": 2 * off_device,
        "a2a_analytic_forward_bytes": 2 * m["k"] * tokens * m["h"] * 2 * (ep - 1) / ep,
        "dense_dispatch_bytes": tokens * m["E"] * m["h"] * 2,
        "largest_at_peak": [(b.bytes, b.shape, b.op_name) for b in at_peak],
        "tokens": tokens,
        "other_collectives": {k: v for k, v in report.collectives.ops.items()
                              if v and k != "ragged-all-to-all"},
    }


@dataclasses.dataclass(frozen=True)
class LayerBench:
    """The CPU comparisons' programs: the dropless layer (``E`` experts, top ``k``,
    width ``F``) and a dense MLP of width ``k F`` (the same active FLOPs) on ``ep`` CPU
    devices (an expert axis of ``ep``), their input (``tokens`` per device, fp32) and
    :meth:`program` (the jitted forward+backward of a module)."""

    mesh: Any
    cfg: GPTConfig
    parallel: Any
    moe: Any
    dense: Any
    x: Any

    @classmethod
    def make(cls, *, tokens: int, h: int, F: int, E: int, k: int, ep: int) -> LayerBench:
        mesh = jax.make_mesh((1, ep, 1, 1), AXES,
                             axis_types=(jax.sharding.AxisType.Explicit,) * 4,
                             devices=jax.devices()[:ep])
        cfg = GPTConfig(vocab_size=256, max_seq_len=tokens, num_layers=1, num_heads=4,
                        hidden=h, mlp_hidden=k * F, norm="rmsnorm", mlp_activation="swiglu",
                        mlp_bias=False, num_experts=E, experts_per_token=k, moe_mlp_hidden=F)
        par = sp_jax.ParallelConfig(expert_axis="expert")
        x = np.random.default_rng(0).normal(size=(ep, tokens, h)).astype(np.float32)
        with jax.set_mesh(mesh):
            moe = sp_jax.layers.MoE(cfg.moe_config(), parallel=par, rngs=nnx.Rngs(0))
            dense = sp_jax.layers.MLP(cfg.mlp_config(), parallel=par, rngs=nnx.Rngs(0))
            xs = jax.device_put(x, jax.NamedSharding(mesh, P(("data", "expert"), "tensor")))
        return cls(mesh, cfg, par, moe, dense, xs)

    @staticmethod
    def program(module):
        """The jitted gradient of ``sum(module(x) ** 2)`` w.r.t. the module and ``x``."""
        del module  # the program takes the module as its argument

        def loss(m, x):
            out = m(x)
            out = out[0] if isinstance(out, tuple) else out
            return jnp.sum(out ** 2)

        return nnx.jit(nnx.grad(loss, argnums=(0, 1)))


def _timed(fn, args, rounds: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_step_times(*, tokens: int = 2048, h: int = 256, F: int = 512, E: int = 8, k: int = 2,
                   rounds: int = 7) -> dict[str, Any]:
    """Median forward+backward seconds on one CPU device (fp32) of the dropless layer,
    a dense MLP of width ``k F``, and the dropless layer with a dense stand-in for its
    grouped GEMMs (interleaved rounds)."""
    from sp_jax.ops import moe as moe_ops

    bench = LayerBench.make(tokens=tokens, h=h, F=F, E=E, k=k, ep=1)
    cfg, par, moe, dense, xs, program = (bench.cfg, bench.parallel, bench.moe, bench.dense,
                                         bench.x, bench.program)
    with jax.set_mesh(bench.mesh):
        real = moe_ops.grouped_ffn

        def stand_in(rows, sizes, w_up, w_down, activation, **fp8):  # one dense GEMM pair
            del fp8  # (None here: the compute dtype)
            return activation(rows @ w_up[0].astype(rows.dtype)) @ w_down[0].astype(rows.dtype)

        programs = {"dense MLP (width k F)": (program(dense), dense),
                    "dropless MoE": (program(moe), moe)}
        moe_ops.grouped_ffn = stand_in
        try:
            stand = program(sp_jax.layers.MoE(cfg.moe_config(), parallel=par,
                                              rngs=nnx.Rngs(0)))
            jax.block_until_ready(stand(moe, xs))  # traced with the stand-in
        finally:
            moe_ops.grouped_ffn = real
        programs["dropless MoE, dense stand-in GEMMs"] = (stand, moe)
        times: dict[str, list[float]] = {name: [] for name in programs}
        for _ in range(rounds):
            for name, (fn, module) in programs.items():
                times[name].append(_timed(fn, (module, xs), 1))
    out = {name: statistics.median(v) for name, v in times.items()}
    return {"tokens": tokens, "h": h, "F": F, "E": E, "k": k, "rounds": rounds,
            "seconds": out}


@dataclasses.dataclass(frozen=True)
class MoEBench:
    """What :func:`run_moe` measures: the stack's shapes (``MIXTRAL`` overridden), its
    meshes, the CPU comparison's sizes and rounds, and the planner's GPU counts for
    Mixtral-8x7B (empty: no plan)."""

    shapes: dict[str, int] = dataclasses.field(default_factory=dict)
    meshes: tuple[tuple[str, tuple[int, ...]], ...] = tuple(MESHES.items())
    cpu: dict[str, int] = dataclasses.field(default_factory=dict)
    plan_gpus: tuple[int, ...] = (8, 16)
    balance_steps: int = 50

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FULL = MoEBench()
QUICK = MoEBench(shapes=dict(h=128, F=256, s=128, heads=8, kv_heads=2, layers=1),
                 meshes=(("data 2 x expert 2 x tensor 2", (2, 2, 1, 2)),),
                 cpu=dict(tokens=128, h=64, F=128, rounds=1), plan_gpus=(), balance_steps=10)

BALANCE = dict(vocab_size=64, max_seq_len=16, num_layers=1, num_heads=4, num_kv_heads=4,
               head_dim=8, hidden=32, mlp_hidden=48, num_experts=8, experts_per_token=2,
               moe_mlp_hidden=16, moe_scoring="sigmoid", moe_groups=4, moe_topk_groups=2,
               moe_routed_scale=2.5, num_shared_experts=1, router_aux_loss_coef=0.0,
               moe_seq_aux_loss_coef=0.0)
"""The aux-loss-free balancing target's model: ``deepseek-v3-tiny`` narrowed to one layer
of 8 experts in 4 groups (2 chosen, top 2), no auxiliary loss (tests/test_routing.py's)."""


def load_balance(steps: int, log=print) -> dict[str, Any]:
    """max/mean expert load after ``steps`` steps on skewed tokens
    (:func:`sp_jax.analysis.routing.expert_load_imbalance`, one CPU device), the
    selection bias updated at 0.01 and frozen."""
    from sp_jax.analysis.routing import expert_load_imbalance

    out = {}
    mesh = jax.make_mesh((1, 1, 1), ("data", "expert", "tensor"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 3,
                         devices=jax.devices()[:1])
    for name, rate in (("with the bias", 0.01), ("without", 0.0)):
        cfg = GPTConfig.deepseek_v3_moe("deepseek-v3-tiny", **BALANCE,
                                        moe_bias_update_rate=rate)
        with jax.set_mesh(mesh):
            out[name] = expert_load_imbalance(cfg, steps=steps)["max_over_mean"]
        log(f"  load max/mean {name}: {out[name]:.3f}")
    return out


def _plans(gpus_counts: tuple[int, ...], log) -> list[dict[str, Any]]:
    from sp_jax.analysis.plan import MODELS, format_table, plan

    model = MODELS["mixtral-8x7b"]
    out = []
    for gpus in gpus_counts:
        rows = plan(model, gpus, progress=False)
        out.append({"gpus": gpus, "params": model.params, "table": format_table(model, rows),
                    "rows": [r.as_dict() for r in rows]})
        log(f"  mixtral-8x7b on {gpus} GPUs: {sum(r.fits for r in rows)}/{len(rows)} fit")
    return out


def run_moe(bench: MoEBench = FULL, log=print) -> dict[str, Any]:
    """The section's measurements and its targets."""
    started = time.perf_counter()
    gpu = {}
    for name, shape in bench.meshes:
        gpu[name] = compile_moe_stack(shape, **bench.shapes)
        log(f"  {name}: peak {fmt_mib(gpu[name]['peak_bytes'])}")
    cpu = cpu_step_times(**bench.cpu)
    balance = load_balance(bench.balance_steps, log)
    plans = _plans(bench.plan_gpus, log)
    targets = []
    for name, r in gpu.items():
        equal = abs(r["a2a_forward_bytes_per_layer"] - r["a2a_analytic_forward_bytes"]) \
            <= 0.01 * r["a2a_analytic_forward_bytes"] and r["dispatch_sends"] > 0
        targets.append({
            "id": f"moe_a2a_{'_'.join(map(str, r['mesh']))}",
            "target": f"MoE stack, {name}: per-GPU peak, and the all-to-all bytes per layer "
                      "= 2 k T h bytes (ep-1)/ep (forward; twice with the backward)",
            "measured": f"peak {fmt_mib(r['peak_bytes'])}; {r['ragged_per_layer']:g} ragged "
                        "all-to-alls per layer, forward "
                        f"{fmt_mib(r['a2a_forward_bytes_per_layer'])} vs analytic "
                        f"{fmt_mib(r['a2a_analytic_forward_bytes'])}",
            "met": equal})
    for p in plans:
        fits = [row for row in p["rows"] if row["fits"]]
        best = min((row for row in p["rows"] if not row["error"]),
                   key=lambda row: row["peak_bytes"], default=None)
        targets.append({
            "id": f"moe_plan_{p['gpus']}",
            "target": f"plan: Mixtral-8x7B on {p['gpus']} H100: a layout that fits",
            "measured": (", ".join(f"{row['label']}: {row['peak_bytes'] / 2**30:.1f} GiB"
                                   for row in fits) if fits else
                         f"none fits: the best, {best['label']}, needs "
                         f"{best['peak_bytes'] / 2**30:.1f} GiB" if best else "not compiled"),
            "met": bool(fits)})
    targets.append({
        "id": "moe_aux_free_bias",
        "target": f"aux-loss-free bias: after {bench.balance_steps} steps of the tiny model on "
                  "skewed data, the max/mean expert load lower with the bias than without",
        "measured": f"{balance['with the bias']:.2f} with the bias, "
                    f"{balance['without']:.2f} without",
        "met": balance["with the bias"] < balance["without"]})
    s = cpu["seconds"]
    dense = s["dense MLP (width k F)"]
    targets.append({
        "id": "moe_cpu", "target": "CPU: the dropless layer's step time vs a dense MLP of the "
                                   "same active FLOPs (k F), and the masked lowering's part",
        "measured": f"{s['dropless MoE'] / dense:.2f}x; with a dense stand-in for the "
                    f"grouped GEMMs {s['dropless MoE, dense stand-in GEMMs'] / dense:.2f}x",
        "met": None})
    return {"config": bench.as_dict(), "gpu": gpu, "cpu": cpu, "plans": plans,
            "balance": balance,
            "targets": targets, "meta": {"runtime_s": time.perf_counter() - started}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.render.moe import render_markdown
    from benchmarks.section import section_main

    return section_main(argv, description=__doc__.splitlines()[0], run=run_moe, full=FULL,
                        quick=QUICK, render=render_markdown, quick_help="tiny shapes, no plan")


if __name__ == "__main__":
    main()
