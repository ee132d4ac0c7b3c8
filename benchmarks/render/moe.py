"""The mixture-of-experts section of BENCHMARKS.md from :func:`benchmarks.moe.run_moe`'s results."""

from __future__ import annotations

from typing import Any

from benchmarks.records import MIXTRAL, fmt_mib
from benchmarks.render.common import targets_lines
from benchmarks.render.template import fields, filler, table

_fill = filler("moe")


def render_markdown(res: dict[str, Any]) -> str:
    """The ``## Mixture of experts`` section of ``BENCHMARKS.md``."""

    gpu, cpu = res["gpu"], res["cpu"]
    m = {**MIXTRAL, **res["config"]["shapes"]}
    lines = [
        "## Mixture of experts",
        "",
        _fill("section.1"),
        "",
        *targets_lines(res["targets"]),
        _fill("section.2", **fields(m, "layers", "h", "k", "s", "batch", f="F", e="E")),
        "",
        table(
            [
                "mesh (data x expert x context x tensor)",
                "per-GPU peak",
                "temp",
                "ragged all-to-alls per layer (fwd + bwd)",
                "all-to-all bytes per layer, forward (HLO / analytic)",
                "receive buffer (static)",
                "a dense [T, E, h] dispatch",
            ],
            [
                [
                    f"{name} {tuple(r['mesh'])}",
                    fmt_mib(r["peak_bytes"]),
                    fmt_mib(r["temp_bytes"]),
                    f"{r['ragged_per_layer']:g}",
                    f"{fmt_mib(r['a2a_forward_bytes_per_layer'])} / "
                    f"{fmt_mib(r['a2a_analytic_forward_bytes'])}",
                    f"{r['receive_rows']:,} rows, {fmt_mib(r['receive_buffer_bytes'])}",
                    fmt_mib(r["dense_dispatch_bytes"]),
                ]
                for name, r in gpu.items()
            ],
        ),
        "",
    ]
    for name, r in gpu.items():
        big = "; ".join(
            f"{shape} {fmt_mib(b)} ({op.split('/')[-1] or 'XLA'})"
            for b, shape, op in r["largest_at_peak"]
        )
        lines.append(
            _fill("section.3", name=name, big=big, other_collectives=r["other_collectives"])
        )
    lines += ["", _fill("section.4"), ""]
    s = cpu["seconds"]
    base = s["dense MLP (width k F)"]
    lines += [
        _fill("section.5", **fields(cpu, "tokens", "h", "k", "rounds", f="F", e="E")),
        "",
        table(
            ["program", "seconds", "vs dense"],
            [[name, f"{v:.4f}", f"{v / base:.2f}x"] for name, v in s.items()],
        ),
        "",
    ]
    masked = s["dropless MoE"] - s[_fill("section.6")]
    lines += [
        _fill(
            "section.7",
            masked=format(masked, ".4f"),
            dropless_moe=format(s["dropless MoE"], ".4f"),
            v=format(masked / s["dropless MoE"], ".0%"),
            e=cpu["E"],
        ),
        "",
    ]
    for p in res["plans"]:
        lines += [_fill("section.8", gpus=p["gpus"]), "", p["table"], ""]
        if not any(row["fits"] for row in p["rows"]):
            state = 16 * p["params"] / p["gpus"] / 2**30
            lines += [
                _fill(
                    "section.9",
                    v=format(p["params"] / 1e9, ".1f"),
                    gpus=p["gpus"],
                    state=format(state, ".1f"),
                ),
                "",
            ]
    return "\n".join(lines)
