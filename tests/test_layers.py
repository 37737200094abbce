"""The floor order of the package's folders (``docs/architecture.md``, section "Floors").

Every module's imports, function-level ones included, are parsed with ``ast``: a folder (or
top-level module) imports only its own floor or floors below, the folders' import graph has no
cycle, and the entry points never reach into the worker.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pagedllm"
FACADE = "__init__"  # pagedllm/__init__.py: its public names resolve lazily (PEP 562), not by import


def floors() -> list[list[str]]:
    """The floors, bottom first, from the architecture page's fenced block (top first there)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"^## Floors\n.*?^```\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/architecture.md has no fenced block under '## Floors'"
    lines = [line.split(":")[0] for line in block.group(1).splitlines() if line.strip()]
    return [[unit.strip() for unit in line.split(",")] for line in reversed(lines)]


def unit_of(parts: tuple[str, ...]) -> str | None:
    """The folder or top-level module a dotted ``pagedllm...`` name belongs to; None for the facade."""
    if len(parts) < 2:
        return None
    return parts[1]


def module_name(path: Path, root: Path = ROOT) -> tuple[str, ...]:
    parts = path.relative_to(root).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[tuple[str, ...], int]]:
    """Every ``pagedllm`` module ``path`` imports (at any depth of the file), with its line."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(tuple(a.name.split(".")), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = tuple(node.module.split(".")) if node.module else ()
            if node.level:
                base = package[:len(package) - node.level + 1] + base
            if node.module is None or base == ("pagedllm",):  # `from . import y`, `from pagedllm import envs`
                found += [(base + (a.name,), node.lineno) for a in node.names]
            else:
                found.append((base, node.lineno))
    return [(mod, line) for mod, line in found if mod[0] == "pagedllm"]


def units_on_disk() -> set[str]:
    return {FACADE} | {p.stem for p in PACKAGE.iterdir()
                       if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}


def unit_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) unit pairs across units, with where each import is."""
    units = units_on_disk()
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = unit_of(module_name(path)) or FACADE
        for mod, line in imported_modules(path):
            dst = unit_of(mod)
            dst = dst if dst in units else FACADE  # `from pagedllm import LLM`: the facade
            if dst != src:
                edges.setdefault((src, dst), []).append(f"{path.relative_to(ROOT)}:{line}")
    return edges


def test_every_unit_has_exactly_one_floor():
    listed = [unit for floor in floors() for unit in floor]
    assert len(listed) == len(set(listed)), "a unit is listed on two floors"
    assert set(listed) == units_on_disk()


def test_no_folder_imports_a_floor_above_it():
    level = {unit: i for i, floor in enumerate(floors()) for unit in floor}
    upward = {f"{src} -> {dst}": where for (src, dst), where in unit_edges().items() if level[dst] > level[src]}
    assert upward == {}


def test_no_import_cycle_between_folders():
    graph: dict[str, set[str]] = {}
    for src, dst in unit_edges():
        graph.setdefault(src, set()).add(dst)
    done: set[str] = set()

    def visit(unit: str, path: list[str]) -> None:
        assert unit not in path, "import cycle: " + " -> ".join(path[path.index(unit):] + [unit])
        if unit in done:
            return
        for dst in sorted(graph.get(unit, ())):
            visit(dst, path + [unit])
        done.add(unit)

    for unit in sorted(graph):
        visit(unit, [])


def test_entry_points_never_import_the_worker():
    reaches = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((PACKAGE / "entrypoints").rglob("*.py"))
               for mod, line in imported_modules(path) if mod[:2] == ("pagedllm", "worker")]
    assert reaches == []


def test_the_scan_sees_function_level_and_relative_imports(tmp_path):
    package = tmp_path / "pagedllm" / "engine"
    package.mkdir(parents=True)
    (package / "x.py").write_text("from . import y\n\ndef f():\n    from pagedllm.worker.sampler import Sampler\n")
    assert imported_modules(package / "x.py", tmp_path) == [(("pagedllm", "engine", "y"), 1),
                                                            (("pagedllm", "worker", "sampler"), 4)]
