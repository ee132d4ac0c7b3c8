"""The mixture-of-experts section of BENCHMARKS.md from :func:`benchmarks.moe.run_moe`'s results."""

from __future__ import annotations

from typing import Any

from benchmarks.moe import MIXTRAL, fmt_mib
from benchmarks.section import status, table


def render_markdown(res: dict[str, Any]) -> str:
    """The ``## Mixture of experts`` section of ``BENCHMARKS.md``."""

    gpu, cpu = res["gpu"], res["cpu"]
    m = {**MIXTRAL, **res["config"]["shapes"]}
    lines = ["## Mixture of experts", "",
             "`python -m benchmarks.moe` (`benchmarks/moe.py`; part of `make bench`). "
             "Deviceless 8 x H100 compiles of a Mixtral-shaped stack (bf16 compute, fp32 "
             "parameters and weight gradients, `recompute_allgather`, "
             "dropless), the CPU step time of one layer, and the planner on Mixtral-8x7B.", "",
             "### Targets", "",
             table(["target", "measured", "status"],
                   [[t["target"], t["measured"], status(t["met"])] for t in res["targets"]]),
             "",
             f"### Mixtral-shaped stack on 8 x H100 ({m['layers']} layers, h={m['h']}, "
             f"F={m['F']}, E={m['E']}, k={m['k']}, s={m['s']}, global batch {m['batch']})", "",
             table(["mesh (data x expert x context x tensor)", "per-GPU peak", "temp",
                    "ragged all-to-alls per layer (fwd + bwd)",
                    "all-to-all bytes per layer, forward (HLO / analytic)",
                    "receive buffer (static)", "a dense [T, E, h] dispatch"],
                   [[f"{name} {r['mesh']}", fmt_mib(r["peak_bytes"]), fmt_mib(r["temp_bytes"]),
                     f"{r['ragged_per_layer']:g}",
                     f"{fmt_mib(r['a2a_forward_bytes_per_layer'])} / "
                     f"{fmt_mib(r['a2a_analytic_forward_bytes'])}",
                     f"{r['receive_rows']:,} rows, {fmt_mib(r['receive_buffer_bytes'])}",
                     fmt_mib(r["dense_dispatch_bytes"])] for name, r in gpu.items()]), ""]
    for name, r in gpu.items():
        big = "; ".join(f"{shape} {fmt_mib(b)} ({op.split('/')[-1] or 'XLA'})"
                        for b, shape, op in r["largest_at_peak"])
        lines.append(f"- {name}: largest buffers live at the peak: {big}; other collectives "
                     f"{r['other_collectives']}.")
    lines += ["", "The HLO column is the dispatch's send operand, `[k T, h]` (every routed "
              "row once; the return sends the same rows back), times the `(ep - 1) / ep` "
              "that leaves the device when the routing is balanced: what moves is "
              "data-dependent, the buffers are not. The receive buffer is the worst case, "
              "`ep T min(k, E / ep)` rows (every peer's tokens routed to this device's "
              "experts), and it sizes the grouped GEMMs' outputs: the largest buffers above. "
              "With one expert per device (expert 8) it equals a dense `[T, E, h]` dispatch "
              "buffer; with several (expert 2) XLA's masked `ragged_dot` lowering expands "
              "the rows once per local expert (`[E / ep, rows, ...]`, the `bf16[4, ...]` "
              "buffers), which is why the expert axis should hold one expert per device on "
              "GPUs. A real grouped GEMM is TPU's lowering of `ragged_dot`; on GPUs it "
              "needs a grouped-GEMM kernel (not in XLA:GPU 0.10.2).", ""]
    s = cpu["seconds"]
    base = s["dense MLP (width k F)"]
    lines += [f"### CPU: the dropless layer vs a dense MLP of the same active FLOPs "
              f"({cpu['tokens']} tokens, h={cpu['h']}, E={cpu['E']}, k={cpu['k']}, "
              f"F={cpu['F']}; forward+backward, 1 device, fp32, median of "
              f"{cpu['rounds']} interleaved rounds)", "",
              table(["program", "seconds", "vs dense"],
                    [[name, f"{v:.4f}", f"{v / base:.2f}x"] for name, v in s.items()]), ""]
    masked = s["dropless MoE"] - s["dropless MoE, dense stand-in GEMMs"]
    lines += [f"The masked lowering's part: {masked:.4f} s of {s['dropless MoE']:.4f} s "
              f"({masked / s['dropless MoE']:.0%}): XLA:CPU computes each `ragged_dot` "
              f"as a dense dot over all {cpu['E']} experts with the other experts' rows "
              "masked. The stand-in (one dense GEMM pair over the sorted rows: the FLOPs of "
              "a real grouped GEMM, not its values) runs the routing, sort, gathers and "
              "scatters of the dropless layer around it.", ""]
    for p in res["plans"]:
        lines += [f"### Planner: Mixtral-8x7B on {p['gpus']} H100", "", p["table"], ""]
        if not any(row["fits"] for row in p["rows"]):
            state = 16 * p["params"] / p["gpus"] / 2**30
            lines += [f"Why none fits: fp32 master weights, fp32 Adam moments and fp32 "
                      f"gradients are 16 bytes per parameter, {p['params'] / 1e9:.1f}B x 16 "
                      f"B / {p['gpus']} GPUs = {state:.1f} GiB per GPU before any "
                      "activation (an H100 has 74.5 GiB). It takes more GPUs (16 above), or "
                      "low-precision optimizer state or offloading, which sp_jax does not "
                      "have.", ""]
    return "\n".join(lines)
