"""The layout of the sp_jax package, read from its source (the AST of every module, no
import): no import circle, lower floors never import higher ones, measurement code
(``sp_jax.analysis``, ``sp_jax.plan``) is imported by no library module, and no module
uses another module's private (``_underscore``) names.

Every import counts: module-level, function-local and ``if TYPE_CHECKING:`` ones (a
circle of type hints is still a circle). That ``import sp_jax`` loads no measurement
code at run time is checked in a fresh interpreter by
``tests/test_docs.py::test_import_sp_jax_exposes_the_subpackages``.
"""

from __future__ import annotations

import ast
import functools
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sp_jax"

# Bottom to top (DEVELOPERS.md, "Layout"): a module may import its own floor and the
# floors below it. A name stands for the module and everything under it; the longest
# name that matches a module gives its floor.
FLOORS: list[tuple[str, ...]] = [
    ("sp_jax.config", "sp_jax.compat", "sp_jax._quiet", "sp_jax.xla_flags"),
    ("sp_jax.layout",),
    ("sp_jax.mesh",),
    ("sp_jax.ring",),
    ("sp_jax.ops",),
    ("sp_jax.attention",),
    ("sp_jax.layers",),
    ("sp_jax.models",),
    ("sp_jax.pipeline",),  # outside the model: it wraps the GPT (sp_jax.pipeline.gpt)
    ("sp_jax.training", "sp_jax.data", "sp_jax.checkpoint"),
    ("sp_jax",),  # the package itself: imports every floor
]
# Beside the floors: measurement, free to import any floor, imported by none of them.
MEASUREMENT = ("sp_jax.analysis", "sp_jax.plan")

# Private names of other packages used on purpose; (module, what): why.
ALLOWED_PRIVATE: dict[tuple[str, str], str] = {
    ("sp_jax._quiet", "jax._src.xla_bridge"):
        "plugin discovery and its logger, wrapped to filter the CUDA plugin's start-up "
        "lines (DEVELOPERS.md, start-up noise); no public hook",
    ("sp_jax.xla_flags", "jax._src.xla_bridge"):
        "backends_are_initialized: whether XLA_FLAGS can still take effect; no public "
        "accessor in jax 0.10",
    ("sp_jax.xla_flags", "xla_bridge._backends"):
        "the fallback of backends_are_initialized for older jax",
    ("sp_jax.training.faults", "jax._src.distributed"):
        "the coordination service's key-value store (the stop agreement without device "
        "collectives); no public accessor in jax 0.10",
    ("sp_jax.training.faults", "os._exit"):
        "documented: exit without waiting at jax.distributed's shutdown barrier after a "
        "peer died",
    ("sp_jax.ops.primitives", "jax._src.lax.parallel.all_gather_invariant"):
        "all_gather_invariant for a jax that does not export it from jax.lax yet",
    ("sp_jax.analysis.memory", "jax._src.ad_checkpoint.saved_residuals"):
        "saved_residuals: the listing behind jax.ad_checkpoint.print_saved_residuals "
        "(optional source column)",
    ("sp_jax.checkpoint.integrity", "x.sharding._device_assignment"):
        "the device order of an array's sharding (checksums per device set); falls back "
        "to device ids",
    ("sp_jax.checkpoint.at_exit", "threading._register_atexit"):
        "exit hooks that run while threads still work (an orbax async save cannot finish "
        "in atexit; DEVELOPERS.md, faults); falls back to atexit",
    ("sp_jax.training.cli", "parser._actions"):
        "argparse lists a parser's actions nowhere public (read only: known flags, one "
        "help text)",
}
# Named tuples' documented methods and fields.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}

# Cross-module private uses in modules being rewritten: to be removed from here as
# their modules change (never added to). (module, what): the public name to use.
PENDING_PRIVATE: dict[tuple[str, str], str] = {}


# -- reading the package ------------------------------------------------------------------


def _modules(folder: Path = PACKAGE) -> dict[str, Path]:
    """``{dotted module name: path}`` of every module under ``folder``."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _base(module: str, node: ast.ImportFrom) -> str:
    """The absolute name ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if MODULES[module].name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, int, str | None]]:
    """``(imported module, line, name or None)`` of every import in ``module`` (``name``:
    a name imported from that module, not itself a module)."""
    out = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    out.append((f"{base}.{a.name}", node.lineno, None))
                else:
                    out.append((base, node.lineno, a.name))
    return out


