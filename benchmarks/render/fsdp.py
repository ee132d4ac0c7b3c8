"""The FSDP section of BENCHMARKS.md from :func:`benchmarks.fsdp.run_fsdp`'s results."""

from __future__ import annotations

from typing import Any

from benchmarks.render.template import fill, table
from benchmarks.section import status


def _fill(fragment: str, /, **values: Any) -> str:
    return fill("fsdp", fragment, **values)


def render_markdown(res: dict[str, Any]) -> str:
    b = res["bench"]
    lines = [
        "## FSDP on 8 x H100",
        "",
        _fill("section.1", layers=b["layers"], h=b["h"], s=b["s"], vocab=b["vocab"]),
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
        table(
            ["target", "measured", "status"],
            [[t["target"], t["measured"], status(t["met"])] for t in res["targets"]],
        ),
        "",
    ]
    return "\n".join(lines)
