"""`seqpar verify`: every layout trains like one process; planted bugs of each class are named.

The planted bugs are monkeypatches that a ``setup`` function (or the model's builder) applies
inside the spawned ranks, never in this process: a missing all-reduce of the SP norms' gradients
(Megatron-LM #1446), SP-region dropout drawn from the replicated stream (#1256), a recompute that
draws fresh masks, a TP-replicated norm counted once per rank in the global norm (#5916), the
pipeline's tied token table not summed, and padded vocabulary columns left in the softmax.
"""
from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from seqpar.cli import main as seqpar_main
from seqpar.dropin import Plan
from seqpar.errors import UserError
from seqpar.verify import Layout, assert_layouts_equal, parse_layout, parse_layouts, verify

VOCAB, HIDDEN = 64, 32


# ------------------------------------------------------------------ a user's own module and its plan
class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm, self.drop = nn.LayerNorm(HIDDEN), nn.Dropout(dropout)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h] (SP: [b, s/t, h])
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class TinyLM(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())


PLAN = Plan(layers={"emb": "vocab", "blocks.*.norm": "sequence", "blocks.*.up": "column", "blocks.*.down": "row",
                    "norm": "sequence", "head": "vocab"}, sp_start="blocks.0", sp_end="norm", seq_dim=1)


def tiny_lm():
    return TinyLM(), PLAN


def tiny_lm_shared_dropout():
    """Dropout inside the SP region drawn from torch's default generator, seeded alike on every rank."""
    return TinyLM(dropout=0.1), PLAN


# ------------------------------------------------------------------ planted bugs in seqpar's own GPT
def plant_no_sp_grad_allreduce():
    import seqpar.parallel.data_parallel as dp
    dp.sync_sp_replicated_grads = lambda model, group: 0


def plant_sp_dropout_on_replicated_stream():
    from seqpar.model import gpt

    def forward(self, x):
        return x if not self.training or self.p == 0.0 else self.streams.dropout(x, self.p, "replicated")
    gpt.Dropout.forward = forward


def plant_recompute_without_replay():
    import seqpar.recompute as recompute
    recompute.replay_rng = lambda snap, streams=None: contextlib.nullcontext()


def plant_norm_counted_per_tp_rank():
    import seqpar.parallel.grads as grads
    counted = grads.counted_here
    grads.counted_here = lambda module, tp_group=None, **kwargs: counted(module, tp_group=None, **kwargs)


def plant_tied_grads_not_summed():
    import seqpar.parallel.pipeline as pipeline
    pipeline.sum_tied_grads = lambda params, group: None


def plant_vocab_padding_unmasked():
    from seqpar.model import gpt
    ce = gpt.vocab_parallel_cross_entropy
    gpt.vocab_parallel_cross_entropy = lambda logits, labels, **kw: ce(logits, labels, **{**kw, "vocab_size": None})


# ------------------------------------------------------------------------------------------ tests
def test_layout_names():
    assert parse_layout("t2-nosp") == Layout("t2-nosp", tp=2, sp=False)
    assert parse_layout("dp2") == Layout("dp2", dp=2, dp_mode="fsdp")
    assert parse_layout("cp2-ring-t2") == Layout("cp2-ring-t2", tp=2, cp=2, cp_comm="ring")
    assert parse_layout("pp2-dp2-ddp-selective").world == 4
    assert [x.name for x in parse_layouts("t2,pp2")] == ["t2", "pp2"]
    with pytest.raises(UserError, match=r"'t2x' in layout 't2x-nosp'"):
        parse_layout("t2x-nosp")
    with pytest.raises(UserError, match="twice"):
        parse_layouts("t2,t2")


def test_llama_tiny_cpu_passes_every_default_layout(capsys):
    assert seqpar_main(["verify", "llama-tiny-cpu"]) == 0
    out = capsys.readouterr().out
    for layout in ("t2", "t2-nosp", "t2-selective", "t2-full", "t4", "cp2", "cp2-ring", "pp2", "dp2-ddp", "dp2-fsdp"):
        assert f"\n{layout} " in out, out
    assert "worst grad err" in out and out.strip().splitlines()[-1].startswith("PASS: 10 layouts"), out


