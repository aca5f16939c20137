"""The service layer's imports, which import-linter cannot see (service/ is mapped)."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICE_DIR = Path(__file__).resolve().parent.parent / "service"
# the service sits below cli and cluster (docs/architecture.md): it may import any lower layer
FORBIDDEN = ("kvcore.cli", "kvcore.cluster")


def kvcore_imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return [name for name in names if name == "kvcore" or name.startswith("kvcore.")]


def test_service_never_imports_the_cli_or_a_bare_service_package() -> None:
    files = sorted(SERVICE_DIR.glob("*.py"))
    assert files, f"no service modules under {SERVICE_DIR}"
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                top = node.module.split(".")[0]
                assert top != "service", f"{path.name}: bare 'service' import"
        for name in kvcore_imports(path):
            assert not name.startswith(FORBIDDEN), f"{path.name} imports {name} (a higher layer)"


def test_the_check_sees_imports(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from kvcore.cli import main\nimport kvcore.engine\n")
    assert kvcore_imports(bad) == ["kvcore.cli", "kvcore.engine"]
