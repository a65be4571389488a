"""The documented floors are the code's: each package of megatron_mimesis imports only from the floors before its
own (the order is read from the "Floors" line of docs/development.md, so the document and this check cannot drift
apart)."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "development.md"
PACKAGE = REPO / "megatron_mimesis"


def floors() -> list[str]:
    line = re.search(r"^Floors, each importing only from those before it: (.+?)\.$", DOC.read_text(),
                     re.MULTILINE | re.DOTALL)
    assert line, f"{DOC} has no 'Floors, each importing only from those before it: ...' line"
    return [name.strip() for name in re.split(r"->|/", " ".join(line.group(1).split())) if name.strip() != "tools"]


def imported_packages(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "megatron_mimesis" and len(parts) > 1:
                yield node.lineno, parts[1]


def test_no_package_imports_a_floor_above_its_own():
    order = floors()
    assert order[:3] == ["compat", "models", "checkpoint"] and "rl" in order, order
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert set(packages) <= set(order), f"packages without a floor in docs/development.md: {set(packages) - set(order)}"
    upward = []
    for package in packages:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            for line, other in imported_packages(path):
                if other in order and order.index(other) > order.index(package):
                    upward.append(f"{path.relative_to(REPO)}:{line} imports megatron_mimesis.{other}")
    assert not upward, "\n".join(upward)
