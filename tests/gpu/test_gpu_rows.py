"""The rows mechanism of tests/gpu/conftest.py, run by pytest on a small test module in a copy of
the layout: a row over its threshold fails its test (after its other rows are recorded), a test
that raises gets a FAIL row, ``--gpu-table`` prints the table before pytest's own summary and
writes the rows, and the ``[cuda]`` variants are deselected without ``-m gpu``."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHECKS = '''
def test_within(record_row):
    record_row("a within", 1, "< 2", True)
    record_row("a shown", 3, "-", None)


def test_over(record_row):
    record_row("b over", 5, "< 2", False)
    record_row("b after", 1, "< 2", True)


def test_raises(record_row):
    raise ValueError("broken on purpose")


def test_both(device):
    assert device == "cpu"
'''


def test_rows_fail_their_test_and_come_back_as_a_table(tmp_path):
    (tmp_path / "gpu").mkdir()
    shutil.copy(HERE.parent / "conftest.py", tmp_path / "conftest.py")  # registers --gpu-table
    for name in ("__init__.py", "conftest.py", "helpers.py"):
        shutil.copy(HERE / name, tmp_path / "gpu" / name)
    (tmp_path / "gpu" / "test_checks.py").write_text(CHECKS)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-ra", "gpu",
                           "--gpu-table", str(tmp_path / "rows.json")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    rows = [(r["check"], r["result"]) for r in json.loads((tmp_path / "rows.json").read_text())]
    assert rows == [("a within", "PASS"), ("a shown", "INFO"), ("b over", "FAIL"), ("b after", "PASS"),
                    ("test_raises", "FAIL")], proc.stdout
    assert proc.returncode == 1
    assert "rows over their threshold:\n  b over: measured 5, threshold < 2" in proc.stdout
    assert "| b over | 5 | < 2 | FAIL |" in proc.stdout
    table, summary = proc.stdout.index("| check | measured |"), proc.stdout.index("short test summary")
    assert table < summary and proc.stdout.rstrip().splitlines()[-1].startswith("2 failed, 2 passed, 1 deselected")