def test_hugging_face_llama_folder_passes_and_prints_json(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=3,
                             num_attention_heads=8, num_key_value_heads=4).save_pretrained(tmp_path)
    code = seqpar_main(["verify", str(tmp_path), "--layouts", "t2,t2-selective,dp2-ddp,pp2", "--json", "--quiet"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["kind"] == "hf", report
    rows = {r["layout"]: r for r in report["layouts"]}
    assert [rows[n]["status"] for n in ("t2", "t2-selective", "dp2-ddp")] == ["ok"] * 3
    assert rows["pp2"]["status"] == "skipped" and "pipeline" in rows["pp2"]["reason"]
    assert rows["t2"]["grad_err"] < 1e-9 and rows["t2"]["grad_param"].startswith("model.layers.")


def test_module_function_target_passes(capsys):
    assert seqpar_main(["verify", "test_verify:tiny_lm", "--layouts", "t2,t2-nosp,cp2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "cp2 skipped: drop-in plans have no context-parallel attention" in out, out
    assert out.strip().splitlines()[-1].startswith("PASS: 2 layouts"), out


def test_bad_target_is_a_user_error(tmp_path, capsys):
    assert seqpar_main(["verify", "llama-tiny-cpu", "--layouts", "t2,t2x"]) == 2
    assert "seqpar verify: --layouts: 't2x' in layout 't2x' is not a layout token" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(UserError, match="model_type='bert'"):
        verify(str(tmp_path))
    with pytest.raises(UserError, match="no_such_module"):
        verify("no_such_module:build")


PLANTED = {  # setup function -> (layouts, what the report must say)
    "plant_no_sp_grad_allreduce": ("t2", r"gradient of blocks\.\d\.ln[12]\.weight \(rank \d, step 0\)"),
    "plant_sp_dropout_on_replicated_stream": ("t2", r"dropout #\d+ in blocks\.\d\.\S+ .*split tensor .*same mask"),
    "plant_recompute_without_replay": ("t2-selective", r"recompute in blocks\.\d\.attn\S* .*different mask"),
    "plant_norm_counted_per_tp_rank": ("t2", r"global gradient norm differs"),
    "plant_tied_grads_not_summed": ("pp2", r"gradient of wte\.weight \(rank 1, step \d\)"),
    "plant_vocab_padding_unmasked": ("t2", r"wte\.weight: padded vocabulary rows 125\.\.125 got gradient"),
}


@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_planted_bug_is_reported_by_name(plant):
    layouts, pattern = PLANTED[plant]
    report = verify("llama-tiny-cpu", layouts, setup=f"test_verify:{plant}", progress=False)
    assert not report.passed and report.verdict().startswith("FAIL"), report.text()
    row = report.rows[0]
    assert row.layout == layouts and row.status == "FAIL", report.text()
    problems = "\n".join(report.problems())
    import re
    assert re.search(pattern, problems), problems


def test_assert_layouts_equal_names_shared_dropout_masks_in_the_sp_region():
    with pytest.raises(AssertionError, match=r"blocks\.\d\.drop .*split tensor \(SP/TP region\) but TP ranks 0 and 1"):
        assert_layouts_equal(tiny_lm_shared_dropout, layouts=["t2"])


def test_a_spent_time_budget_says_what_was_not_run(capsys):
    assert seqpar_main(["verify", "llama-tiny-cpu", "--layouts", "t2,pp2", "--time-budget", "0", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "t2 not run: the time budget was spent before it started" in out, out
    assert out.strip().splitlines()[-1].startswith("INCOMPLETE: the time budget ran out; not run: t2, pp2"), out


def test_the_pytest_example_in_docs_dropin_runs(tmp_path, monkeypatch):
    """docs/dropin.md's test file, written out and run as it is; with the norms left out of its plan it fails."""
    import importlib
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[1] / "docs" / "dropin.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith("# test_my_model.py"))
    (tmp_path / "test_my_model.py").write_text(code)
    (tmp_path / "my_model_without_norms.py").write_text(
        code.replace('"blocks.*.norm": "sequence", ', "") + "\n\ndef build():\n    return build_model(), PLAN\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the ranks import the builder from here too
    importlib.import_module("test_my_model").test_my_model_trains_identically_in_every_layout()
    with pytest.raises(AssertionError, match=r"t2: gradient of blocks\.\d\.norm\.(weight|bias) \(rank \d, step \d\)"):
        assert_layouts_equal("my_model_without_norms:build", layouts=["t2"], masks=False)


def plant_a_crash():
    raise RuntimeError("planted crash in a rank")


def test_bad_arguments_and_a_crashing_rank(capsys):
    with pytest.raises(UserError, match="steps must be a positive integer, got 0"):
        verify("llama-tiny-cpu", "t2", steps=0)
    with pytest.raises(UserError, match="cannot load setup 'test_verify:nothing_here'"):
        verify("llama-tiny-cpu", "t2", setup="test_verify:nothing_here")
    report = verify("llama-tiny-cpu", "t2", setup="test_verify:plant_a_crash", progress=False)
    assert report.rows[0].status == "error" and "planted crash in a rank" in report.rows[0].reason, report.text()
    assert report.verdict().startswith("FAIL: 1 of 1 layout differ") and not report.passed


def test_hugging_face_gpt2_with_dropout_draws_per_rank_masks_in_the_sp_region(tmp_path):
    """GPT-2's residual and attention dropouts (0.1) run on sequence shards and per-rank heads: the
    ready plan draws them from per-TP-rank streams, the embedding dropout from one generator."""
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                            eos_token_id=0, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1).save_pretrained(tmp_path)
    report = verify(str(tmp_path), "t2,t2-nosp,t2-selective", progress=False)
    assert report.passed and [(r.status, r.masks) for r in report.rows] == [("ok", "ok")] * 3, \
        "\n".join(report.problems())
