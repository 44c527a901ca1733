"""The layers' import graph (DESIGN.md): the kernel layer is target independent and knows nothing above it."""

from __future__ import annotations

import ast
from pathlib import Path

import zyx

ROOT = Path(zyx.__file__).parent


def _zyx_imports(path: Path) -> set[str]:
    """Every ``zyx...`` module a file imports (absolute imports; the package uses no relative ones)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "zyx")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zyx":
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_the_kernel_layer_imports_only_itself_and_the_shared_leaves():
    allowed = ("zyx.kernel", "zyx.dtypes", "zyx.utils")
    for path in sorted((ROOT / "kernel").glob("*.py")):
        bad = {m for m in _zyx_imports(path) if m != "zyx" and not m.startswith(allowed)}
        assert not bad, f"{path.relative_to(ROOT.parent)} imports {sorted(bad)}: the kernel layer must not"


def test_no_module_imports_relatively_so_the_check_above_sees_everything():
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path}: relative import"
