"""The one way prose reaches ``BENCHMARKS.md``: fragments of ``benchmarks/templates/*.md``
filled with values (:class:`string.Template`: ``$name`` / ``${name}``, ``$$`` for a
dollar sign), and markdown tables from rows of data.

A template file holds named fragments, each opened by a line ``@@ name``; a fragment is
the text up to the next such line, without its last newline."""

from __future__ import annotations

import functools
import string
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["TEMPLATES", "fields", "fill", "filler", "fragments", "table"]

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


@functools.cache
def fragments(name: str) -> dict[str, string.Template]:
    """The fragments of ``benchmarks/templates/<name>.md`` by name."""
    out: dict[str, list[str]] = {}
    current: list[str] = []
    text = (TEMPLATES / f"{name}.md").read_text().removesuffix("\n")
    for line in text.split("\n"):
        if line.startswith("@@ "):
            current = out.setdefault(line[3:].strip(), [])
        else:
            current.append(line)
    return {k: string.Template("\n".join(v)) for k, v in out.items()}


def fill(name: str, fragment: str, /, **values: Any) -> str:
    """Fragment ``fragment`` of template file ``name`` with ``values`` substituted (every
    placeholder must have a value)."""
    return fragments(name)[fragment].substitute(values)


def filler(name: str) -> Callable[..., str]:
    """:func:`fill` for the fragments of template file ``name``: ``filler(name)(fragment,
    **values)``."""
    return functools.partial(fill, name)


def fields(d: Mapping[str, Any], *keys: str, **renamed: str) -> dict[str, Any]:
    """Values of ``d`` for a fragment's placeholders: ``keys`` under their own names,
    ``renamed`` as ``placeholder=key``."""
    return {k: d[k] for k in keys} | {name: d[k] for name, k in renamed.items()}


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table of ``rows`` under ``header``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
