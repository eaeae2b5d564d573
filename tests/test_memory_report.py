"""``seqpar memory``: the paper's Figure 1 / Figure 7 numbers, the chart, and measured bytes."""
import re

import pytest
import yaml

from seqpar import cli
from seqpar.memory.formulas import bytes_per_layer


def main(argv: list[str]) -> int:
    """``seqpar memory ARGV`` through the seqpar command: bad input is one line and exit 2."""
    return cli.main(["memory", *argv])

PAPER_PER_GPU = {"22B": ("59.25", "9.56"), "175B": ("66.84", "12.35"), "530B": ("114.02", "23.08"),
                 "1T": ("131.25", "26.56")}
TINY = {"model": {"vocab_size": 128, "seq_len": 32, "hidden": 64, "heads": 4, "layers": 2},
        "parallel": {"tp": 2}, "train": {"micro_batch": 2}, "optim": {"lr": 1e-3}}  # extra sections ignored


def _sections(text: str) -> dict[str, str]:
    """Model name -> the report's table for it."""
    parts = re.split(r"^### (\S+):", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _row(section: str, label: str) -> list[str]:
    line = next(ln for ln in section.splitlines() if ln.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_paper_tables_show_figure_1_and_figure_7(capsys):
    assert main(["--paper"]) == 0
    sections = _sections(capsys.readouterr().out)
    assert list(sections) == list(PAPER_PER_GPU)
    for name, (tp, both) in PAPER_PER_GPU.items():
        assert _row(sections[name], "TP (baseline)")[2] == f"{tp} GiB"
        assert _row(sections[name], "TP + SP + selective")[2] == f"{both} GiB"
    # PAPER.md's per-layer ratios to the TP baseline
    assert [_row(sections["22B"], r)[3] for r in ("TP + SP", "TP + selective", "TP + SP + selective",
                                                   "full recompute")] == ["66.77%", "49.37%", "16.14%", "7.59%"]
    assert _row(sections["175B"], "TP + SP + selective")[3] == "18.48%"
    assert _row(sections["1T"], "full recompute")[3] == "9.52%"


def test_overrides_change_the_shape(capsys, tmp_path):
    assert main(["--paper", "--tp", "4", "--micro-batch", "1"]) == 0
    assert "### 22B: s=2048 b=1 h=6144 a=64 L=48 t=4" in capsys.readouterr().out


def test_png_chart(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "fig7.png"
    assert main(["--png", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_measured_bytes_match_formulas(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    assert main([str(cfg), "--measure"]) == 0
    section = _sections(capsys.readouterr().out)["TINY"]
    for label in ("TP (baseline)", "TP + SP", "TP + selective", "TP + SP + selective", "full recompute"):
        row = _row(section, label)
        assert len(row) == 6 and abs(float(row[5]) - 1) <= 0.02, row


def test_measure_runs_the_configured_attention_kernel(tmp_path, capsys):
    """``model.attention: sdpa`` is measured as sdpa (on CPU at dropout 0.1: PyTorch's composite math
    kernel, in fp32) and compared with that kernel's formula, not Table 2's math attention."""
    cfg = tmp_path / "demo-sdpa.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"vocab_size": 512, "seq_len": 256, "hidden": 256, "heads": 8,
                                             "layers": 2, "attention": "sdpa"},
                                   "parallel": {"tp": 2}, "train": {"micro_batch": 2}}))
    assert main([str(cfg), "--measure"]) == 0
    captured = capsys.readouterr()
    assert "sdpa attention (sdpa-math kernel on CPU)" in captured.err
    section = _sections(captured.out)["DEMO-SDPA"]
    assert "formula, sdpa-math attention (bytes)" in section
    for label in ("TP (baseline)", "TP + SP", "TP + selective", "TP + SP + selective", "full recompute"):
        row = _row(section, label)
        assert len(row) == 7 and abs(float(row[6]) - 1) <= 0.02, row
    table2 = bytes_per_layer("tp", s=256, b=2, h=256, a=8, t=2)  # what math attention keeps
    assert int(_row(section, "TP (baseline)")[4].replace(",", "")) > 1.3 * table2  # fp32 scores and Q, K, V


def test_missing_config_names_the_path(tmp_path, capsys):
    missing = tmp_path / "no-such-model.yaml"
    assert main([str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_config_without_model_section_is_an_error(tmp_path, capsys):
    cfg = tmp_path / "broken.yaml"
    cfg.write_text("train:\n  micro_batch: 1\n")
    assert main([str(cfg)]) == 2
    err = capsys.readouterr().err
    assert str(cfg) in err and "model" in err


def test_measure_refuses_models_too_big_for_this_machine(capsys):
    assert main(["--paper", "--measure"]) == 2
    err = capsys.readouterr().err
    assert "--measure refused" in err and "22B" in err and "1T" in err


def test_measure_checks_divisibility_before_spawning(tmp_path, capsys):
    cfg = tmp_path / "odd.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "parallel": {"tp": 3}}))
    assert main([str(cfg), "--measure"]) == 2
    err = capsys.readouterr().err
    assert str(cfg) in err and "t=3" in err


def test_configs_are_loaded_strictly(tmp_path, capsys):
    cfg = tmp_path / "typo.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "model": {**TINY["model"], "hiden": 64}}))
    assert main([str(cfg)]) == 2
    err = capsys.readouterr().err
    assert str(cfg) in err and "unknown key 'model.hiden'" in err
    cfg.write_text(yaml.safe_dump({**TINY, "parallel": {"tp": "two"}}))
    assert main([str(cfg)]) == 2
    assert "parallel.tp: expected int, got 'two'" in capsys.readouterr().err


def test_shipped_configs_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no configs/ directory here
    assert main(["memory-demo", "paper/175b"]) == 0
    assert list(_sections(capsys.readouterr().out)) == ["MEMORY-DEMO", "175B"]
    assert main(["no-such-config"]) == 2
    err = capsys.readouterr().err
    assert "'no-such-config'" in err and "memory-demo" in err and "paper/175b" in err


def test_measured_first_pipeline_stage_matches_section_4_2_3(tmp_path):
    """pp > 1 (what ``seqpar memory CONFIG --measure`` adds): the first stage's peak during one
    interleaved step, on p x t gloo ranks, equals L (1 + (p-1)/(pm)) layers' worth of Table 2
    (1F1B's L layers: tests/test_pipeline.py)."""
    from seqpar.tools.memory_cli import load_entry
    from seqpar.tools.memory_measure import RANK_TIMEOUT_S, first_stage_table, measure_first_stage
    cfg = tmp_path / "pp.yaml"
    cfg.write_text(yaml.safe_dump({"model": {**TINY["model"], "layers": 4}, "train": {"micro_batch": 1},
                                   "parallel": {"tp": 2, "pp": 2, "virtual_stages": 2}}))
    e = load_entry(cfg)
    stage = first_stage_table(e.shape, measure_first_stage(e.model, e.shape, 300, RANK_TIMEOUT_S))
    assert "interleaved" in stage.splitlines()[0]
    for label in ("TP + SP", "TP + SP + selective"):
        row = _row(stage, label)
        assert abs(float(row[3]) - 1) <= 0.03, row
