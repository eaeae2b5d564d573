"""`seqpar plan`: the table, the overrides, one layout, errors, the plot."""
import re

import pytest

from seqpar import cli
from seqpar.config import load_run_config
from seqpar.plan import cli as plan_cli

A100_175B = ["paper/175b", "--gpus", "64", "--gpu", "a100-80gb"]
PAPER_LAYOUT = "t=8 p=8 m=3 dp=1 b=1 sp=on rc=selective"


def _rows(out):
    return [line for line in out.splitlines() if re.match(r"\| \d+ \|", line)]


def test_175b_on_64_a100_lists_the_papers_layout_in_its_top_3(capsys):
    assert cli.main(["plan", *A100_175B, "--top", "5"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert len(rows) == 5
    paper = [r for r in rows[:3] if PAPER_LAYOUT in r]
    assert paper, rows
    seconds = float(paper[0].split("|")[7])
    assert seconds == pytest.approx(13.75, rel=0.10)
    assert f"the config's own layout ({PAPER_LAYOUT}) ranks #" in out
    times = [float(r.split("|")[7]) for r in rows]
    assert times == sorted(times)


def test_best_layout_overrides_are_real_config_keys(capsys):
    assert plan_cli.main([*A100_175B, "--top", "1"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("seqpar train paper/175b "))
    items = line.split()[3:]
    keys = {i.split("=")[0] for i in items}
    assert {"parallel.tp", "parallel.pp", "parallel.virtual_stages", "parallel.dp", "train.micro_batch",
            "model.sequence_parallel", "model.recompute"} <= keys
    # every key exists and every value loads; training refuses only the pipeline, and says so
    with pytest.raises(ValueError, match="parallel.pp=8"):
        load_run_config("paper/175b", items)
    assert "note: seqpar train refuses these overrides today: parallel.pp=8" in out
    cfg = load_run_config("paper/175b", [i for i in items if not i.startswith(("parallel.pp", "parallel.virtual"))]
                          + ["parallel.pp=1", "parallel.virtual_stages=1"])
    assert (cfg.parallel.tp, cfg.train.micro_batch, cfg.model.recompute) == (8, 1, "selective")


def test_one_layout_prints_its_predicted_time_and_memory(capsys):
    layout = "tp=8,pp=8,virtual_stages=3,micro_batch=1,sequence_parallel=true,recompute=selective"
    assert plan_cli.main([*A100_175B, "--layout", layout]) == 0
    out = capsys.readouterr().out
    seconds = float(re.search(r"predicted step time: ([\d.]+) s", out).group(1))
    assert seconds == pytest.approx(13.75, rel=0.10)
    assert re.search(r"memory per GPU: [\d.]+ GiB of 80.00 GiB", out) and out.rstrip().endswith("fits")


def test_a_layout_that_does_not_fit_says_which_term_and_by_how_much(capsys):
    layout = "tp=8,pp=8,virtual_stages=3,micro_batch=1,sequence_parallel=true,recompute=none"
    assert plan_cli.main([*A100_175B, "--layout", layout]) == 1
    out = capsys.readouterr().out
    assert re.search(r"does not fit: needs [\d.]+ GiB of 80.00 GiB on stage 0, over by [\d.]+ GiB; "
                     r"the largest term, activations", out)


@pytest.mark.parametrize("argv, message", [
    (["paper/175b", "--gpus", "64", "--gpu", "v100"], "unknown GPU 'v100'"),
    (["paper/175b", "--gpus", "64", "--gpu", "custom", "--peak-tflops", "500"],
     "--gpu custom needs --hbm-gib, --nvlink-gbps, --ib-gbps"),
    (["paper/175b", "--gpus", "64", "--gpu", "a100-80gb", "--peak-tflops", "500"], "--peak-tflops applies to"),
    (["paper/175b", "--gpus", "0", "--gpu", "a100-80gb"], "--gpus=0"),
    (["paper/175b", "--gpus", "64", "--gpu", "a100-80gb", "--layout", "tp=3"], "tp=3 pp=1"),
    (["paper/175b", "--gpus", "64", "--gpu", "a100-80gb", "--layout", "tp=8,pp=4,dp=4"],
     r"tp x pp x dp = 8 x 4 x 4 = 128 != --gpus 64"),
    (["paper/175b", "--gpus", "64", "--gpu", "a100-80gb", "--layout", "tp=8,pp=5"], "does not divide --gpus 64"),
    (["paper/175b", "--gpus", "7", "--gpu", "a100-80gb"], "no layout of 175B fits"),
])
def test_errors_name_the_offending_values(capsys, argv, message):
    assert plan_cli.main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_custom_gpu_runs(capsys):
    argv = ["paper/22b", "--gpus", "8", "--gpu", "custom", "--peak-tflops", "312", "--hbm-gib", "80",
            "--nvlink-gbps", "300", "--ib-gbps", "25", "--top", "2"]
    assert plan_cli.main(argv) == 0
    assert len(_rows(capsys.readouterr().out)) == 2


def test_png_plots_the_top_layouts(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert plan_cli.main(["paper/22b", "--gpus", "8", "--gpu", "h200", "--top", "4", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_is_a_clear_error(monkeypatch, capsys, tmp_path):
    real = plan_cli.importlib.util.find_spec
    monkeypatch.setattr(plan_cli.importlib.util, "find_spec", lambda n: None if n == "matplotlib" else real(n))
    assert plan_cli.main(["paper/22b", "--gpus", "8", "--gpu", "h200", "--png", str(tmp_path / "x.png")]) == 2
    assert "--png needs matplotlib" in capsys.readouterr().err


def test_mixes_are_ranked_when_asked(capsys):
    assert plan_cli.main(["paper/22b", "--gpus", "8", "--gpu", "a100-80gb", "--space", "paper", "--mixes"]) == 0
    out = capsys.readouterr().out
    assert "rc=mix(none=" in out
