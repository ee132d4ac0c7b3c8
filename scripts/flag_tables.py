"""Regenerates the flag tables of docs/training.md from the example scripts' parsers.

    python scripts/flag_tables.py            # rewrites the tables in docs/training.md
    python scripts/flag_tables.py --check    # exit 1 (naming the script) where they differ

Each table sits between ``<!-- flags: examples/NAME.py -->`` and ``<!-- /flags -->`` in
docs/training.md and is :func:`sp_jax.training.cli.markdown_flags` of that script's
parser: one row per flag, in ``--help``'s order, its help text as the meaning. The parser
is the example's ``build_parser()`` when it has one, else the one its ``parse(argv)``
builds (taken at its ``parse_args`` call, before anything is parsed or checked).
tests/test_docs.py::test_flag_tables_are_the_parsers checks that the tables agree.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "training.md"
SCRIPTS = ("examples/train_gpt.py", "examples/finetune_hf.py")
"""The scripts whose flags docs/training.md lists, each in its own marked table."""

_BLOCK = re.compile(r"(<!-- flags: (?P<script>[\w/.]+) -->\n)(?P<table>.*?)(<!-- /flags -->)",
                    re.S)


class _Parser(Exception):
    """Carries the parser out of an example's ``parse``."""


def parser_of(script: str) -> argparse.ArgumentParser:
    """The argument parser of ``script`` (a path from the repository root)."""
    path = ROOT / script
    spec = importlib.util.spec_from_file_location(f"_flags_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "build_parser"):
        return module.build_parser()

    def capture(self, *args, **kwargs):
        raise _Parser(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        module.parse([])
    except _Parser as e:
        return e.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    raise RuntimeError(f"{script}: parse() built no ArgumentParser")


def render(text: str) -> str:
    """``text`` (docs/training.md) with every marked table regenerated."""
    from sp_jax.training.cli import markdown_flags

    def table(match: re.Match) -> str:
        return match.group(1) + markdown_flags(parser_of(match.group("script"))) + \
            match.group(4)

    return _BLOCK.sub(table, text)


def tables(text: str) -> dict[str, str]:
    """Script -> the table docs/training.md shows for it."""
    return {m.group("script"): m.group("table") for m in _BLOCK.finditer(text)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true",
                   help="compare only: exit 1 naming each script whose table differs")
    args = p.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    missing = [s for s in SCRIPTS if s not in tables(text)]
    if missing:
        print(f"{DOC}: no marked table for {missing} (<!-- flags: SCRIPT --> ... "
              "<!-- /flags -->)", file=sys.stderr)
        return 1
    if args.check:
        old, want = tables(text), tables(new)
        stale = [s for s in old if old[s] != want[s]]
        if stale:
            print(f"{DOC}: the flag tables of {stale} differ from the parsers; run "
                  "python scripts/flag_tables.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        DOC.write_text(new)
        print(f"rewrote the flag tables of {DOC}")
    return 0


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
