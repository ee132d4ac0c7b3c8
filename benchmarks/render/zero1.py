"""The ZeRO-1 section of BENCHMARKS.md from :func:`benchmarks.zero1.run_zero1`'s results."""

from __future__ import annotations

from typing import Any

from benchmarks.render.common import targets_table
from benchmarks.render.template import fields, filler, table

_fill = filler("zero1")

_KINDS = ("reduce-scatter", "all-reduce", "all-gather")


def render_markdown(res: dict[str, Any]) -> str:
    b, rep, zero = res["bench"], res["replicated"], res["zero1"]
    rows = [[name, *(f"{r[k]:,.1f}" for k in ("optimizer_mib", "param_mib", "argument_mib",
                                              "temp_mib", "peak_mib")),
             *(f"{r[f'{k}_ops']} / {r[f'{k}_mib']:,.1f}" for k in _KINDS)]
            for name, r in (("replicated", rep), ("ZeRO-1", zero))]
    saved, delta = rep["peak_mib"] - zero["peak_mib"], zero["temp_mib"] - rep["temp_mib"]
    return "\n".join([
        '## ZeRO-1 on 8 x H100 (`ParallelConfig(fsdp="optimizer")`)',
        "",
        _fill("section.1", **fields(b, "layers", "h", "heads", "s", "vocab", "data")),
        "",
        table(["step", "optimizer (MiB)", "parameters (MiB)", "arguments (MiB)",
               "temp (MiB)", "peak (MiB)", *_KINDS], rows),
        "",
        targets_table(res["targets"]),
        "",
        _fill("section.2", data=b["data"], saved=f"{saved:,.1f}",
              saved_ratio=f"{saved / rep['optimizer_mib']:.2f}",
              moments_saved=f"{rep['optimizer_mib'] - zero['optimizer_mib']:,.1f}",
              temp_delta=f"{abs(delta):,.1f}", temp_direction="higher" if delta > 0 else "lower",
              replicated_all_reduces=rep["all-reduce_ops"],
              zero1_reduce_scatters=zero["reduce-scatter_ops"],
              zero1_all_reduce_mib=f"{zero['all-reduce_mib']:,.1f}",
              zero1_all_gather_mib=f"{zero['all-gather_mib']:,.1f}",
              param_mib=f"{zero['param_mib']:,.1f}"),
        "",
    ])
