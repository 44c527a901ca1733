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
            if node.module != "zyx":  # ``from zyx import dtypes`` imports zyx.dtypes, not the user API
                out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


SHARED_LEAVES = ("zyx.dtypes", "zyx.utils", "zyx.ops")


def _violations(folder: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """Per file of ``zyx/<folder>``, the zyx modules it imports outside ``allowed`` (prefixes)."""
    out = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        mods = _zyx_imports(path)
        bad = {m for m in mods if not m.startswith(allowed)}
        if bad:
            out[str(path.relative_to(ROOT.parent))] = sorted(bad)
    return out


def test_the_kernel_layer_imports_only_itself_and_the_shared_leaves():
    assert _violations("kernel", ("zyx.kernel",) + SHARED_LEAVES) == {}


def test_backends_import_nothing_from_the_layers_above_them():
    """Devices see graph classes only through the objects ``match_graph`` hands them (duck-typed), and never the
    user API (``import zyx``)."""
    assert _violations("backends", ("zyx.backends", "zyx.kernel") + SHARED_LEAVES) == {}


def test_the_graph_layer_imports_only_itself_and_the_layers_below():
    assert _violations("graph", ("zyx.graph", "zyx.kernel", "zyx.backends") + SHARED_LEAVES) == {}


def test_the_op_vocabulary_is_a_leaf_and_defined_once():
    assert _zyx_imports(ROOT / "ops.py") == set()
    for path in ROOT.rglob("*.py"):
        if path.name != "ops.py":
            defined = [n.name for n in ast.walk(ast.parse(path.read_text()))
                       if isinstance(n, ast.ClassDef) and any(getattr(b, "attr", getattr(b, "id", "")) in
                                                              ("Enum", "IntEnum") for b in n.bases)]
            assert not {"Op", "Ops"} & set(defined), f"{path}: a second op enum"


def test_no_module_imports_relatively_so_the_check_above_sees_everything():
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path}: relative import"


POOL_METHODS = {"allocate", "release", "retain", "host_to_pool", "pool_to_host", "pool_to_pool", "wrap"}


def test_the_tensor_layer_moves_data_only_through_the_graph():
    """The user API (Tensor, autograd, optimizers, nn) never calls a pool: uploads and reads go through
    ``zyx.graph.transfer``. (``io`` and ``dlpack`` exchange memory with files and other libraries by design.)"""
    files = [ROOT / n for n in ("tensor.py", "autograd.py", "backward.py", "optim.py")]
    calls = {}
    for path in files + sorted((ROOT / "nn").glob("*.py")):
        called = {n.func.attr for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in POOL_METHODS}
        if called:
            calls[str(path.relative_to(ROOT.parent))] = sorted(called)
    assert calls == {}
