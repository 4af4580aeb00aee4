"""The package import graph of ``cluster/`` and ``deployments/`` has no cycles and follows the
declared layer order: a package imports only packages on floors below its own.

Every module is parsed with ``ast``: top-level, function-level and ``TYPE_CHECKING`` imports
count alike, as does ``importlib.import_module`` with a literal (or f-string) module name — a lazy
import still ties the two packages together. A package is ``cluster.<name>`` (a subpackage or a
top-level module such as ``cluster.cli``) or ``deployments``. A failure prints each offending
import as ``file:line``.

Ignores: imports of anything outside the two trees (torch, grpc, ray, ...).
"""
from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("cluster", "deployments")

# Floors, bottom first. A package may import packages on lower floors only (never its own floor,
# never above). A new package must be placed here before its imports are accepted.
LAYERS: list[set[str]] = [
    {"cluster", "cluster.common"},  # request/output types, errors, configs, segment labels
    {"cluster.kernels", "cluster.sampling", "cluster.telemetry", "cluster.routing"},
    {"cluster.models"},  # forward passes, runners over the block KV cache, loading
    {"cluster.speculative"},  # drafters, rejection sampler, adaptive K, gates
    {"cluster.engine", "cluster.training"},  # the step (scheduler, speculation phase, async/process engines); draft-head training
    {"cluster.api"},  # gRPC / OpenAI request validation and responses
    {"cluster.kvsync"},  # the remote drafter protocol (client, server)
    {"deployments"},  # Ray Serve deployments and the local service
    {"cluster.bench"},
    {"cluster.mapper"},
    {"cluster.commands"},
    {"cluster.cli"},
]


@dataclass(frozen=True, slots=True)
class Edge:
    src: str  # importing package
    dst: str  # imported package
    where: str  # file:line
    module: str  # the module named by the import

    def __str__(self) -> str:
        return f"{self.where}: {self.src} -> {self.module}"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str, trees: tuple[str, ...] = TREES) -> str | None:
    parts = module.split(".")
    if parts[0] not in trees:
        return None
    if parts[0] == "deployments":
        return "deployments"
    return ".".join(parts[:2])


def _is_module(root: Path, module: str) -> bool:
    path = root.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _dynamic_module(call: ast.Call) -> str | None:
    """The module of ``importlib.import_module("x.y")`` / ``import_module(f"x.{name}")``: for an
    f-string, its leading literal up to the last dot."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name != "import_module" or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rpartition(".")[0] or None
    return None


def imported_modules(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in one file, relative imports resolved."""
    me = module_name(root, path)
    base = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - (node.level - 1)]
                module = ".".join(prefix + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:  # `from pkg import submodule` names the submodule
                sub = f"{module}.{alias.name}"
                found.append((node.lineno, sub if _is_module(root, sub) else module))
        elif isinstance(node, ast.Call):
            module = _dynamic_module(node)
            if module:
                found.append((node.lineno, module))
    return found


def import_edges(root: Path, trees: tuple[str, ...] = TREES) -> list[Edge]:
    edges = []
    for tree in trees:
        for path in sorted((root / tree).rglob("*.py")):
            src = package_of(module_name(root, path), trees)
            for line, module in imported_modules(root, path):
                dst = package_of(module, trees)
                if dst is not None and dst != src:
                    edges.append(Edge(src, dst, f"{path.relative_to(root)}:{line}", module))
    return edges


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One cycle (as the edges along it) per strongly connected component of packages."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.src, {}).setdefault(e.dst, e)
        graph.setdefault(e.dst, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for comp in components:  # walk inside the component from its first node back to it
        members, start = set(comp), min(comp)
        path, seen, node = [], {start}, start
        while True:
            nxt = next((w for w in sorted(graph[node]) if w in members and (w == start or w not in seen)),
                       None)
            if nxt is None:  # dead end inside the component: restart from a node on the way
                nxt = next(w for w in sorted(graph[node]) if w in members)
            path.append(graph[node][nxt])
            if nxt == start:
                break
            seen.add(nxt)
            node = nxt
        cycles.append(path)
    return cycles


def layer_violations(edges: list[Edge], layers: list[set[str]]) -> list[str]:
    floor = {pkg: i for i, members in enumerate(layers) for pkg in members}
    problems = []
    for pkg in sorted({e.src for e in edges} | {e.dst for e in edges}):
        if pkg not in floor:
            problems.append(f"{pkg}: not placed in LAYERS")
    for e in edges:
        if e.src in floor and e.dst in floor and floor[e.dst] >= floor[e.src]:
            problems.append(f"{e} (floor {floor[e.src]} imports floor {floor[e.dst]})")
    return problems


def _describe(cycle: list[Edge]) -> str:
    return " -> ".join([cycle[0].src] + [e.dst for e in cycle]) + "".join(f"\n    {e}" for e in cycle)


def test_packages_import_without_cycles():
    cycles = find_cycles(import_edges(ROOT))
    assert not cycles, "package import cycles:\n" + "\n".join(_describe(c) for c in cycles)


def test_packages_follow_the_layer_order():
    problems = layer_violations(import_edges(ROOT), LAYERS)
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


def test_every_package_is_placed_once():
    placed = [pkg for members in LAYERS for pkg in members]
    assert len(placed) == len(set(placed))
    found = {package_of(module_name(ROOT, p)) for tree in TREES for p in (ROOT / tree).rglob("*.py")}
    assert found == set(placed), (sorted(found - set(placed)), sorted(set(placed) - found))


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_synthetic_cycle_and_upward_import_are_reported(tmp_path):
    # low imports high only inside a function (a lazy import is an edge all the same); high
    # imports low through a relative import; mid names a module by importlib.
    _write(tmp_path, {
        "cluster/__init__.py": "",
        "cluster/low/__init__.py": "",
        "cluster/low/a.py": """\
            def f():
                from cluster.high import b
                return b
            """,
        "cluster/high/__init__.py": "",
        "cluster/high/b.py": "from ..low import a\n",
        "cluster/mid.py": """\
            import importlib
            importlib.import_module(f"cluster.low.{'a'}")
            """,
    })
    edges = import_edges(tmp_path, ("cluster",))
    assert {(e.src, e.dst, e.where) for e in edges} == {
        ("cluster.low", "cluster.high", "cluster/low/a.py:2"),
        ("cluster.high", "cluster.low", "cluster/high/b.py:1"),
        ("cluster.mid", "cluster.low", "cluster/mid.py:2"),
    }
    cycles = find_cycles(edges)
    assert len(cycles) == 1
    assert {e.src for e in cycles[0]} == {"cluster.low", "cluster.high"}
    assert "cluster/low/a.py:2" in _describe(cycles[0])
    problems = layer_violations(edges, [{"cluster.low"}, {"cluster.high"}, {"cluster.mid"}])
    assert problems == ["cluster/low/a.py:2: cluster.low -> cluster.high.b (floor 0 imports floor 1)"]
    assert layer_violations(edges, [{"cluster.high"}, {"cluster.low"}]) == [
        "cluster.mid: not placed in LAYERS",
        "cluster/high/b.py:1: cluster.high -> cluster.low.a (floor 0 imports floor 1)",
    ]


def test_an_acyclic_graph_has_no_cycles(tmp_path):
    _write(tmp_path, {
        "cluster/__init__.py": "",
        "cluster/low.py": "",
        "cluster/high.py": "from cluster import low\n",
    })
    edges = import_edges(tmp_path, ("cluster",))
    assert [(e.src, e.dst) for e in edges] == [("cluster.high", "cluster.low")]
    assert find_cycles(edges) == []
