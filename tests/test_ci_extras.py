"""Under CI=true, a suite guarded by `pytest.importorskip` on a package of the `test` extra fails
instead of skipping (tests/conftest.py); elsewhere it still skips."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TEST_EXTRA_MODULES

ROOT = Path(__file__).resolve().parents[1]

GUARDED = '''
import pytest
transformers = pytest.importorskip("transformers")  # module level: the whole file

def test_uses_transformers():
    pass
'''
GUARDED_IN_A_TEST = '''
import pytest

def test_plots():
    pytest.importorskip("matplotlib")

def test_optional_elsewhere():
    pytest.importorskip("not_a_test_extra_package")
'''


def test_conftest_names_every_package_of_the_test_extra():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (not a package of the test extra)
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    names = {re.split(r"[<>=!~ \[;]", req, maxsplit=1)[0] for req in extra} - {"pytest", "pytest-xdist"}
    assert set(TEST_EXTRA_MODULES) == {n.replace("-", ".") if n == "megatron-core" else n for n in names}


# what the suite may skip without being a package of the test extra: the standard library's own
# (tomllib, Python >= 3.11), torch's optional parts, and this file's stand-in for a missing package
NOT_EXTRAS = ("tomllib", "torch.", "not_a_test_extra_package")


def test_every_package_the_suite_skips_without_is_in_the_test_extra():
    """A package guarded by importorskip but missing from the extra skips its tests silently, even in CI."""
    guarded = {m for path in (ROOT / "tests").glob("*.py")
               for m in re.findall(r'importorskip\("([\w.]+)"', path.read_text())}
    outside = sorted(m for m in guarded if not m.startswith(NOT_EXTRAS)
                     and not any(m == e or m.startswith(e + ".") for e in TEST_EXTRA_MODULES))
    assert not outside, f"guarded by importorskip but not in pyproject's test extra: {outside}"


def _pytest(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(tmp_path / "shadow")  # where both packages fail to import
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "--continue-on-collection-errors", str(tmp_path / "suite")], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)


def test_missing_test_extra_fails_under_ci_and_skips_elsewhere(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", suite / "conftest.py")
    (suite / "test_guarded.py").write_text(GUARDED)
    (suite / "test_guarded_in_a_test.py").write_text(GUARDED_IN_A_TEST)
    for name in ("transformers", "matplotlib"):  # installed here: shadow them with broken packages
        (tmp_path / "shadow" / name).mkdir(parents=True)
        (tmp_path / "shadow" / name / "__init__.py").write_text("raise ModuleNotFoundError('not installed here')\n")
    local = _pytest(tmp_path, ci=None)
    assert local.returncode == 0 and "3 skipped" in local.stdout, local.stdout[-2000:]
    ci = _pytest(tmp_path, ci="true")
    out = ci.stdout
    assert ci.returncode == 1, out[-2000:]
    assert "1 failed" in out and "1 skipped" in out and "1 error" in out, out[-2000:]
    assert out.count("CI=true: the `test` extra must be installed") >= 2
    assert "could not import 'not_a_test_extra_package'" in out, "other optional packages still skip"
