"""Colonnade's packages import one way: down the layer order, with no package-level cycle.

The order enforced (bottom first; a module may import its own layer or any layer below it):

    device, eager, gelu < config < parallel < tensor_parallel < context_parallel < moe < models
    < pipeline < data_parallel < optim < checkpoint < reliability < data < training < analysis
    < top-level modules (cli, bench, generate, hf_export, launch, plot, train) < fuzz

``device.py`` is the one module that may touch ``torch.cuda`` and sits at the bottom (``parallel``
and ``pipeline`` ask it for the device), beside ``eager.py`` (functions ``torch.compile`` never
traces, used by ``context_parallel``, ``moe`` and ``models``) and ``gelu.py`` (GPT-2's GELU,
used by ``moe`` and ``models``). ``checkpoint`` sits below ``reliability`` because the NaN
and interrupt paths save through it. ``data`` sits above the layers because its vocab padding
comes from ``tensor_parallel``. This differs from ``../shared/DESIGN.md`` only by naming
``device``, ``eager``, ``gelu`` and the top-level modules and by putting ``data`` where its
imports put it.

Every ``import`` and ``from ... import`` of ``colonnade.*`` counts, at module level AND inside
functions (a function-level import is a dependency too; it only hides the cycle). ``ALLOWED``
lists the known exceptions, each with the reason it is still there; it shrinks to empty.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "colonnade"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("device", "eager", "gelu"),
    ("config",),
    ("parallel",),
    ("tensor_parallel",),
    ("context_parallel",),
    ("moe",),
    ("models",),
    ("pipeline",),
    ("data_parallel",),
    ("optim",),
    ("checkpoint",),
    ("reliability",),
    ("data",),
    ("training",),
    ("analysis",),
    ("cli", "bench", "generate", "hf_export", "launch", "plot", "train", "__init__"),
    ("fuzz",),
)

# (importing module, imported module) pairs that still break the order, each with its reason.
# Empty: every upward import found when this test was written has been moved away.
ALLOWED: dict[tuple[str, str], str] = {}


def _module_name(path: Path, root: Path = PACKAGE_ROOT) -> str:
    """``colonnade/a/b.py`` -> ``colonnade.a.b``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, root: Path = PACKAGE_ROOT) -> list[str]:
    """Every ``colonnade.*`` module that ``path`` imports, anywhere in the file (absolute names)."""
    module = _module_name(path, root)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                imported = ".".join(base + ([node.module] if node.module else []))
            else:
                imported = node.module or ""
            for alias in node.names:  # `from colonnade import device` imports colonnade.device
                sub = Path(root.parent, *f"{imported}.{alias.name}".split("."))
                is_module = sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file()
                found.append(f"{imported}.{alias.name}" if is_module else imported)
    return [name for name in found if name == "colonnade" or name.startswith("colonnade.")]


def _unit(module: str) -> str:
    """The layering unit of a module: its sub-package, or the top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _edges() -> list[tuple[str, str]]:
    """(importer, imported) module pairs across units, over every file of the package."""
    edges: list[tuple[str, str]] = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        importer = _module_name(path)
        edges += [(importer, imported) for imported in _imports(path)
                  if _unit(imported) != _unit(importer)]
    return edges


def _layer_of() -> dict[str, int]:
    return {unit: level for level, units in enumerate(LAYERS) for unit in units}


def test_every_unit_has_a_layer() -> None:
    """A new package or top-level module must be placed in LAYERS before it can be imported."""
    units = {_unit(_module_name(path)) for path in PACKAGE_ROOT.rglob("*.py")}
    missing = sorted(units - set(_layer_of()))
    assert missing == [], f"add {missing} to LAYERS in tests/test_layering.py"


def test_imports_point_down() -> None:
    """No module imports a unit above its own layer, except the pairs listed in ALLOWED."""
    layer = _layer_of()
    upward = sorted({(a, b) for a, b in _edges()
                     if layer.get(_unit(b), -1) > layer.get(_unit(a), -1)})
    assert [pair for pair in upward if pair not in ALLOWED] == [], "imports that point up"
    stale = sorted(set(ALLOWED) - set(upward))
    assert stale == [], f"fixed, remove from ALLOWED: {stale}"


def test_no_package_cycle() -> None:
    """The unit graph without ALLOWED edges has no cycle (depth-first search: no back edge).

    Across layers the order already rules a cycle out; this catches one inside a layer (the
    top-level modules, analysis).
    """
    graph: dict[str, set[str]] = {}
    for a, b in _edges():
        if (a, b) in ALLOWED:
            continue
        graph.setdefault(_unit(a), set()).add(_unit(b))
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(unit: str, path: list[str]) -> list[str]:
        state[unit] = 1
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                return [*path, unit, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, unit])):
                return cycle
        state[unit] = 2
        return []

    cycles = [c for unit in sorted(graph) if unit not in state and (c := visit(unit, []))]
    assert cycles == [], f"package cycle: {' -> '.join(cycles[0]) if cycles else ''}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node (each one is a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_module_cycle() -> None:
    """No cycle among modules either, type-checking-only imports included (a cycle hidden in
    ``if TYPE_CHECKING`` or in a function is still two modules that cannot be read apart)."""
    paths = sorted(PACKAGE_ROOT.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    graph = {_module_name(path): {m for m in _imports(path) if m in modules} - {_module_name(path)}
             for path in paths}
    assert _strongly_connected(graph) == []
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]]


def test_the_walker_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    """The walker is what the other tests rest on: it must see imports hidden in functions."""
    root = tmp_path / "colonnade"
    (root / "models").mkdir(parents=True)
    source = root / "models" / "gpt.py"
    source.write_text(
        "import os\n"
        "from colonnade.config import sections\n"
        "from . import blocks\n"
        "from colonnade import device\n"
        "from ..pipeline.plan import StepPlan\n"
        "def f() -> None:\n"
        "    if True:\n"
        "        import colonnade.training.step\n"
        "class C:\n"
        "    def g(self) -> None:\n"
        "        from colonnade.data import tokenizer\n")
    (root / "device.py").write_text("")
    assert sorted(_imports(source, root)) == [
        "colonnade.config", "colonnade.data", "colonnade.device", "colonnade.models",
        "colonnade.pipeline.plan", "colonnade.training.step"]
    assert _module_name(root / "models" / "__init__.py", root) == "colonnade.models"
    assert _unit("colonnade.cli") == "cli" and _unit("colonnade.models.gpt") == "models"
    assert _unit("colonnade") == "__init__"


def test_the_library_edits_no_import_path() -> None:
    """No module of the package touches ``sys.path``: the tests' conftest and the benchmark
    scripts put the repo root on the path themselves (the rank pool used to do it for them)."""
    offenders = sorted(
        f"{_module_name(path)}:{node.lineno}"
        for path in PACKAGE_ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "path"
        and isinstance(node.value, ast.Name) and node.value.id == "sys")
    assert offenders == [], f"sys.path used in the library: {offenders}"
