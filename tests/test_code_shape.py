"""Shape rules for the package source: no function longer than 60 lines."""
import ast
from pathlib import Path

import seqpar

MAX_FUNCTION_LINES = 60


def test_no_function_in_seqpar_is_longer_than_60_lines():
    root = Path(seqpar.__file__).parent
    long = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - start + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
