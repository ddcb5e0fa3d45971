"""The house stays readable: no module of m1/ over 600 lines, no function over 60, without exemptions."""
import ast
from pathlib import Path

import m1

ROOT = Path(m1.__file__).parent


def _sizes():
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        yield path, None, len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node, node.end_lineno - node.lineno + 1


def test_modules_and_functions_stay_short():
    modules = [f"{p.relative_to(ROOT)}: {n} lines" for p, node, n in _sizes() if node is None and n > 600]
    functions = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines" for p, node, n in _sizes()
                 if node is not None and n > 60]
    assert not modules and not functions, "split by concern: " + \
        "; ".join(modules + functions)
    assert sum(1 for p, node, _ in _sizes() if node is None) > 100  # it read the package
