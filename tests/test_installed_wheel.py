"""An installed wheel (no source checkout on the path) ships its configs: `seqpar memory --paper`
and a config named like `tiny-cpu` work from any directory."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Build a wheel from a copy of the sources and install it into a bare target directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy, so the build leaves nothing behind in the checkout
    shutil.copytree(ROOT / "seqpar", src / "seqpar", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)], cwd=tmp)
    wheel = next((tmp / "dist").glob("seqpar-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "seqpar/configs/tiny-cpu.yaml" in names and "seqpar/configs/paper/175b.yaml" in names, names
    _run(pip + ["install", "--no-deps", "--target", str(tmp / "site"), str(wheel)], cwd=tmp)
    return tmp / "site"


def test_installed_wheel_finds_its_configs(site, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = ("import seqpar; from seqpar.config import load_run_config, resolve_config; "
             "print(seqpar.__file__); print(resolve_config('tiny-cpu')); "
             "print(load_run_config('tiny-cpu', ['train.steps=3']).train.steps)")
    lines = _run([sys.executable, "-c", probe], cwd=tmp_path, env=env).stdout.splitlines()
    assert Path(lines[0]).is_relative_to(site), lines  # the wheel, not the source checkout
    assert Path(lines[1]).is_relative_to(site) and lines[1].endswith("tiny-cpu.yaml") and lines[2] == "3", lines
    out = _run([sys.executable, "-m", "seqpar.cli", "memory", "--paper"], cwd=tmp_path, env=env).stdout
    for name in ("22B", "175B", "530B", "1T"):
        assert f"### {name}:" in out


def test_installed_wheel_trains_a_shipped_config_by_name(site, tmp_path):
    """`seqpar train tiny-cpu --nproc-per-node 2` from the wheel, in a directory without the sources
    (a token file instead of the tokenizer build, two steps)."""
    import numpy as np
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 256, 40_000).astype(np.uint16))
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = _run([sys.executable, "-m", "seqpar.cli", "train", "tiny-cpu", "--nproc-per-node", "2", "train.steps=2",
                "train.log_interval=1", "train.eval_interval=0", f"data.source={tmp_path / 'tokens.npy'}",
                f"checkpoint.dir={tmp_path / 'ckpt'}", f"out_dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)
    assert "step     2/2" in out.stdout and "checkpoint saved" in out.stdout, out.stdout[-2000:]
