"""Imports flow one way: server -> metrics -> engine -> models/layers (docs/architecture.md).

Every module under fornax/ is parsed with `ast`, so every import counts: top-level ones,
those inside functions (lazy imports) and those under `if TYPE_CHECKING:` (a type-only
import is still a dependency of the design). A failure names each offending import by file
and line. A second check keeps the observers (server, metrics, router, cluster) reading the
engine through its API (EngineCore.stats(), .sequences(), ...) rather than its internals.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fornax"

# The packages that observe an engine, and what they may not read of an EngineCore: its
# scheduler, KV and per-sequence tables, runner and speculative controller, and anything private.
OBSERVERS = ("fornax.server", "fornax.metrics", "fornax.router", "fornax.cluster")

# Every unit of the tree (a package, or a module at the top of fornax/) and the units it may
# import directly, bottom to top (docs/architecture.md, Layering). A module of no unit here
# fails the suite: a new package takes its place in the table before it lands.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "fornax.config": (),
    "fornax.chat_template": (),
    "fornax.gguf_file": (),
    "fornax.flag_fields": (),  # the GGUF container: numpy and gguf, so the tokenizer loads no torch
    "fornax.tokenizer": ("fornax.chat_template", "fornax.gguf_file"),
    "fornax.bench": (),  # measures any OpenAI-compatible URL: nothing of the engine or server
    "fornax.layers": ("fornax.config",),
    "fornax.models": ("fornax.layers", "fornax.gguf_file", "fornax.config"),
    "fornax.engine_args": ("fornax.flag_fields", "fornax.layers", "fornax.config"),
    "fornax.server_args": ("fornax.engine_args", "fornax.flag_fields", "fornax.config"),
    "fornax.engine": ("fornax.models", "fornax.layers", "fornax.tokenizer", "fornax.config"),
    "fornax.tools": ("fornax.engine",),
    "fornax.quality": ("fornax.engine",),
    "fornax.request_output": ("fornax.engine", "fornax.tools"),
    "fornax.metrics": ("fornax.engine", "fornax.config"),
    "fornax.llm": (
        "fornax.request_output",
        "fornax.engine_args",
        "fornax.engine",
        "fornax.tools",
        "fornax.tokenizer",
        "fornax.config",
    ),
    "fornax": ("fornax.llm", "fornax.request_output", "fornax.engine"),  # the package's lazy re-exports
    "fornax.server": (
        "fornax",
        "fornax.metrics",
        "fornax.engine",
        "fornax.tools",
        "fornax.layers",
        "fornax.tokenizer",
        "fornax.config",
    ),
    "fornax.router": ("fornax", "fornax.server", "fornax.config"),
    "fornax.cluster": ("fornax.router", "fornax.server_args", "fornax.engine_args", "fornax.config"),
    "fornax.cli": (
        "fornax.cluster",
        "fornax.router",
        "fornax.server",
        "fornax.bench",
        "fornax.llm",
        "fornax.server_args",
        "fornax.engine_args",
        "fornax.engine",
        "fornax.models",
        "fornax.layers",
        "fornax.config",
    ),
}
# A process's main: it runs the CLI, so it stands above every unit whatever package holds it
# (`python -m fornax.router`, the cluster's replica process).
ENTRY_POINTS = {
    "fornax.router.__main__": ("fornax.cli",),
    "fornax.cluster.child": ("fornax.cli",),
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


def unit_of(module: str) -> str | None:
    """The table's unit that holds `module` (the longest entry it lies within), or None. The unit
    "fornax" is the package's own __init__: it holds no module but itself and its attributes
    (`from fornax import __version__`)."""
    if module in ENTRY_POINTS:
        return module
    units = [u for u in MAY_IMPORT if u != "fornax" and _within(module, u)]
    if units:
        return max(units, key=len)
    top = module == "fornax" or (module.count(".") == 1 and module not in _tree_modules())
    return "fornax" if top and _within(module, "fornax") else None


@functools.cache
def _tree_modules() -> frozenset[str]:
    return frozenset(m for m, _ in all_modules())


def layering_violations(imports: list[Import]) -> list[str]:
    """Each fornax import from one unit into another that the table does not allow."""
    allowed = {**MAY_IMPORT, **ENTRY_POINTS}
    bad = []
    for imp in imports:
        if not _within(imp.target, "fornax"):
            continue
        source, target = unit_of(imp.module), unit_of(imp.target)
        if source is None or target is None:
            bad.append(f"{imp}  (not in the layering table)")
        elif source != target and target not in allowed[source]:
            bad.append(
                f"{imp}  ({source} may import only {', '.join(allowed[source]) or 'nothing of fornax'})"
            )
    return bad


def table_cycle(table: dict[str, tuple[str, ...]]) -> list[str] | None:
    """A cycle among the table's units, or None: the table itself must only point down."""
    graph = {unit: set(deps) for unit, deps in table.items()}
    for unit in graph:
        path = _reaches(graph, unit, unit)
        if path is not None:
            return path
    return None


def test_every_module_has_a_place_in_the_layering():
    unplaced = [m for m, _ in all_modules() if unit_of(m) is None]
    assert not unplaced, "modules of no unit in MAY_IMPORT: " + ", ".join(unplaced)


