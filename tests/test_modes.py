"""Recompute modes, data-parallel modes and precisions are spelled once (seqpar.model.modes, the
recompute modes in seqpar.recompute below it): no other module of seqpar/ writes their values out
as a tuple, list or set, or as a Literal type."""
import ast
from pathlib import Path

import seqpar
from seqpar.model.modes import DATA_PARALLEL_MODES, PRECISION_SETTINGS, PRECISIONS, RECOMPUTE_METHODS, RECOMPUTE_MODES

PACKAGE = Path(seqpar.__file__).parent
HOMES = {PACKAGE / "model" / "modes.py", PACKAGE / "recompute.py"}
NAMED = {frozenset(RECOMPUTE_MODES), frozenset(RECOMPUTE_METHODS), frozenset(DATA_PARALLEL_MODES), frozenset(PRECISIONS),
         frozenset(PRECISION_SETTINGS)}


def _spelled(node: ast.AST) -> frozenset | None:
    """The string values of a tuple/list/set literal or a ``Literal[...]`` subscript, else None."""
    if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal":
        node = node.slice
    elts = getattr(node, "elts", None) if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else None
    if not elts or not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
        return None
    return frozenset(e.value for e in elts)


def spellings(path: Path, root: Path = PACKAGE) -> list[str]:
    """``file:line [values]`` for each line of ``path`` that spells a named set of modes."""
    tree = ast.parse(path.read_text())
    return sorted({f"{path.relative_to(root)}:{n.lineno} {sorted(v)}" for n in ast.walk(tree)
                   if (v := _spelled(n)) is not None and v in NAMED})


def test_the_modes_are_spelled_once():
    found = [s for p in sorted(PACKAGE.rglob("*.py")) if p not in HOMES for s in spellings(p)]
    assert not found, "spell these with seqpar.model.modes:\n" + "\n".join(found)


def test_the_check_sees_a_spelling(tmp_path):
    src = tmp_path / "x.py"
    src.write_text('from typing import Literal\nA = ("none", "selective", "full")\nB: Literal["ddp", "fsdp"]\n')
    assert spellings(src, tmp_path) == ["x.py:2 ['full', 'none', 'selective']", "x.py:3 ['ddp', 'fsdp']"]