def _graph() -> dict[str, dict[str, int]]:
    """``{module: {imported sp_jax module: line}}``."""
    graph: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for module in MODULES:
        for target, line, _ in _imports(module):
            if target in MODULES and target != module:
                graph[module].setdefault(target, line)
    return graph


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _floor(module: str) -> int:
    best, floor = -1, -1
    for i, names in enumerate(FLOORS):
        for name in names:
            if _under(module, name) and len(name) > best:
                best, floor = len(name), i
    return floor


# -- imports ------------------------------------------------------------------------------


def test_the_floors_name_every_module():
    measurement = {m for m in MODULES if any(_under(m, p) for p in MEASUREMENT)}
    assert not [m for m in MODULES if m not in measurement and _floor(m) < 0]


def _circles(graph: dict[str, dict[str, int]]) -> list[str]:
    """The import circles of ``graph`` (``{module: {imported module: line}}``), each as
    ``a:line -> b:line -> ... -> a``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    circles = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circle = path[path.index(target):] + [target]
                circles.append(" -> ".join(f"{a}:{graph[a][b]}" for a, b in
                                           itertools.pairwise(circle)) + f" -> {target}")
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return circles


def test_no_import_circle():
    circles = _circles(_graph())
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_lower_floors_never_import_higher_ones():
    wrong = []
    for module, targets in _graph().items():
        if any(_under(module, p) for p in MEASUREMENT):
            continue
        for target, line in targets.items():
            if any(_under(target, p) for p in MEASUREMENT):
                wrong.append(f"{module}:{line} imports measurement code {target}")
            elif _floor(target) > _floor(module):
                wrong.append(f"{module}:{line} (floor {_floor(module)}) imports {target} "
                             f"(floor {_floor(target)})")
    assert not wrong, "\n".join(wrong)


# -- private names ------------------------------------------------------------------------


def _defined(tree: ast.Module) -> set[str]:
    """Every name a module binds: definitions, assignments (also to attributes),
    arguments and imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_aliases(module: str) -> dict[str, str]:
    """Local names bound to sp_jax modules (``import sp_jax.x as m``, ``from sp_jax
    import x``, ``import sp_jax``)."""
    out = {}
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "sp_jax":
                    out[a.asname or "sp_jax"] = a.name if a.asname else "sp_jax"
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def _private_uses(module: str) -> list[tuple[int, str]]:
    """``(line, what)`` of each use of another module's private name in ``module``."""
    tree, found = TREES[module], []
    defined, aliases = _defined(tree), _module_aliases(module)
    for target, line, name in _imports(module):
        parts = target.split(".")
        if any(_private(p) for p in parts) and parts[0] != "sp_jax":
            # another package's private module
            found.append((line, target if name is None else f"{target}.{name}"))
        elif name is not None and _private(name) and target != module:
            found.append((line, f"from {target} import {name}"))
    for node in ast.walk(tree):
        attr = None
        if isinstance(node, ast.Attribute):
            attr, value = node.attr, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            attr, value = node.args[1].value, node.args[0]
        if attr is None or not _private(attr) or attr in NAMEDTUPLE_API:
            continue
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue
        if isinstance(value, ast.Name) and value.id in aliases:  # module._name
            found.append((node.lineno, f"{aliases[value.id]}.{attr}"))
        elif attr not in defined:  # obj._name of a name this module does not define
            found.append((node.lineno, f"{ast.unparse(value)}.{attr}"))
    return found


def test_no_module_uses_another_modules_private_names():
    wrong = []
    for module in MODULES:
        for line, what in _private_uses(module):
            if (module, what) not in ALLOWED_PRIVATE | PENDING_PRIVATE.keys():
                wrong.append(f"{module}:{line}: {what}")
    assert not wrong, "private names used across modules:\n" + "\n".join(wrong)


def test_the_lists_of_private_uses_hold_no_stale_entry():
    """Each entry of ALLOWED_PRIVATE and PENDING_PRIVATE is still used where it says: a
    use that went away leaves the lists (PENDING_PRIVATE is to be emptied, never kept
    for nothing)."""
    used = {(module, what) for module in MODULES for _, what in _private_uses(module)}
    stale = sorted(set(ALLOWED_PRIVATE) - used) + sorted(set(PENDING_PRIVATE) - used)
    assert not stale, "entries no module needs any more:\n" + "\n".join(map(str, stale))


