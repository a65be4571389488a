"""The trainer's room has no import circles: no module of ``megatron_mimesis/training`` imports (at its top or inside
a function) one that imports it back, directly or through others (issue 29: the config imported the memory plan,
which imported the config; the plan's states imported ``train.py``, which imports the plan)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "megatron_mimesis" / "training"
PACKAGE = "megatron_mimesis.training"


def _imports() -> dict[str, set[str]]:
    graph = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join((PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name.startswith(PACKAGE)}
        graph[name] = found - {name}
    return graph


def test_no_module_of_training_imports_one_that_imports_it_back():
    graph = _imports()
    assert "megatron_mimesis.training.memory.plan" in graph and len(graph) > 15

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = sorted(name for name in graph if name in reaches(name))
    assert not circles, circles
