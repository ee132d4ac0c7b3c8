"""BENCHMARKS.md from the results of ``python -m benchmarks`` (:func:`benchmarks.run.run`):
the run's own sections and those of the stand-alone sections (:mod:`benchmarks.render.pipeline`,
...), in one document."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.records import LABELS as LABELS
from benchmarks.records import VARIANTS as VARIANTS
from benchmarks.records import MiB as MiB
from benchmarks.render.collectives import collectives_section, gpu_section
from benchmarks.render.common import GPU_CHECK_NAME, JSON_NAME
from benchmarks.render.common import fmt_mib as fmt_mib
from benchmarks.render.context import context_section
from benchmarks.render.fsdp import render_markdown as render_fsdp
from benchmarks.render.generation import render_markdown as render_generation
from benchmarks.render.memory import memory_section
from benchmarks.render.moe import render_markdown as render_moe
from benchmarks.render.pipeline import render_markdown as render_pipeline
from benchmarks.render.steps import gpt_time_section, stacks_section, time_section
from benchmarks.render.template import fields, filler, table
from benchmarks.render.text import render_markdown as render_text
from benchmarks.render.zero1 import render_markdown as render_zero1

_fill = filler("benchmarks")


def _status(met) -> str:
    return {True: "met", False: "**not met**", None: "not measured"}[met]


def _targets_section(res) -> str:
    rows = [
        [i + 1, t["target"], t["measured"], _status(t["met"])] for i, t in enumerate(res["targets"])
    ]
    return _fill(
        "targets",
        met=sum(t["met"] is True for t in res["targets"]),
        total=len(res["targets"]),
        table=table(["#", "target", "measured", "status"], rows),
    )


def _render_fp8(fp8: dict[str, Any]) -> str:
    from benchmarks.render.fp8 import render_markdown as render_fp8

    return render_fp8(fp8)


def _plan_markdown(pl: dict[str, Any]) -> str:
    out = [_fill("plan.1"), "", _fill("plan.2"), ""]
    for p in pl["plans"]:
        out += [f"### {p['model']}, s={p['seq']:,}, {p['gpus']} GPUs", "", p["table"], ""]
    sm = pl["small"]
    out += [
        _fill(
            "plan.3",
            v=format(sm["row"]["activation_bytes"] / 2**20, ".2f"),
            v2=format(sm["cpu_activation_bytes"] / 2**20, ".2f"),
        ),
        "",
    ]
    return "\n".join(out)


# The sections with targets, tables and prose of their own: results key, title when not
# measured, renderer.
_OWN_SECTIONS: tuple[tuple[str, str, Callable[[dict[str, Any]], str]], ...] = (
    ("pipeline", "Pipeline parallelism", render_pipeline),
    ("text", "Packed documents", render_text),
    ("generation", "Generation", render_generation),
    ("fsdp", "FSDP on 8 x H100", render_fsdp),
    ("zero1", "ZeRO-1 on 8 x H100", render_zero1),
    ("moe", "Mixture of experts", render_moe),
    ("fp8", "FP8", _render_fp8),
    ("plan", "Memory planner", _plan_markdown),
)


def _own_section(res, key: str, title: str, render: Callable[[dict[str, Any]], str]) -> str:
    """``""`` when the run has no ``key`` section, the "Not measured" section when it
    failed, else the section ``render`` makes of it."""
    section = res.get(key)
    if not section:
        return ""
    if "error" in section:
        return _fill("not_measured", title=title, error=section["error"])
    return render(section)


SECTIONS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("targets", _targets_section),
    ("memory", memory_section),
    ("collectives", collectives_section),
    ("gpu", gpu_section),
    ("stacks", stacks_section),
    ("step_time", time_section),
    ("gpt_step_time", gpt_time_section),
    ("context", context_section),
    *((key, functools.partial(_own_section, key=key, title=title, render=render))
      for key, title, render in _OWN_SECTIONS),
)
"""The document's sections in order: the key a recorded section names as ``after``, and
the renderer of the run's results."""


def recorded_section(entry: dict[str, Any]) -> str:
    """A recorded section (:func:`benchmarks.records.load_recorded`): its heading, when,
    how and where it was measured and why ``make bench`` does not, and its text."""
    head = [entry["heading"], ""] if entry["heading"] else []
    return "\n".join([*head, _fill("recorded", **fields(entry, "why", "date", "command",
                                                         "machine")), "", entry["markdown"]])


def _with_recorded(key: str, text: str, recorded: list[dict[str, Any]]) -> list[str]:
    """``text`` (section ``key``) followed by the recorded sections placed after it, each
    followed by those placed after it."""
    out = [text]
    for entry in recorded:
        if entry["after"] == key:
            out += _with_recorded(entry["key"], recorded_section(entry), recorded)
    return out


def render_markdown(res: dict[str, Any]) -> str:
    meta = res["meta"]
    head = _fill(
        "head",
        quick_flag=_fill("quick_flag") if meta["quick"] else "",
        **fields(meta, "date", "jax", "flax", "python", "devices", "cpu_count"),
        runtime=f"{meta['runtime_s']:.0f}",
        json=JSON_NAME,
    )
    recorded = res.get("recorded", [])
    known = {key for key, _ in SECTIONS} | {e["key"] for e in recorded}
    stray = [e["key"] for e in recorded if e["after"] not in known]
    if stray:
        raise ValueError(f"recorded sections {stray} follow no section of the document")
    body = [part for key, render in SECTIONS
            for part in _with_recorded(key, render(res), recorded)]
    secs = ", ".join(f"{k} {v:.0f} s" for k, v in meta["section_seconds"].items())
    tail = _fill("run", seconds=secs, xla_flags=meta["xla_flags"])
    return head + "\n" + "\n\n".join(body) + "\n\n" + tail


def real_gpu_section(gpu_check: Path) -> str:
    """The latest ``make gpu-check`` report, when one was copied to ``docs/``."""
    head = _fill("real_gpu.1")
    if not gpu_check.exists():
        return _fill("real_gpu.2", head=head, gpu_check_name=GPU_CHECK_NAME)
    return _fill(
        "real_gpu.3", head=head, gpu_check_name=GPU_CHECK_NAME, read_text=gpu_check.read_text()
    )


def render_document(res: dict[str, Any], docs: Path) -> str:
    """The whole ``BENCHMARKS.md``: the run's results ``res`` and the latest ``make
    gpu-check`` report when one was copied to ``docs/``."""
    return render_markdown(res) + "\n" + real_gpu_section(Path(docs) / GPU_CHECK_NAME)
