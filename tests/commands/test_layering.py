"""The package's layering (design §17), read from the source with `ast` (nothing is imported): every import
between dflash_jax's modules is one the floor table allows, and the modules' imports have no cycle."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "dflash_jax"

# Each room and the rooms it may import (its own modules always). Lowest floor first; design §17.
FLOORS = {
    "runtime": set(),
    "sharding": {"runtime"},
    "ops": {"runtime", "sharding"},
    "methods": {"runtime"},
    "models": {"runtime", "sharding", "ops", "methods"},
    "data": {"runtime"},
    "weights": {"runtime", "methods", "sharding", "ops", "models"},
    "eval": {"runtime", "methods", "sharding", "ops", "models", "data", "weights"},
    "regeneration": {"runtime", "methods", "sharding", "ops", "models", "data", "weights", "eval"},
    "train": {"runtime", "methods", "sharding", "ops", "models", "data", "weights", "eval"},
    "planning": {"runtime", "methods", "sharding", "ops", "models", "data", "weights", "train"},
    "configs": {"runtime", "methods", "models", "train"},
    "commands": {"runtime", "methods", "sharding", "ops", "models", "data", "weights", "eval", "regeneration", "train",
                 "planning", "configs"},
}
# Modules of a room that also reach one floor up, each for a stated reason (design §17).
EXCEPTIONS = {
    "dflash_jax.train.startup": {"planning"},  # a run plans its step, and may choose its mesh, before it starts
    "dflash_jax.train.flops": {"planning"},  # the chip table's peaks, for MFU
    "dflash_jax.ops.attention": {"planning"},  # a GPU planned without one: cuDNN's limits from the chip table
}
# `python -m dflash_jax.<command>`: shims that only start a command.
ENTRY_SHIMS = {f"dflash_jax.{name}" for name in ("cli", "evaluate", "regenerate", "export", "convert")} | {
    "dflash_jax.train.__main__", "dflash_jax.plan", "dflash_jax.plan.__main__"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The dflash_jax modules `path` imports (`from dflash_jax.x import y` names module x.y when that is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("dflash_jax")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflash_jax"):
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module)
    return found


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    files = {module_name(path): path for path in package.rglob("*.py")}
    files |= {module_name(path): path for path in (package / "configs").glob("*.py")}  # a link to configs/
    return {module: imported_modules(path, set(files)) for module, path in files.items()}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imports in sorted(graph.items()):
        for target in sorted(imports):
            if module in ENTRY_SHIMS:
                allowed = room(target) == "commands"
            elif target in ENTRY_SHIMS or room(target) == "":
                allowed = False  # the bare package `dflash_jax` holds nothing to import
            elif room(module) not in FLOORS:
                allowed = False
            else:
                allowed = room(target) == room(module) or room(target) in FLOORS[room(module)] | EXCEPTIONS.get(
                    module, set())
            if not allowed:
                wrong.append(f"{module} imports {target}")
    return wrong


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the modules (as the list of its modules), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module], _ = "open", stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module], _ = "done", stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_every_import_follows_the_floor_table():
    graph = import_graph()
    assert "dflash_jax.train.loop" in graph and "dflash_jax.configs.tiny" in graph  # it read the whole package
    assert violations(graph) == []


def test_the_modules_import_no_cycle():
    assert cycle(import_graph()) is None


@pytest.mark.parametrize("module, target, bad", [
    ("dflash_jax.eval.exact_tau", "dflash_jax.train.loop", True),  # a lower floor reaching up
    ("dflash_jax.weights.model_card", "dflash_jax.commands.cli", True),
    ("dflash_jax.train.loop", "dflash_jax.commands.plan", True),  # the library never imports a command
    ("dflash_jax.evaluate", "dflash_jax.eval.report", True),  # a shim only starts its command
    ("dflash_jax.eval.exact_tau", "dflash_jax.runtime.distributed", False),
    ("dflash_jax.commands.evaluate", "dflash_jax.eval.report", False),
])
def test_the_table_rejects_an_import_that_climbs(module, target, bad):
    assert bool(violations({module: {target}})) == bad


def test_a_cycle_is_found():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def test_no_test_module_imports_another(tmp_path):
    """No test module imports another: what tests share lives in tests/*_fixtures.py or a folder's conftest.py."""
    tests = PACKAGE.parent / "tests"
    assert imports_of_test_modules(tests) == []
    (tmp_path / "test_a.py").write_text("from tests.models.test_drafter import make_config\nimport tests.test_b\n")
    assert imports_of_test_modules(tmp_path) == [
        "test_a.py imports tests.models.test_drafter", "test_a.py imports tests.test_b"]


def imports_of_test_modules(root: pathlib.Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(root)} imports {name}" for name in names
                      if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")]
    return found
