"""BENCHMARKS.md from the results of ``python -m benchmarks`` (:func:`benchmarks.run.run`):
the run's own sections and those of the stand-alone sections (:mod:`benchmarks.render.pipeline`,
...), in one document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from benchmarks.render.template import fill, table
from benchmarks.render.text import render_markdown as render_text
from benchmarks.targets import MiB as MiB
from benchmarks.variants import LABELS as LABELS
from benchmarks.variants import VARIANTS as VARIANTS


def _fill(fragment: str, /, **values: Any) -> str:
    return fill("benchmarks", fragment, **values)


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


def _unmeasured(res, key: str, title: str) -> str | None:
    """``""`` when the run has no ``key`` section, the "Not measured" section when it
    failed, else None (render it)."""
    section = res.get(key)
    if not section:
        return ""
    if "error" in section:
        return _fill("not_measured", title=title, error=section["error"])
    return None


def _pipeline_section(res) -> str:
    """``benchmarks.pipeline``'s section (its own targets, tables and prose)."""
    skipped = _unmeasured(res, "pipeline", "Pipeline parallelism")
    return render_pipeline(res["pipeline"]) if skipped is None else skipped


def _text_section(res) -> str:
    """``benchmarks.text``'s section (its own targets, tables and prose)."""
    skipped = _unmeasured(res, "text", "Packed documents")
    return render_text(res["text"]) if skipped is None else skipped


def _generation_section(res) -> str:
    """``benchmarks.generation``'s section (its own targets, tables and prose)."""
    skipped = _unmeasured(res, "generation", "Generation")
    return render_generation(res["generation"]) if skipped is None else skipped


def _moe_section(res) -> str:
    """``benchmarks.moe``'s section (its own targets, tables and prose)."""
    skipped = _unmeasured(res, "moe", "Mixture of experts")
    return render_moe(res["moe"]) if skipped is None else skipped


def _fp8_section(res) -> str:
    """``benchmarks.fp8``'s section (its own targets and tables)."""
    from benchmarks.render.fp8 import render_markdown as render_fp8

    skipped = _unmeasured(res, "fp8", "FP8")
    return render_fp8(res["fp8"]) if skipped is None else skipped


def _fsdp_section(res) -> str:
    """``benchmarks.fsdp``'s section (its own targets and table)."""
    skipped = _unmeasured(res, "fsdp", "FSDP on 8 x H100")
    return render_fsdp(res["fsdp"]) if skipped is None else skipped


def _plan_section(res) -> str:
    skipped = _unmeasured(res, "plan", "Memory planner")
    if skipped is not None:
        return skipped
    pl = res["plan"]
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


def render_markdown(res: dict[str, Any]) -> str:
    meta = res["meta"]
    head = _fill(
        "head",
        quick_flag=_fill("quick_flag") if meta["quick"] else "",
        date=meta["date"],
        jax=meta["jax"],
        flax=meta["flax"],
        python=meta["python"],
        devices=meta["devices"],
        cpu_count=meta["cpu_count"],
        runtime=f"{meta['runtime_s']:.0f}",
        json=JSON_NAME,
    )
    body = [
        _targets_section(res),
        memory_section(res),
        collectives_section(res),
        gpu_section(res),
        stacks_section(res),
        time_section(res),
        gpt_time_section(res),
        context_section(res),
        _pipeline_section(res),
        _text_section(res),
        _generation_section(res),
        _fsdp_section(res),
        _moe_section(res),
        _fp8_section(res),
        _plan_section(res),
    ]
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
