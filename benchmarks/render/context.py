"""The long-context section of BENCHMARKS.md (``res['context']``, ``res['context_cpu']``)."""

from __future__ import annotations

from typing import Any

from benchmarks.render.common import LABELS_CP, PLOT_CONTEXT, fmt_mib
from benchmarks.render.template import fields, filler, table

_fill = filler("benchmarks")


def mesh_label(r: dict[str, Any]) -> str:
    return f"{r['context']} x {r['tensor']}"


def context_section(res) -> str:
    gpu, cpu = res.get("context", {}), res.get("context_cpu", {})
    if not gpu and not cpu:
        return ""
    b = res["meta"]["config"]["context"]
    out = [
        _fill("context.1"),
        "",
        _fill("context.2"),
        "",
    ]
    if "runs" in gpu:
        out += [
            _fill("context.3", **fields(b, "layers", "h", "a")),
            "",
            _fill("context.4", **fields(b, "layers", "h", "a", "block")),
            "",
        ]
        rows = [
            [
                f"{r['s']:,}",
                r["gpus"],
                LABELS_CP[r["mode"]],
                mesh_label(r),
                f"{r['argument_bytes'] / 2**30:.2f}",
                f"{r['temp_bytes'] / 2**30:.2f}",
                f"{r['peak_bytes'] / 2**30:.2f}",
                "yes" if r["fits_h100"] else "**no**",
                f"{r['compile_s']:.0f}",
            ]
            for r in gpu["runs"]
        ]
        out += [
            table(
                [
                    "tokens",
                    "GPUs",
                    "attention",
                    "context x tensor",
                    "arguments GiB",
                    "temp GiB",
                    "peak GiB",
                    "fits 80 GB",
                    "compile s",
                ],
                rows,
            ),
            "",
        ]
        out += [fits_summary(gpu["runs"]), ""]
    scaling = cpu.get("scaling")
    if scaling:
        out += [
            _fill("context.5", **fields(scaling, "h", "a")),
            "",
            _fill("context.6"),
            "",
            _fill("context.7", plot_context=PLOT_CONTEXT),
            "",
        ]
        rows = [
            [LABELS_CP[m["mode"]] if m["context"] * m["tensor"] > 1 else "unsharded", mesh_label(m)]
            + [fmt_mib(x) for x in m["bytes"]]
            + [f"{min(m['per_token_x_devices']):.0f} - {max(m['per_token_x_devices']):.0f}"]
            for m in scaling["meshes"]
        ]
        out += [
            table(
                [
                    "attention",
                    "context x tensor",
                    *(f"s={s:,}" for s in scaling["s"]),
                    "bytes x c x t / s",
                ],
                rows,
            ),
            "",
        ]
    if gpu.get("communication"):
        out += [_fill("context.8"), "", _fill("context.9"), ""]
        rows = []
        for c in gpu["communication"]:
            for key, want in c["analytic_bytes"].items():
                got = c["measured_bytes"].get(key, 0)
                rows.append(
                    [
                        LABELS_CP[c["mode"]],
                        mesh_label(c),
                        f"{c['s']:,}",
                        key,
                        c["ops"].get(key, 0),
                        c["async_ops"].get(key, 0),
                        fmt_mib(got),
                        fmt_mib(want),
                    ]
                )
        out += [
            table(
                [
                    "attention",
                    "context x tensor",
                    "tokens",
                    "phase / collective",
                    "ops",
                    "async",
                    "measured MiB",
                    "analytic MiB",
                ],
                rows,
            ),
            "",
        ]
    if cpu.get("balance"):
        rows = [
            [
                bl["context"],
                f"{bl['s']:,}",
                bl["block"],
                f"{min(bl['ring']['counts'])} - {max(bl['ring']['counts'])}",
                f"{bl['ring']['max_over_mean']:.2f}",
                f"{min(bl['ring_contiguous']['counts'])} - {max(bl['ring_contiguous']['counts'])}",
                f"{bl['ring_contiguous']['max_over_mean']:.2f}",
            ]
            for bl in cpu["balance"]
        ]
        out += [
            _fill("context.10"),
            "",
            _fill("context.11"),
            "",
            table(
                [
                    "context",
                    "tokens",
                    "block",
                    "zigzag products",
                    "zigzag max/mean",
                    "contiguous products",
                    "contiguous max/mean",
                ],
                rows,
            ),
            "",
        ]
    st = cpu.get("step_time")
    if st:
        q = st["ratio_quartiles"]
        out += [
            _fill("context.12"),
            "",
            _fill(
                "context.13",
                **fields(st, "s", "heads", "head_dim", "devices", "rounds", "block"),
                v=format(st["median_s"]["blockwise"] * 1e3, ".1f"),
                v2=format(st["median_s"]["query_blocked"] * 1e3, ".1f"),
                ratio_blockwise_to_query_blocked=format(
                    st["ratio_blockwise_to_query_blocked"], ".2f"
                ),
                v3=format(q[0], ".2f"),
                v4=format(q[1], ".2f"),
            ),
            "",
        ]
    return "\n".join(out)


def _fits_run(r: dict[str, Any]) -> str:
    return _fill("fits_summary.run", mode=LABELS_CP[r["mode"]], gpus=r["gpus"], mesh=mesh_label(r))


def fits_summary(runs: list[dict[str, Any]]) -> str:
    """What the table shows, from its rows."""
    parts = []
    for s in sorted({r["s"] for r in runs}):
        rows = [r for r in runs if r["s"] == s]
        fit = [_fits_run(r) for r in rows if r["fits_h100"]]
        no = [_fits_run(r) for r in rows if not r["fits_h100"]]
        parts.append(
            _fill(
                "fits_summary.at",
                s=format(s, ","),
                fit=", ".join(fit) or "nothing",
                no=_fill("fits_summary.no", no=", ".join(no)) if no else "",
            )
        )
    return _fill("fits_summary.1", join="; ".join(parts))
