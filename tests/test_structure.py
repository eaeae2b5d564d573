"""The code base keeps its shape: small files, short functions (one job each)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "seqpar"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_file_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_over_60_lines():
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_checks_see_the_package():
    assert len(_sources()) > 30  # a wrong path would make both checks pass vacuously


# the plumbing every tiny run and HF comparison needs lives in the helper modules (run_helpers,
# hf_helpers, gpt_helpers, dropin_helpers); a test module states its settings and calls them
SHARED_HELPERS = {"_overrides": "run_helpers.run_overrides", "batch": "hf_helpers.shifted_batch / gpt_helpers.batch",
                  "hf_reference": "hf_helpers.hf_reference"}


def test_test_modules_do_not_redefine_the_shared_helpers():
    tests = Path(__file__).resolve().parent
    found = [f"{path.name}:{node.lineno} {node.name} (use {SHARED_HELPERS[node.name]})"
             for path in sorted(tests.glob("test_*.py")) for node in ast.parse(path.read_text()).body
             if isinstance(node, ast.FunctionDef) and node.name in SHARED_HELPERS]
    assert not found, f"helpers redefined in test modules: {found}"
