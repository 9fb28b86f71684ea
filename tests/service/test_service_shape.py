"""The service's code stays in pieces one can read (issue 29): no function of `service/` (the
routers of `service/routes/` included) is longer than 120 lines, checked by walking the code."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[2] / "service"
MAX_LINES = 120


def long_functions(root: Path, limit: int) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {lines} lines")
    return out


def test_no_service_function_is_longer_than_120_lines() -> None:
    assert (SERVICE / "app.py").exists() and (SERVICE / "routes").is_dir()
    assert long_functions(SERVICE, MAX_LINES) == []

