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
    assert {"parallel.tp", "parallel.pp", "parallel.virtual_stages", "parallel.pp_schedule", "parallel.dp",
            "parallel.data_parallel", "train.micro_batch", "model.sequence_parallel", "model.recompute"} <= keys
    # every key exists, every value loads and validates: seqpar train accepts the pipeline layout as printed
    cfg = load_run_config("paper/175b", items)
    cfg.validate()
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.train.micro_batch, cfg.model.recompute) == (8, 8, 1, "selective")
    assert cfg.parallel.pp_schedule == "Interleaved1F1B" and cfg.parallel.data_parallel == "ddp"
    assert "refuses" not in out and "not a config key" not in out


def test_a_mixed_layout_prints_recompute_auto_that_resolves_to_the_same_mix():
    """The best of --mixes is a per-layer mix: printed as model.recompute=auto with the GPU's budget,
    and the Trainer's resolve_recompute of those overrides gives the planner's own per-layer list."""
    from seqpar.plan.gpus import GPUS
    from seqpar.plan.layout import Layout
    from seqpar.plan.recompute import best_mix, layer_modes, resolve_recompute
    from seqpar.plan.report import overrides
    cfg = load_run_config("paper/22b")
    layout = Layout(tp=8, pp=1, dp=1, micro_batch=4, sequence_parallel=True)
    mix = best_mix(cfg.model, layout, GPUS["a100-80gb"].hbm_bytes, 4)
    items, notes = overrides(Layout(8, 1, 1, 1, 4, True, mix), cfg.model, 4, "bf16", 80.0)
    assert "model.recompute=auto" in items and "train.memory_budget_gib=80" in items
    assert "model.recompute_layers=[" in notes[0]
    resolved = resolve_recompute(load_run_config("paper/22b", items))
    assert list(resolved.model.recompute_layers) == layer_modes(mix, 48)


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
    assert re.search(r"does not fit: needs [\d.]+ GiB of 80.00 GiB less the 4.00 GiB headroom on stage 0, "
                     r"over by [\d.]+ GiB; "
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
    assert cli.main(["plan", *argv]) == 2
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
    assert cli.main(["plan", "paper/22b", "--gpus", "8", "--gpu", "h200", "--png", str(tmp_path / "x.png")]) == 2
    assert "--png needs matplotlib" in capsys.readouterr().err


def test_mixes_are_ranked_when_asked(capsys):
    assert plan_cli.main(["paper/22b", "--gpus", "8", "--gpu", "a100-80gb", "--space", "paper", "--mixes"]) == 0
    out = capsys.readouterr().out
    assert "rc=mix(none=" in out



def test_a_config_with_recompute_auto_plans_its_own_per_layer_mix(tmp_path, capsys):
    """No train.memory_budget_gib in the file: the planner resolves auto under the GPU's memory less
    the headroom (80 GiB less 5%)."""
    import yaml
    from seqpar.config.shipped import resolve_config
    data = yaml.safe_load(resolve_config("paper/22b").read_text())
    data["model"]["recompute"] = "auto"
    cfg = tmp_path / "22b_auto.yaml"
    cfg.write_text(yaml.safe_dump(data))
    argv = [str(cfg), "--gpus", "8", "--gpu", "a100-80gb", "--mixes", "--space", "paper", "--top", "3"]
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "the config's own layout (t=8 p=1 m=1 dp=1 b=4 sp=on rc=mix(none=11,sele=37)) ranks #2" in out
