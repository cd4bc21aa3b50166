"""Import direction between the top-level packages, read from the source with ``ast`` (every
``import`` statement, including the lazy ones inside functions), against the table in
docs/architecture.md: the contract (``pagedserve/``) imports none of the engine, the API or the
application layer; ``scheduler/`` imports only the standard library; ``api/`` never imports
torch; ``stack/`` may import everything and nothing imports it."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = frozenset({"pagedserve", "scheduler", "kernels", "worker", "api", "stack", "bench"})
ENGINE_STACK = frozenset({"torch", "triton", "transformers", "tokenizers", "safetensors", "gguf"})


@dataclass(frozen=True)
class Layer:
    #: Project packages this one may import (itself included).
    may_import: frozenset[str]
    #: Third-party top-level modules it must never import.
    never: frozenset[str] = frozenset()
    #: Only the standard library outside the project.
    stdlib_only: bool = False


LAYERS = {
    "pagedserve": Layer(frozenset({"pagedserve"}), ENGINE_STACK | {"flask", "werkzeug"}),
    "scheduler": Layer(frozenset({"scheduler"}), stdlib_only=True),
    "kernels": Layer(frozenset({"kernels"}), frozenset({"flask"})),
    "worker": Layer(
        frozenset({"worker", "scheduler", "kernels", "pagedserve"}), frozenset({"flask"})
    ),
    "api": Layer(frozenset({"api", "pagedserve"}), ENGINE_STACK),
    "stack": Layer(PROJECT - {"bench"}),
}


def imports_of(package: str) -> dict[str, set[str]]:
    """Top-level module name -> the files of ``package`` that import it (absolute imports)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(rel)
    return found


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_package_imports_only_what_its_layer_allows(package: str) -> None:
    layer = LAYERS[package]
    imported = imports_of(package)
    upward = {m: f for m, f in imported.items() if m in PROJECT and m not in layer.may_import}
    assert not upward, f"{package}/ imports packages above or beside it: {upward}"
    banned = {m: f for m, f in imported.items() if m in layer.never}
    assert not banned, f"{package}/ imports {sorted(banned)}: {banned}"
    if layer.stdlib_only:
        foreign = {
            m: f
            for m, f in imported.items()
            if m not in sys.stdlib_module_names and m not in layer.may_import
        }
        assert not foreign, f"{package}/ must use the standard library only: {foreign}"


def test_nothing_imports_the_application_layer() -> None:
    for package in sorted(LAYERS.keys() - {"stack"}):
        assert "stack" not in imports_of(package), package


def test_the_reader_sees_lazy_imports_of_the_cli() -> None:
    """What ``stack.cli`` delegates to, it imports by ordinary statements (inside functions, to
    keep torch out of the light subcommands), so this parser, a reader and a tool all see them."""
    from stack.cli import DELEGATED

    tree = ast.parse((ROOT / "stack" / "cli.py").read_text())
    modules = {
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    assert {d.module for d in DELEGATED.values()} <= modules
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "importlib" not in imported  # no import_module on a table of strings


def test_the_layer_table_is_the_one_in_the_docs() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = {line.split("|")[1].strip() for line in doc.splitlines() if line.startswith("| `")}
    assert {f"`{p}/`" for p in LAYERS} <= rows
