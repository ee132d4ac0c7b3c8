"""Writes a run's results: ``BENCHMARKS.md``, ``docs/bench.json`` and the memory plots
(under the ``--out`` directory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.render import render_document
from benchmarks.render.common import JSON_NAME, LABELS_CP, PLOT_CONTEXT, PLOT_S, PLOT_T
from benchmarks.targets import MiB

__all__ = ["write_outputs", "plot_context", "plot_memory"]


def plot_context(res: dict[str, Any], docs: Path) -> list[Path]:
    scaling = res.get("context_cpu", {}).get("scaling")
    if not scaling:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = scaling["s"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    markers = {"tp_sp": "o", "ring": "s", "ulysses": "^"}
    base = next((m for m in scaling["meshes"] if m["context"] * m["tensor"] == 1), None)
    for i, m in enumerate(scaling["meshes"]):
        n = m["context"] * m["tensor"]
        label = ("unsharded" if n == 1 else f"{LABELS_CP[m['mode']]}, context {m['context']}"
                 f" x tensor {m['tensor']}")
        ax.plot(xs, [y / MiB for y in m["bytes"]], marker=markers[m["mode"]], color=f"C{i}",
                label=label, zorder=3)
    if base:
        sizes = sorted({m["context"] * m["tensor"] for m in scaling["meshes"]} - {1})
        for j, n in enumerate(sizes):
            ax.plot(xs, [y / n / MiB for y in base["bytes"]], ls="--", color="0.5", lw=1,
                    zorder=2, label="unsharded / (context x tensor)" if j == 0 else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x // 1024}k" if x >= 1024 else str(x) for x in xs])
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("activation MiB per device")
    ax.set_title(f"One block's activations (h={scaling['h']}, a={scaling['a']}, bf16)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = docs / PLOT_CONTEXT
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_memory(res: dict[str, Any], docs: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem = res["memory"]
    sh = mem["shape"]
    styles = {
        "sp_recompute": dict(color="C0", marker="o", label="sp_jax recompute (measured)"),
        "sp_save": dict(color="C1", marker="s", label="sp_jax save (measured)"),
        "gspmd": dict(color="C2", marker="^", ls=":", label="GSPMD baseline (measured)"),
        "unsharded": dict(color="C3", marker="D", label="unsharded, 1 device (measured)"),
        "tp_sp": dict(color="k", ls="--", label="formula TP+SP: sbh/t (34 + 5as/h)"),
        "tp_sp_selective": dict(color="0.55", ls="--", lw=4, alpha=0.5,
                                label="formula TP+SP selective: 34 sbh/t"),
        "tp": dict(color="C4", ls="-.", label="formula TP (no SP)"),
        "none": dict(color="C3", ls="--", label="formula none (t = 1)"),
    }
    paths = []
    for key, xs_key, title, name, formulas in (
        ("vs_t", "t", f"one layer, h={sh['h']}, a={sh['a']}, s={sh['s']}, b={sh['b']}", PLOT_T,
         ("tp_sp", "tp_sp_selective", "tp")),
        ("vs_s", "s", f"one layer, h={sh['h']}, a={sh['a']}, t={sh['t']}, b={sh['b']}", PLOT_S,
         ("tp_sp", "tp_sp_selective", "none")),
    ):
        scan = mem[key]
        xs = scan[xs_key]
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for v, ys in scan["measured"].items():
            ax.plot(xs, [y / MiB for y in ys], zorder=3, **styles[v])
        for f in formulas:
            ax.plot(xs, [y / MiB for y in scan["formula"][f]], zorder=2, **styles[f])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("tensor-parallel size t" if xs_key == "t" else "sequence length s")
        ax.set_ylabel("activation MiB per device")
        ax.set_title(f"Activation memory vs {xs_key} ({title})", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = docs / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write_outputs(res: dict[str, Any], out: Path) -> list[Path]:
    """``out/BENCHMARKS.md``, ``out/docs/bench.json`` and ``out/docs/bench_*.png``."""
    out = Path(out)
    docs = out / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    json_path = docs / JSON_NAME
    json_path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    plots = plot_memory(res, docs) + plot_context(res, docs)
    md = out / "BENCHMARKS.md"
    md.write_text(render_document(res, docs))
    return [md, json_path, *plots]



