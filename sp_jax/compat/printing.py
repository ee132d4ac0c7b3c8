"""The table as text: :func:`render` (``python -m sp_jax.compat``), :func:`markdown`
(``docs/api.md``'s block) and :func:`describe` (one cell, ``--cell MODE A [B]``)."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

from sp_jax.compat.table import (
    COVERED,
    FEATURES,
    MODES,
    REFUSALS,
    STATUSES,
    TABLE,
    cell,
    coverage_source,
    fix_text,
    load_coverage,
)

__all__ = ["describe", "main", "markdown", "render"]

_SHORT: dict[str, str] = {
    "tensor_sequence": "ts", "collective_matmul": "cm", "recompute_allgather": "ra",
    "fsdp": "fs", "context_ring": "cr", "context_ulysses": "cu", "pipeline_gpipe": "pg",
    "pipeline_1f1b": "p1", "scan_layers": "sl", "unrolled_layers": "ul", "experts": "ex",
    "expert_parallel": "ep", "interleaved_experts": "ie", "dense_layers": "dl",
    "sigmoid_routing": "sr", "aux_free_bias": "ab", "seq_aux_loss": "sq",
    "fp8_current": "8c",
    "fp8_delayed": "8d", "packed_documents": "pd", "sliding_window": "sw",
    "layer_windows": "lw", "cudnn_attention": "cd", "grouped_query": "gq",
    "attention_dropout": "ad",
    "attention_softcap": "ac", "custom_loss": "cl", "zero1": "z1", "grad_reduce_dtype": "gr",
    "offload_optimizer": "oo", "offload_activations": "oa", "mla_attention": "ml", "mtp": "mt",
    "lora": "lo",
}


def render() -> str:
    """The table as text: where its coverage came from, one matrix per mode (compact
    symbols, under 100 columns), the legend, then every refused cell with its fix."""
    width = max(map(len, FEATURES))
    source = coverage_source()
    lines = [f"Coverage: {source} ({len(COVERED)} rows)." if source else
             "Coverage: none loaded (a checkout's tests/compat_coverage.py, or --coverage "
             "PATH): no cell is supported.",
             "Legend:", *(f"  {s}  {text}" for s, text in STATUSES.values()), "Features:"]
    lines.extend(textwrap.wrap(", ".join(f"{_SHORT[f]} {f}" for f in FEATURES), 99,
                               initial_indent="  ", subsequent_indent="  "))
    lines.append("")
    # two columns a feature, its code over them on one of two staggered header lines (the
    # odd features' on the first, the even ones' on the second): 28 features fit in 100
    codes = [_SHORT[f] for f in FEATURES]
    header = [" " * (width + 1) + "  ".join(codes[i::2]) for i in (0, 1)]
    header[1] = "  " + header[1]
    for mode, text in MODES.items():
        lines.append(f"{mode}: {text}")
        lines.extend(line.rstrip() for line in header)
        for f in FEATURES:
            row = "".join(f"{STATUSES[TABLE[mode][frozenset((f, g))].status][0]:>2}"
                          for g in FEATURES)
            lines.append(f"{f:<{width + 1}}{row}")
        lines.append("")
    lines.append("Refused (modes: features: what to do; pipeline, fp8 and context stand for "
                 "each of their values):")
    for modes, a, b, fix, unless in REFUSALS:
        pair = a if b is None else f"{a} x {b}"
        pair += f" (unless {' or '.join(unless)})" if unless else ""
        fix = fix_text(fix)
        lines.extend(textwrap.wrap(f"- {', '.join(modes)}: {pair}: {fix}", 99,
                                   subsequent_indent="  "))
    lines.append("Refused through what a feature brings along (IMPLIES; the same fix):")
    implied: dict[tuple[str, str, tuple[str, ...]], list[str]] = {}
    for mode in MODES:
        for x, y in itertools.combinations(FEATURES, 2):
            c = TABLE[mode][frozenset((x, y))]
            if c.status == "refused" and c.via:
                implied.setdefault((c.first, y if c.first == x else x, c.via), []).append(mode)
    for (a, b, via), modes in implied.items():
        lines.extend(textwrap.wrap(f"- {', '.join(modes)}: {a} x {b}: as {' x '.join(via)}",
                                   99, subsequent_indent="  "))
    lines.append("The tests that run a + cell (and each one's features): python -m "
                 "sp_jax.compat --cell MODE A [B]")
    return "\n".join(lines)


def describe(mode: str, a: str, b: str | None = None) -> str:
    """One cell in words (``python -m sp_jax.compat --cell``): its status, and what
    supports it (each test that runs it, with the features that test runs together in
    ``mode``: the covering combination of a pair) or refuses it (the fix)."""
    c = cell(mode, a, b)
    pair = a if b is None or b == a else f"{a} x {b}"
    lines = [f"{mode}: {pair}: {STATUSES[c.status][0]} {STATUSES[c.status][1]}"]
    if c.status == "refused":
        lines.extend(textwrap.wrap(fix_text(c.fix), 97, initial_indent="  ",
                                   subsequent_indent="  "))
        if c.via:
            lines.append(f"  (as {' x '.join(c.via)}: a feature brings the other along)")
        if c.unless:
            lines.append(f"  (unless {' or '.join(c.unless)})")
    for test in c.tests:
        runs = [f for modes, f, t in COVERED if t == test and mode in modes]
        lines.append(f"  {test}")
        lines.extend(textwrap.wrap(", ".join(runs[0]) if runs else "", 95,
                                   initial_indent="    ", subsequent_indent="    "))
    return "\n".join(lines)


def markdown() -> str:
    """The table for ``docs/api.md``: :func:`render` in a text block."""
    return "```text\n" + render() + "\n```\n"


def main(argv: list[str] | None = None) -> None:
    """``python -m sp_jax.compat [--markdown] [--coverage PATH] [--cell MODE A [B]]``:
    prints the table (or one cell), with
    the coverage of ``PATH`` (default: ``tests/compat_coverage.py`` beside the package,
    when there is one)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sp_jax.compat",
                                     description="The table of what combines in sp_jax.")
    parser.add_argument("--markdown", action="store_true", help="print it as docs/api.md "
                        "shows it (a text block)")
    parser.add_argument("--coverage", type=Path, help="the coverage rows (a Python file "
                        "with COVERED); default: tests/compat_coverage.py of the checkout")
    parser.add_argument("--cell", nargs="+", metavar=("MODE", "FEATURE"), help="print one "
                        "cell: MODE A [B], with the tests that run it and their features")
    args = parser.parse_args(argv)
    try:
        load_coverage(args.coverage)
    except FileNotFoundError:
        if args.coverage is not None:  # without one: the installed package's bare table
            raise
    if args.cell:
        if len(args.cell) not in (2, 3):
            parser.error(f"--cell takes MODE A [B], got {' '.join(args.cell)!r}")
        try:
            print(describe(*args.cell))
        except ValueError as e:
            parser.error(f"--cell: {e}")
        return
    print(markdown() if args.markdown else render())


