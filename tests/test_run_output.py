"""What `seqpar train` prints, through the command line: no warning lines of torch or other
libraries in a normal run (one process, two, compiled), seqpar's own events as lines of the run's
log that `PYTHONWARNINGS=ignore` does not hide, and a line when `--max-restarts` restarts ranks."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from seqpar.checkpoint import complete_checkpoints

from run_helpers import run_overrides, wait_for

TINY = {"model.vocab_size": 64, "model.seq_len": 16, "model.hidden": 16, "model.heads": 2, "model.layers": 1,
        "train.micro_batch": 2, "train.eval_interval": 0, "train.log_interval": 1, "train.warmup_steps": 1}
SEQPAR = [sys.executable, "-m", "seqpar.cli", "train"]


def _warning_lines(text: str) -> list[str]:
    """Python warnings (``UserWarning: ...`` and the source line under it) and torch's logged
    warnings (``[rank0]:W1205 12:00:00 ...``)."""
    return [ln for ln in text.splitlines() if re.search(r"Warning\b|warnings\.warn", ln)
            or re.match(r"(\[rank\d+\]:)?[WE]\d{4} ", ln)]


def _run(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | {"PYTHONUNBUFFERED": "1"} | env
    return subprocess.run(SEQPAR + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_one_process_run_prints_no_warnings_and_logs_fallbacks_under_pythonwarnings_ignore(tmp_path):
    """A one-process run saves (DCP's single-process notice was printed on every save and load);
    its resume falls back past an incomplete and a damaged checkpoint, each said in the log even
    under PYTHONWARNINGS=ignore (they were UserWarnings, hidden by it)."""
    saves = {"checkpoint__interval": 1, "checkpoint__keep": 3, "checkpoint__resume": "auto"}
    # background saves: DCP's writer thread repeated the notice after the save call had returned
    p = _run(run_overrides(tmp_path, TINY, train__steps=2, checkpoint__async="true", **saves), tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _warning_lines(p.stdout + p.stderr) == [], p.stdout + p.stderr
    ckpt = tmp_path / "ckpt"
    one, two = (ckpt / f"step_{s:08d}" for s in (1, 2))
    shard = next(two.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (ckpt / "step_00000009").mkdir()  # a save that never finished: no marker
    p = _run(run_overrides(tmp_path, TINY, train__steps=3, **saves), tmp_path, PYTHONWARNINGS="ignore")
    assert p.returncode == 0, p.stderr[-3000:]
    log = p.stdout.splitlines()
    assert any(f"checkpoint {ckpt / 'step_00000009'} is incomplete" in ln and "was skipped" in ln
               for ln in log), p.stdout
    fallback = [ln for ln in log if shard.name in ln and "checksum" in ln]
    assert len(fallback) == 1 and f"resuming from {one} instead" in fallback[0], p.stdout
    assert f"resumed from {one} at step 1" in log, p.stdout
    assert _warning_lines(p.stdout + p.stderr) == [], p.stdout + p.stderr


def test_two_compiled_ranks_print_no_warnings(tmp_path):
    """torch logs "context_fn is passed to torch.utils.checkpoint under torch.compile" from every
    rank that traces a selective-recompute block; seqpar's blocks hold no in-place op."""
    ov = run_overrides(tmp_path, TINY, train__steps=2, checkpoint__interval=2, parallel__tp=2,
                    train__compile="true", model__recompute="selective")
    p = _run(["--nproc-per-node", "2"] + ov, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert any(ln.startswith("compile: 1 transformer block compiled") for ln in p.stdout.splitlines()), p.stdout
    assert _warning_lines(p.stdout + p.stderr) == [], p.stdout + p.stderr


def test_a_restart_says_which_rank_died_then_where_it_resumes(tmp_path):
    """--max-restarts 1, one rank killed after its first checkpoint: the launcher names the rank and
    its signal and says the ranks restart (1 of 1), before the restarted run's resume line."""
    ov = run_overrides(tmp_path, TINY, train__steps=100000, checkpoint__interval=2, checkpoint__resume="auto")
    log = tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | {"PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(SEQPAR + ["--nproc-per-node", "1", "--max-restarts", "1"] + ov, cwd=tmp_path,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: complete_checkpoints(tmp_path / "ckpt"), proc, log, "a first checkpoint")
        rank = int(subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()[0])
        os.kill(rank, signal.SIGKILL)
        wait_for(lambda: "resumed from" in log.read_text(), proc, log, "a resume")
        proc.send_signal(signal.SIGTERM)  # forwarded to the rank: it saves and stops, and so does the launcher
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = log.read_text().splitlines()
    said = [i for i, ln in enumerate(lines) if ln.startswith("seqpar train: rank 0 failed (signal SIGKILL); "
                                                            "restarting the rank (restart 1 of 1)")]
    resumed = [i for i, ln in enumerate(lines) if ln.startswith("resumed from")]
    assert len(said) == 1 and len(resumed) == 1 and said[0] < resumed[0], "\n".join(lines[-40:])
    assert _warning_lines("\n".join(lines)) == [], "\n".join(lines)
