"""Behaviour that differs per drafter method lives in the method objects (dflash_jax/methods, design §17, §18):
no other module compares config.drafter.method against a method's name. Read from the source with `ast`."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "dflash_jax"
NAMES = {"dflash", "dspark", "dflash2"}
# The method objects themselves (the registry among them).
OWNERS = {"methods"}


def _is_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_name(element) for element in node.elts)
    return False


def name_comparisons(source: str) -> list[int]:
    """Line numbers where a method name is compared (`==`, `!=`, `in`, `not in`, a match case)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_is_name(side) for side in [node.left, *node.comparators]):
            lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _is_name(node.value):
            lines.append(node.lineno)
    return lines


def test_finds_each_kind_of_comparison():
    source = ('a = m == "dspark"\nb = "dflash2" != m\nc = m in ("dflash", "x")\n'
              'match m:\n    case "dflash":\n        pass\nd = m == "other"\ne = "dflash"\n')
    assert name_comparisons(source) == [1, 2, 3, 5]


def test_no_module_outside_the_methods_compares_a_method_name():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.split("/")[0] in OWNERS:
            continue
        if lines := name_comparisons(path.read_text()):
            found[relative] = lines
    assert not found, f"ask config.drafter_method (dflash_jax/methods) instead of comparing its name: {found}"

