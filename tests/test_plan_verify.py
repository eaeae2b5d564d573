"""``seqpar plan --verify`` agrees with its own plan for every attention kernel (issue 31 item 5): the
dry run runs the kernel the target device runs (a GPU's fused attention keeps no ``as^2`` term),
and the planner's pick for each shipped Llama and GPT config dry-runs within the verify tolerance.
Before the fix, ``attention: sdpa`` ran the math kernel on the fake tensors: llama3-8b's pick
(t=1, dp=8 fsdp, rc=none) measured 8.8x the planner's activations and exited 2."""
import contextlib
import re

import pytest

import seqpar.tools.dryrun as dryrun
from seqpar import cli
from seqpar.config import load_run_config
from seqpar.memory.whole_model import attention_kernel, cuda_sdpa_kernel
from seqpar.tools.dryrun_check import VERIFY_TOLERANCE
from seqpar.tools.dryrun_report import dry_run

_ROW = r"\| {} \| ([\d.]+ [KMG]iB) \| ([\d.]+ [KMG]iB) \| ([\d.]+) \|"

# each shipped Llama and GPT model at its own shapes with 2 layers and 8 sequences per step: a dry run
# costs a second or two. The paper's configs drop their pipeline layout with their layers (the
# planner searches every layout anyway) and plan on fewer GPUs than the paper's, which 2 layers
# cannot fill. The CPU configs (tiny-cpu, memory-demo) are GPT and Llama shapes the tests use elsewhere.
PAPER = ["model.layers=2", "parallel.pp=1", "parallel.virtual_stages=1"]
SHIPPED = [
    ("gpt2-124m", ["model.layers=2"], 8, "h100-sxm"),
    ("gpt-1.3b", ["model.layers=2"], 8, "a100-80gb"),
    ("llama-1b", ["model.layers=2"], 8, "h100-sxm"),
    ("llama3-8b", ["model.layers=2"], 8, "h100-sxm"),     # the pick: t=1 dp=8 (fsdp) rc=none, sdpa
    ("llama3-70b", ["model.layers=2"], 64, "h100-sxm"),
    ("paper/22b", PAPER, 8, "a100-80gb"),
    ("paper/175b", PAPER, 64, "a100-80gb"),
    ("paper/530b", PAPER, 16, "a100-80gb"),
    ("paper/1t", PAPER, 16, "a100-80gb"),
]


@pytest.mark.parametrize("config, overrides, gpus, gpu", SHIPPED, ids=[c for c, *_ in SHIPPED])
def test_plan_verify_of_the_best_layout_agrees_with_the_plan(capsys, config, overrides, gpus, gpu):
    code = cli.main(["plan", config, *overrides, "--gpus", str(gpus), "--gpu", gpu, "--global-batch", "8",
                     "--top", "1", "--verify"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"verify: seqpar train {config} " in out and "DOES NOT FIT" not in out
    for part in ("activations", r"\*\*peak\*\* \(measured terms \+ planner's others\) of [\w-]+'s [\d.]+ GiB: fits"):
        ratios = [float(m.group(3)) for m in re.finditer(_ROW.format(part), out)]
        assert ratios and all(abs(r - 1) <= VERIFY_TOLERANCE for r in ratios), (part, ratios)


# a small Llama layer (GQA: 4 query heads, 2 key/value heads) on one rank, two sequences per micro-batch
SMALL = ["model.vocab_size=64", "model.seq_len=64", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
         "model.layers=2", "model.dropout=0.0", "model.attention_dropout=0.0", "model.recompute=none",
         "parallel.tp=1", "train.micro_batch=2", "train.global_batch=2"]
MHA = "model.kv_heads=4"  # equal head counts: CUDA's memory-efficient kernel takes fp32


@pytest.mark.parametrize("device, overrides, cuda, kernel", [
    ("cuda", ["model.attention=math", "model.attention_dropout=0.1"], None, "math"),  # seqpar's own: Table 2
    ("cuda", ["model.attention=sdpa", "train.precision=bf16"], "flash", "fused"),
    ("cuda", ["model.attention=sdpa", "train.precision=bf16", "model.attention_dropout=0.1"], "flash", "fused"),
    ("cuda", ["model.attention=sdpa", "train.precision=fp32", MHA], "efficient", "fused"),
    ("cuda", ["model.attention=sdpa", "train.precision=fp32"], "math", "sdpa-math"),
    ("cuda", ["model.attention=sdpa", "train.precision=fp32", "model.attention_dropout=0.1"], "math", "sdpa-math"),
    ("cpu", ["model.attention=sdpa", "train.precision=bf16"], None, "fused"),
    ("cpu", ["model.attention=sdpa", "train.precision=bf16", "model.attention_dropout=0.1"], None, "sdpa-math"),
])
def test_the_dry_run_keeps_what_the_target_devices_kernel_keeps(device, overrides, cuda, kernel):
    cfg = load_run_config(None, [*SMALL, *overrides])
    act = 4 if cfg.train.precision == "fp32" else 2
    assert attention_kernel(cfg.model, device, act=act) == kernel
    if cuda is not None:
        m = cfg.model
        assert cuda_sdpa_kernel(dtype_bytes=act, heads=m.heads, kv_heads=m.num_kv_heads, head_dim=m.head_dim) == cuda
    (_, _, check), = dry_run(cfg, 1, [0], device=device, tolerance=0.01)
    measured, planned = next((m, p) for part, m, p in check.rows if part == "activations")
    assert measured / planned == pytest.approx(1, abs=0.01) and not check.problems


def test_verify_fails_when_the_build_keeps_more_than_the_plan(monkeypatch):
    # the dry run before the fix: sdpa on fake tensors ran the math kernel and kept fp32 [b, a, s, s] scores
    monkeypatch.setattr(dryrun, "TargetAttention", lambda device: contextlib.nullcontext())
    cfg = load_run_config(None, [*SMALL, "model.seq_len=4096", "model.attention=sdpa", "train.precision=bf16"])
    (_, _, plain), = dry_run(cfg, 1, [0])
    assert not plain.problems  # a plain dry run checks no ratio
    (_, _, check), = dry_run(cfg, 1, [0], tolerance=VERIFY_TOLERANCE)
    assert len(check.problems) == 1
    assert re.fullmatch(r"rank 0 of 1 measures a peak of [\d.]+ GiB, [\d.]+x the planner's [\d.]+ GiB \(more than 3% "
                        r"off; furthest: activations [\d.]+ GiB measured, [\d.]+ MiB planned\)", check.problems[0])
