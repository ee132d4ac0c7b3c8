"""What the stand-alone benchmark sections (:mod:`benchmarks.pipeline`,
:mod:`benchmarks.text`, ...) share: their targets' verdicts, and how their command lines
write the results (JSON, and the section rendered by :mod:`benchmarks.render`) and print
the targets."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.records import status

__all__ = ["section_main", "status", "write_outputs"]


def write_outputs(res: dict[str, Any], *, json_path: Path | None, markdown_path: Path | None,
                  render: Callable[[dict[str, Any]], str], log: Callable[[str], None]) -> None:
    """Writes the results ``res`` as JSON and their section (``render``) as markdown where
    asked, then logs each target's verdict and the run time (``res["meta"]``)."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(res, indent=1) + "\n")
    if markdown_path:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text(render(res))
    for t in res["targets"]:
        log(f"{status(t['met'])}: {t['target']}: {t['measured']}")
    log(f"total {res['meta']['runtime_s']:.0f} s")


def section_main(argv: list[str] | None, *, description: str, run: Callable[[Any], dict],
                 full: Any, quick: Any, render: Callable[[dict[str, Any]], str],
                 quick_help: str) -> dict[str, Any]:
    """The command line of a stand-alone section: ``[--quick] [--json PATH] [--markdown
    PATH]``; runs ``run(quick if --quick else full)``, writes and logs its results."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write the BENCHMARKS.md section here")
    args = parser.parse_args(argv)
    res = run(quick if args.quick else full)
    write_outputs(res, json_path=args.json, markdown_path=args.markdown, render=render,
                  log=print)
    return res