def test_the_layering_table_has_no_cycle():
    path = table_cycle(MAY_IMPORT)
    assert path is None, "the table allows a cycle: " + " -> ".join(path or [])
    assert all(dep in MAY_IMPORT for deps in MAY_IMPORT.values() for dep in deps)


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


@pytest.mark.parametrize(
    "module",
    [
        "fornax.engine.event_tap",
        "fornax.engine.events",
        "fornax.engine.stats",
        "fornax.engine.memory_report",
        "fornax.engine.spec_decode.controller",
        "fornax.engine.spec_decode.draft_model",
        "fornax.engine.spec_decode.self_draft",
        "fornax.engine.spec_decode.ngram",
    ],
)
def test_what_the_core_hands_its_state_to_never_imports_the_core(module):
    """The event tap reads the core through a narrow view (event_tap.EngineView), the memory
    breakdown is given the runner, the proposers are asked for drafts by the controller the
    core holds: core.py imports them, never the other way round."""
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
        (2, "c.scheduler"),
        (4, "x.seqs"),
        (5, "engine.core.last_step"),
        (6, "core._pending"),
    ]


# Back-imports the tree once had or invites, each written into a module of the importing unit:
# the scan must refuse every one (the arrows of docs/architecture.md, Layering).
BACK_IMPORTS = [
    ("fornax.cluster.cli", "from fornax.cli import build_parser"),  # the cluster borrowed serve's flags
    ("fornax.tokenizer", "from fornax.models.loader import read_gguf"),  # torch for a tokenizer
    ("fornax.layers.linear", "from fornax.models.base import KVCache"),
    ("fornax.models.llama", "from fornax.engine.spec_decode import TargetInfo"),
    ("fornax.models.llama", "from fornax.tools import ToolCall"),
    ("fornax.engine.core", "from fornax.server.app import serve"),
    ("fornax.engine.core", "from fornax.llm import LLM"),
    ("fornax.engine.core", "from fornax.tools.calls import parse_tool_calls"),
    ("fornax.metrics.live", "from fornax.server.state import RequestRecord"),
    ("fornax.bench.client", "import fornax.engine"),
    ("fornax.config", "from fornax.engine.request import SamplingParams"),
    ("fornax.router.core", "from fornax.cluster import controller"),
    ("fornax.server.app", "from fornax.cli import main"),
    ("fornax.engine_args", "from fornax.server_args import ServerArgs"),
]


@pytest.mark.parametrize(("module", "line"), BACK_IMPORTS)
def test_an_injected_back_import_fails_the_layering(module: str, line: str) -> None:
    source = "from __future__ import annotations\n" + line + "\n"
    bad = layering_violations(imports_of(source, module, module.replace(".", "/") + ".py"))
    assert len(bad) == 1 and ":2:" in bad[0], bad


def test_a_module_outside_the_table_and_a_cyclic_table_are_refused() -> None:
    bad = layering_violations(
        imports_of("import fornax.engine\n", "fornax.newpkg.mod", "fornax/newpkg/mod.py")
    )
    assert bad and "not in the layering table" in bad[0]
    assert (
        unit_of("fornax.newpkg.mod") is None and unit_of("fornax.engine.spec_decode.ngram") == "fornax.engine"
    )
    assert table_cycle({"a": ("b",), "b": ("c",), "c": ("a",)}) == ["a", "b", "c", "a"]
    assert table_cycle({"a": ("b",), "b": (), "c": ("a", "b")}) is None


# -- environment variables are read in config/environment.py only (docs/architecture.md, rule 4) --


def environment_reads(source: str) -> list[int]:
    """Lines that read one environment variable: os.environ[...], os.environ.get(...),
    os.getenv(...), `... in os.environ`. Copying the whole environment for a child process
    (`{**os.environ}`) reads no variable of its own."""

    def is_environ(node: ast.expr) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            out.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if (node.func.attr in ("get", "pop", "setdefault") and is_environ(node.func.value)) or (
                node.func.attr == "getenv"
            ):
                out.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            out.append(node.lineno)
    return sorted(set(out))


def test_environment_variables_are_read_in_one_module():
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for module, path in all_modules()
        if module != "fornax.config.environment"
        for line in environment_reads(path.read_text())
    ]
    assert not bad, "environment reads outside fornax/config/environment.py: " + ", ".join(bad)
    probe = (
        'import os\na = os.environ["A"]\nb = os.environ.get("B")\nc = os.getenv("C")\nd = "D" in os.environ\n'
    )
    assert environment_reads(probe + "env = {**os.environ}\n") == [2, 3, 4, 5]


# -- small modules (docs/architecture.md, rule 9) --

MAX_LINES = 500
# The native kernels and their loader belong to the kernel work: measured code, kept whole.
SIZE_EXEMPT = ("fornax/layers/kernels/", "fornax/layers/native.py")


def test_modules_stay_small_or_say_why():
    """A module over MAX_LINES says why in its docstring ("Over 500 lines: ...")."""
    long = []
    for _module, path in all_modules():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if text.count("\n") <= MAX_LINES or rel.startswith(SIZE_EXEMPT):
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if "Over 500 lines:" not in doc:
            long.append(f"{rel} ({text.count(chr(10))} lines)")
    assert not long, "modules over 500 lines that do not say why: " + ", ".join(long)
