"""Renders ``BENCHMARKS.md`` from committed results and diffs it against the committed one.

``python -m benchmarks.check_render [--json docs/bench.json] [--markdown BENCHMARKS.md]
[--docs docs]`` feeds the results (``docs/bench.json``: the last full ``make bench``)
to the renderer (:func:`benchmarks.render.render_document`) and prints a unified diff
against the markdown; exit status 0 when they are equal, 1 otherwise. A run's results hold
every section: those it measures, and the recorded ones (``docs/bench_recorded.json``: what
``make bench`` does not measure, each with when, how and where it was measured), so after
``make bench`` the two are equal."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.check_render", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "bench.json")
    parser.add_argument("--markdown", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument(
        "--docs", type=Path, default=ROOT / "docs", help="where the report looks for gpu_check.md"
    )
    parser.add_argument("--write", type=Path, help="also write the rendered markdown here")
    args = parser.parse_args(argv)
    from benchmarks.render import render_document

    rendered = render_document(json.loads(args.json.read_text()), args.docs)
    if args.write:
        args.write.write_text(rendered)
    committed = args.markdown.read_text()
    diff = list(
        difflib.unified_diff(
            committed.splitlines(keepends=True),
            rendered.splitlines(keepends=True),
            str(args.markdown),
            f"rendered from {args.json}",
        )
    )
    sys.stdout.writelines(diff)
    print(
        f"{args.markdown}: {'equal' if not diff else 'differs'} "
        f"({sum(line.startswith('-') and not line.startswith('---') for line in diff)} "
        f"lines only in the markdown, "
        f"{sum(line.startswith('+') and not line.startswith('+++') for line in diff)} "
        "only in the rendering)",
        file=sys.stderr,
    )
    return 0 if not diff else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
