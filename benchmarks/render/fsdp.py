"""The FSDP section of BENCHMARKS.md from :func:`benchmarks.fsdp.run_fsdp`'s results."""

from __future__ import annotations

from typing import Any

from benchmarks.render.common import targets_table
from benchmarks.render.template import fields, filler, table

_fill = filler("fsdp")


def render_markdown(res: dict[str, Any]) -> str:
    b = res["bench"]
    lines = [
        "## FSDP on 8 x H100",
        "",
        _fill("section.1", **fields(b, "layers", "h", "s", "vocab")),
        "",
    ]
    lines.append(
        table(
            [
                "layout",
                "replicated temp (MiB)",
                "fsdp temp (MiB)",
                "ratio",
                "fsdp peak (MiB)",
                "backward weight gathers async",
                "with work inside",
                "their dtype",
            ],
            [
                [
                    f"{r['data']} x {r['tensor']}{', scanned layers' if r['scan'] else ''}",
                    f"{r['replicated']['temp_mib']:.1f}",
                    f"{r['fsdp']['temp_mib']:.1f}",
                    f"{r['temp_ratio']:.2f}x",
                    f"{r['fsdp']['peak_mib']:.1f}",
                    f"{r['fsdp']['bwd_gathers_async']} of {r['fsdp']['bwd_gathers']}",
                    f"{r['fsdp']['bwd_gathers_overlapped']}",
                    ", ".join(r["fsdp"]["bwd_gather_dtypes"]),
                ]
                for r in res["rows"]
            ],
        )
    )
    lines += [
        "",
        targets_table(res["targets"]),
        "",
    ]
    return "\n".join(lines)
