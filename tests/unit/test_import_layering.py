"""Imports flow one way: server -> metrics -> engine -> models/layers (docs/architecture.md).

Every module under fornax/ is parsed with `ast`, so every import counts: top-level ones,
those inside functions (lazy imports) and those under `if TYPE_CHECKING:` (a type-only
import is still a dependency of the design). A failure names each offending import by file
and line. A second check keeps the observers (server, metrics, router, cluster) reading the
engine through its API (EngineCore.stats(), .sequences(), ...) rather than its internals.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fornax"

# The packages that observe an engine, and what they may not read of an EngineCore: its
# scheduler, KV and per-sequence tables, runner and speculative controller, and anything private.
OBSERVERS = ("fornax.server", "fornax.metrics", "fornax.router", "fornax.cluster")
# package -> the packages it must never import
FORBIDDEN = {
    "fornax.engine": (*OBSERVERS, "fornax.bench"),
    "fornax.models": (*OBSERVERS, "fornax.bench", "fornax.engine"),
    "fornax.layers": (*OBSERVERS, "fornax.bench", "fornax.engine"),
    "fornax.metrics": ("fornax.server", "fornax.router", "fornax.cluster"),
    # The benchmark client measures any OpenAI-compatible URL: nothing of the engine or server.
    "fornax.bench": ("fornax.engine", "fornax.models", "fornax.layers", "fornax.server", "fornax.metrics"),
}
CORE_INTERNALS = frozenset({"scheduler", "seqs", "children", "held", "last_step", "runner", "spec"})


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. fornax.engine.core
    path: str  # its file, relative to the repository
    line: int
    target: str  # the imported module (or module.name, for `from module import name`)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module} imports {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, path: str, is_package: bool = False) -> list[Import]:
    """Every import in `source`, wherever it stands (module body, function, TYPE_CHECKING block)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [Import(module, path, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing module's package
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from fornax.engine import core` imports a module: record fornax.engine.core too.
            out += [Import(module, path, node.lineno, f"{origin}.{alias.name}") for alias in node.names]
    return out


def _within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def all_modules() -> list[tuple[str, Path]]:
    return sorted((module_name(p), p) for p in PACKAGE.rglob("*.py") if "vendor" not in p.parts)


def all_imports() -> list[Import]:
    out = []
    for module, path in all_modules():
        rel = str(path.relative_to(ROOT))
        out += imports_of(path.read_text(), module, rel, is_package=path.name == "__init__.py")
    return out


def layering_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        for package, forbidden in FORBIDDEN.items():
            if not _within(imp.module, package):
                continue
            for other in forbidden:
                if _within(imp.target, other):
                    bad.append(f"{imp}  ({package} must not import {other})")
    return bad


def test_packages_import_only_downwards():
    bad = layering_violations(all_imports())
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def _graph(imports: list[Import]) -> dict[str, set[str]]:
    """Module -> the fornax modules it imports (`from pkg import name` counts as pkg.name when
    that is a module, else as pkg)."""
    modules = {m for m, _ in all_modules()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        target = imp.target if imp.target in modules else imp.target.rpartition(".")[0]
        if target in modules and target != imp.module:
            graph[imp.module].add(target)
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A path of imports from `start` to `goal`, or None."""
    stack, seen = [[start]], {start}
    while stack:
        path = stack.pop()
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == goal:
                return [*path, nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append([*path, nxt])
    return None


@pytest.mark.parametrize("module", ["fornax.engine.event_tap", "fornax.engine.events", "fornax.engine.stats",
                                    "fornax.engine.memory"])  # fmt: skip
def test_what_the_core_hands_its_state_to_never_imports_the_core(module):
    """The event tap reads the core through a narrow view (event_tap.EngineView), the memory
    breakdown is given the runner: core.py imports them, never the other way round."""
    graph = _graph(all_imports())
    assert "fornax.engine.event_tap" in graph["fornax.engine.core"]
    path = _reaches(graph, module, "fornax.engine.core")
    assert path is None, "import cycle with the core: " + " -> ".join(path or [])


# -- the observers read the engine through its API --


def _is_engine_core_annotation(node: ast.expr | None) -> bool:
    if node is None:
        return False
    text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ast.unparse(node)
    return text.split("|")[0].strip().rpartition(".")[2] == "EngineCore"


def core_internal_reads(source: str) -> list[tuple[int, str]]:
    """(line, expression) for each read of an EngineCore internal. An expression is taken for an
    engine core when it is the name `core`, ends in `.core` (AsyncEngine.core), is a parameter
    annotated EngineCore, is the parameter of a function handed to `AsyncEngine.call` (which
    runs it with the core), or a name assigned from one of these."""
    tree = ast.parse(source)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names = {"core"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            names |= {a.arg for a in args if _is_engine_core_annotation(a.annotation)}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call":
            for arg in node.args[:1]:
                fn = functions.get(arg.id) if isinstance(arg, ast.Name) else arg
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    params = fn.args.posonlyargs + fn.args.args
                    names |= {params[0].arg} if params else set()

    def is_core(expr: ast.expr) -> bool:
        return (isinstance(expr, ast.Name) and expr.id in names) or (
            isinstance(expr, ast.Attribute) and expr.attr == "core"
        )

    for node in ast.walk(tree):  # aliases: `c = engine.core`
        if isinstance(node, ast.Assign) and is_core(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not is_core(node.value):
            continue
        if node.attr in CORE_INTERNALS or node.attr.startswith("_"):
            out.append((node.lineno, ast.unparse(node)))
    return sorted(set(out))


def test_observers_read_the_engine_through_its_api():
    bad = []
    for module, path in all_modules():
        if any(_within(module, p) for p in OBSERVERS):
            rel = path.relative_to(ROOT)
            bad += [f"{rel}:{line}: {expr}" for line, expr in core_internal_reads(path.read_text())]
    why = "reads of EngineCore internals (use EngineCore.stats(), .sequences(), ...):\n"
    assert not bad, why + "\n".join(bad)


# -- the checks themselves find what they look for --


def test_the_import_scan_sees_lazy_and_type_only_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from fornax.server.state import RequestRecord\n"
        "def f():\n"
        "    import fornax.router.core\n"
        "    from ..server import app\n"
    )
    found = imports_of(source, "fornax.metrics.live", "fornax/metrics/live.py")
    bad = layering_violations(found)
    assert [b.split(":")[1] for b in bad] == ["3", "5", "6"], bad
    assert "fornax.server.app" in bad[2]


def test_the_internals_scan_finds_reads_and_spares_other_objects():
    source = (
        "def snapshot(c: 'EngineCore'):\n"
        "    return c.scheduler.num_running\n"
        "async def live(engine):\n"
        "    await engine.call(lambda x: x.seqs)\n"
        "    engine.core.last_step\n"
        "    node.children, config.scheduler, core.stats(), core._pending\n"
    )
    assert core_internal_reads(source) == [
        (2, "c.scheduler"), (4, "x.seqs"), (5, "engine.core.last_step"), (6, "core._pending"),
    ]  # fmt: skip
