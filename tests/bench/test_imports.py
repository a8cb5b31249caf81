"""bench/ and tests/ share fixtures through pagewire.testing (actors/testing/), never by one
importing the other; the engine itself imports none of them."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """The absolute names of the modules a file imports (`package`: the dotted package the
    file belongs to, to resolve its relative imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and package:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def importers(files, package_of, banned: str) -> dict[str, list[str]]:
    """file -> the modules named `banned` or inside it that the file imports."""
    found = {}
    for path in files:
        hits = sorted(m for m in imported_modules(path, package_of(path))
                      if m == banned or m.startswith(banned + "."))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    return found


def engine_package(path: Path) -> str:
    """actors/executor/runner.py -> pagewire.executor (the pyproject's package-dir)."""
    top, *rest = path.relative_to(ROOT).parent.parts
    base = {"actors": "pagewire", "kernels": "pagewire.kernels", "wire": "pagewire.wire"}[top]
    return ".".join([base, *rest])


def test_no_bench_script_imports_tests():
    scripts = sorted((ROOT / "bench").rglob("*.py"))
    assert len(scripts) > 20                        # the walk sees the benchmarks
    assert importers(scripts, lambda _: None, "tests") == {}


def test_the_shared_fixtures_import_nothing_of_tests():
    fixtures = sorted((ROOT / "actors" / "testing").glob("*.py"))
    assert {p.name for p in fixtures} >= {"checkpoints.py", "gguf_writer.py", "server.py"}
    assert importers(fixtures, engine_package, "tests") == {}


def test_the_engine_imports_no_fixtures():
    engine = [p for top in ("actors", "kernels", "wire") for p in (ROOT / top).rglob("*.py")
              if (ROOT / "actors" / "testing") not in p.parents]
    assert importers(engine, engine_package, "pagewire.testing") == {}
    assert importers(engine, engine_package, "tests") == {}


def test_the_walk_sees_absolute_and_relative_imports(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import tests.helpers\nfrom tests import e2e\nfrom . import testing\n"
                      "from ..testing.server import Server\nimport os.path as p\n")
    assert imported_modules(script, "pagewire.executor") == {
        "tests.helpers", "tests", "tests.e2e", "pagewire.executor", "pagewire.executor.testing",
        "pagewire.testing.server", "pagewire.testing.server.Server", "os.path"}