def test_the_private_name_check_finds_what_it_should():
    """The checks on a small made-up module: a private import, a module's private
    attribute and another object's private attribute are found; self, cls, dunder
    names, named tuples' methods and the module's own private names are not."""
    source = '''
import sp_jax.mesh as m
from sp_jax.models.gpt import _hidden
from jax._src import core
class A:
    _own = 1
    def f(self, other):
        return (self._x, m._private, other._embed, other._own, other.__dict__,
                other._replace(a=1), getattr(other, "_vocab_table"))
'''
    name = "sp_jax.models.made_up"
    MODULES[name], TREES[name] = PACKAGE / "models" / "made_up.py", ast.parse(source)
    try:
        found = {what for _, what in _private_uses(name)}
    finally:
        del MODULES[name], TREES[name]
    assert found == {"from sp_jax.models.gpt import _hidden", "jax._src.core",
                     "sp_jax.mesh._private",
                     "other._embed", "other._vocab_table"}


# -- outside the package: the tests and the benchmarks --------------------------------------

BENCHMARKS = ROOT / "benchmarks"
TESTS = ROOT / "tests"
RENDERING = ("benchmarks.render", "benchmarks.records")
"""What benchmarks/render/ may import of benchmarks/: itself and the shared records."""


def _imported_modules(path: Path) -> list[tuple[str, int]]:
    """``(module, line)`` of every import in ``path`` (function-local ones too), with
    ``from X import y`` read as ``X.y`` when that is a module of benchmarks/."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((sub if _benchmark_module(sub) else node.module, node.lineno))
    return out


@functools.cache
def _benchmark_modules() -> dict[str, Path]:
    return _modules(BENCHMARKS)


def _benchmark_module(name: str) -> bool:
    return name in _benchmark_modules()


def test_no_library_test_imports_benchmarks():
    """Library tests import no ``benchmarks`` module (what they share with the benchmarks
    lives in tests/_util.py or sp_jax.analysis); tests/test_benchmarks.py, the benchmarks'
    own tests, may."""
    wrong = [f"{path.name}:{line} imports {module}"
             for path in sorted(TESTS.glob("*.py")) if path.name != "test_benchmarks.py"
             for module, line in _imported_modules(path)
             if module == "benchmarks" or module.startswith("benchmarks.")]
    assert not wrong, "\n".join(wrong)


def test_benchmarks_have_no_import_circle():
    """benchmarks/ has no import circle, and its rendering (benchmarks/render/) imports
    no measuring module: the records and formatters both share live in
    benchmarks/records.py."""
    modules = _benchmark_modules()
    graph = {m: {t: line for t, line in _imported_modules(p) if t in modules and t != m}
             for m, p in modules.items()}
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(circles)
    wrong = [f"{m}:{line} imports {t}" for m, targets in graph.items()
             if _under(m, "benchmarks.render") for t, line in targets.items()
             if not any(_under(t, r) for r in RENDERING)]
    assert not wrong, "rendering imports measuring modules:\n" + "\n".join(wrong)
    assert not [t for t, _ in _imported_modules(BENCHMARKS / "records.py")
                if t.startswith(("benchmarks", "sp_jax", "jax"))]


# -- the pipeline outside the model -------------------------------------------------------

# The GPT's forwards: the pipeline calls them (sp_jax.pipeline.gpt wraps the model), so
# none of them refers to it.
GPT_FORWARDS = ("__call__", "loss", "hidden_states", "padded_logits", "embed_tokens",
                "run_blocks", "logits_from_hidden")


def _identifiers(node: ast.AST) -> set[str]:
    """Every name, attribute, argument and keyword a piece of code uses (not its
    docstrings or other strings)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.keyword) and n.arg:
            out.add(n.arg)
    return out


def test_no_forward_method_of_the_gpt_refers_to_the_pipeline():
    (gpt,) = [n for n in TREES["sp_jax.models.gpt"].body
              if isinstance(n, ast.ClassDef) and n.name == "GPT"]
    methods = {n.name: n for n in gpt.body if isinstance(n, ast.FunctionDef)}
    assert set(GPT_FORWARDS) <= set(methods)
    wrong = {name: sorted(i for i in _identifiers(methods[name])
                          if "pipeline" in i.lower() or "stage" in i.lower())
             for name in GPT_FORWARDS}
    assert not any(wrong.values()), wrong
    # and the model's floor never imports the pipeline (test_lower_floors_...)
    assert _floor("sp_jax.pipeline.gpt") > _floor("sp_jax.models.gpt")
