"""No module reads another module's private names (#42): every module of actors/, kernels/ and
wire/ is parsed and walked.

A private name starts with an underscore and is not a dunder. Two reads are refused:
- `from X import _name` (absolute or relative): X's private name.
- `expr._name` for any expr but `self`, `cls` and `super()`: a private attribute of another
  module (`loader._DTYPES`), class (`Scheduler._fork`) or object (`core._on_result`,
  `engine.core.sched._finish`). A class's own privates are reached through self / cls.
The exceptions are listed below, each with its reason; one that no longer occurs fails too, so
the list stays the list of what is left.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("actors", "kernels", "wire")

ALLOWED = {
    ("actors/process.py", "os._exit"):
        "the standard library's exit without cleanup, for a forked child",
    ("kernels/linear.py", "torch.ops.mkldnn._reorder_linear_weight"):
        "torch's oneDNN linear ops exist only under these names",
    ("kernels/linear.py", "torch.ops.mkldnn._linear_pointwise"):
        "torch's oneDNN linear ops exist only under these names",
    ("kernels/native_api.py", "ctypes._CFuncPtr"):
        "ctypes' base of function types: a prototype with flags 0 checks the argument count",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.expr) -> bool:
    """self._x, cls._x, super()._x: a class reaching its own private names."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
        and node.func.id == "super"


def private_reads(source: str) -> list[tuple[int, str]]:
    """(line, the read as written) for each read of another module's private name."""
    reads = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            reads += [(node.lineno, f"from {module} import {alias.name}")
                      for alias in node.names if _private(alias.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            reads.append((node.lineno, ast.unparse(node)))
    return reads


def test_the_check_finds_each_kind_of_read():
    source = ("from .core import _helper\nfrom pagewire.cli import _config as c\n"
              "import pagewire.executor.loader as loader\n"
              "class A(B):\n    def f(self, core):\n"
              "        self._mine, cls._ours, super()._base()\n"
              "        return loader._DTYPES, core._on_result, self.engine.core._ledger\n")
    assert private_reads(source) == [
        (1, "from .core import _helper"), (2, "from pagewire.cli import _config"),
        (7, "loader._DTYPES"), (7, "core._on_result"), (7, "self.engine.core._ledger")]
    assert private_reads("import os\nos.path.join(__file__, x.__class__)\n") == []


def test_no_module_reads_another_modules_private_names():
    found, unexplained = set(), []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            for line, read in private_reads(path.read_text()):
                if (name, read) in ALLOWED:
                    found.add((name, read))
                else:
                    unexplained.append(f"{name}:{line}: {read}")
    assert unexplained == []
    assert set(ALLOWED) - found == set(), "exceptions that no longer occur: remove them"
