"""The core's runtime imports run one way, in the order docs/architecture.md gives."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import attn_di

PACKAGE = Path(attn_di.__file__).parent
DOC = PACKAGE.parents[1] / "docs" / "architecture.md"

# Bottom first: a module may import, at run time, only modules listed before it.
LAYERS = [
    "exceptions",
    "_env",
    "_state",
    "_paths",
    "_device",
    "backend",
    "_family",
    "_enum",
    "_provider",
    "_overrides",
    "_container",
    "_selection",
    "_default",
    "_deprecated",
    "_propagation",
    "_plugins",
    "_testing",
    "__init__",
]


def _runtime_imports(path: Path) -> set[str]:
    """attn_di modules imported by ``path`` at run time (module or function level), outside
    ``if TYPE_CHECKING:`` blocks, as their first component below ``attn_di``."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "attn_di":
                continue
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "attn_di" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_core_imports_run_one_way() -> None:
    """No core module imports one listed after it (no cycles, no upward imports)."""
    upward = []
    for index, name in enumerate(LAYERS):
        path = PACKAGE / name / "__init__.py" if name == "backend" else PACKAGE / f"{name}.py"
        for imported in _runtime_imports(path):
            if imported in LAYERS and LAYERS.index(imported) >= index and imported != name:
                upward.append(f"{name} -> {imported}")
            elif imported not in LAYERS and name != "__init__" and name != "backend":
                upward.append(f"{name} -> {imported} (outside the core)")
    assert upward == []


def test_every_core_module_is_placed() -> None:
    """Every private module of the package has a place in the stack."""
    modules = {p.stem for p in PACKAGE.glob("_*.py")} - {"__main__"}
    assert modules <= set(LAYERS)


def test_the_architecture_page_lists_the_stack_in_order() -> None:
    """docs/architecture.md names the core modules bottom-up in the same order."""
    listed = re.findall(r"^\| `(?:attn_di\.)?([\w.]+?)(?:\.py)?` \|", DOC.read_text(), re.MULTILINE)
    assert [name.removeprefix("attn_di.") for name in listed] == LAYERS
