"""`seqpar plan` with expert parallelism: state bytes of E/ep experts, the all-to-alls' bytes and
time, a search that picks ep where the experts dominate memory, and `--layout ep=N` checks."""
import dataclasses
import re
from fractions import Fraction

import pytest

from seqpar import cli
from seqpar.memory.moe import all_to_all_wire_bytes
from seqpar.memory.params import expert_params, stage_params
from seqpar.model import GPT, GPTConfig
from seqpar.model.config import MoEConfig
from seqpar.plan.experts import expert_comm
from seqpar.plan.gpus import GPUS
from seqpar.plan.kernels import link_bandwidth
from seqpar.plan.layout import Layout
from seqpar.plan.memory import state_parts
from seqpar.plan.report import overrides
from seqpar.plan.search import Problem, SearchSpace, evaluate, search
from seqpar.plan.timing import layer_times

H100 = GPUS["h100-sxm"]


def tiny(**moe) -> GPTConfig:
    """h=16, 4 SwiGLU experts of f=16 (3 x 16 x 16 = 768 parameters each), the first of 3 layers dense."""
    settings = dict(experts=4, top_k=2, first_dense=1)
    settings.update(moe)
    return GPTConfig(vocab_size=64, seq_len=8, hidden=16, heads=2, layers=3, ffn_hidden=16, dropout=0.0,
                     attention_dropout=0.0, mlp="swiglu", norm="rmsnorm", bias=False, recompute="none",
                     dtype="float32",
                     moe=MoEConfig(**settings))


def test_state_bytes_count_e_over_ep_experts_as_the_built_model_holds_them():
    cfg = tiny()
    model = GPT(cfg)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 2 * 4 * 768  # two MoE layers of four experts
    total = model.num_parameters(dense=False)
    layer = [sum(p.numel() for p in block.parameters()) for block in model.blocks]  # dense, MoE, MoE
    root = total - sum(layer)
    for ep in (1, 2, 4):
        assert expert_params(cfg, 1, ep=ep) == experts // ep == 2 * (4 // ep) * 768
        assert stage_params(cfg, t=1, ep=ep) == total - experts + experts // ep
        ddp = state_parts(cfg, Layout(1, 1, 4, ep=ep), 0, "bf16")  # fp32 masters, grads, AdamW; bf16 copies
        assert ddp["parameters"] + ddp["gradients"] + ddp["optimizer"] == 16 * (total - experts + experts // ep)
        assert ddp["state_during_step"] == 4 * (total - experts + experts // ep)
        fsdp = state_parts(cfg, Layout(1, 1, 4, data_parallel="fsdp", ep=ep), 0, "bf16")
        edp = 4 // ep  # the experts shard over the expert-data-parallel ranks, the rest over dp
        mine = experts // ep // (edp if edp > 1 else 1)  # edp = 1: the experts stay whole on their rank
        assert fsdp["optimizer"] == pytest.approx(8 * ((total - experts) / 4 + mine))
        # gathered during a step: bf16 copy + fp32 gradient of two units (the largest layer without its
        # experts, and one MoE layer's experts) and the root; edp = 1: the experts' bf16 copies instead
        unit = max(layer[0], layer[1] - experts // 2)
        gathered = 6 * (2 * unit + root) + (6 * 2 * experts // 2 // ep if edp > 1 else 4 * experts // ep)
        assert fsdp["state_during_step"] == gathered


def test_all_to_all_bytes_are_tokens_times_k_h_a_times_the_share_that_leaves():
    cfg = tiny()
    s, b, k, h = 8, 2, 2, 16
    for t, sp in ((1, False), (2, True), (2, False)):
        c = dataclasses.replace(cfg, sequence_parallel=sp)
        n = s * b // (t if sp else 1)  # tokens a rank routes: its SP shard, or every token without SP
        for ep in (1, 2, 4):
            assert all_to_all_wire_bytes(c, s=s, b=b, t=t, act=2, ep=ep) == Fraction(n * k * h * 2 * (ep - 1), ep)
    etp = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_tp=True))  # tokens gathered over TP
    assert all_to_all_wire_bytes(etp, s=s, b=b, t=2, act=2, ep=2) == s * b * k * h * 2 // 2


def test_all_to_alls_are_priced_four_per_moe_layer_on_the_link_the_ep_group_uses():
    cfg = dataclasses.replace(tiny(), seq_len=4096, hidden=4096, heads=32, ffn_hidden=4096)
    wire = 4096 * 2 // 2 * 2 * 4096 * 2 * 3 / 4  # s b / t tokens x k x h x 2 bytes x (ep-1)/ep
    for t, ep, intra in ((2, 4, True), (2, 8, False)):  # the ep ranks lie t apart: t x ep GPUs
        layout = Layout(t, 1, 8, micro_batch=2, ep=ep)
        one = wire * (ep - 1) / ep / (3 / 4) / link_bandwidth(H100, intra) + H100.collective_latency
        fwd, bwd = expert_comm(cfg, layout, H100, 2, gpus_per_node=8)
        assert fwd == pytest.approx(2 * one + H100.collective_latency) and bwd == pytest.approx(2 * one)
        lt = layer_times(cfg, layout, H100, "bf16", gpus_per_node=8)
        assert lt.ep_comm == pytest.approx((fwd + bwd) * 2 / 3)  # two MoE layers of three
    assert layer_times(cfg, Layout(2, 1, 8, micro_batch=2), H100).ep_comm == 0.0


def test_search_picks_ep_where_the_experts_do_not_fit_replicated():
    moe = MoEConfig(experts=64, top_k=4, ffn_hidden=2816)  # 7.75B expert parameters, 0.6B others
    cfg = GPTConfig(vocab_size=32000, seq_len=2048, hidden=2048, heads=16, kv_heads=4, layers=7, ffn_hidden=5632,
                    mlp="swiglu", norm="rmsnorm", position="rope", bias=False, dropout=0.0, attention_dropout=0.0,
                    tie_embeddings=False, moe=moe)
    problem = Problem(cfg, 16, H100, 64)
    best = search(problem, SearchSpace(tp=(1, 2)), k=3).ranked[0]
    assert best.layout.ep > 1 and best.memory.fits and f"ep={best.layout.ep}" in best.layout.label()
    assert not evaluate(problem, dataclasses.replace(best.layout, ep=1, data_parallel="ddp")).memory.fits


def test_dense_models_search_no_ep():
    cfg = dataclasses.replace(tiny(), moe=None)
    ranked = search(Problem(cfg, 4, H100, 8), SearchSpace(tp=(1,), recompute=("none",))).ranked
    assert ranked and all(c.layout.ep == 1 for c in ranked)


MIXTRAL = ["mixtral-8x7b", "--gpus", "64", "--gpu", "h100-sxm"]


@pytest.mark.parametrize("argv, message", [
    ([*MIXTRAL, "--layout", "tp=8,ep=3"], r"ep=3 does not divide the 8 experts of model\.moe\.experts; "
                                          r"ep=3 does not divide dp x cp = 8 x 1 = 8"),
    ([*MIXTRAL, "--layout", "tp=8,pp=2,ep=2"], r"ep=2 with pp=2 is not planned yet"),
    (["llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--layout", "tp=2,ep=2"], r"ep=2 splits experts, but the "
                                                                                r"model has none"),
    ([*MIXTRAL, "--layout", "tp=8,ep=0"], r"--layout ep='0': expected a positive integer"),
])
def test_bad_ep_is_refused_naming_the_values(capsys, argv, message):
    assert cli.main(["plan", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_one_ep_layout_prints_ep_in_its_label_and_the_overrides_name_it(capsys):
    # 102 GiB per GPU (FSDP2 leaves one whole expert per rank of edp=2): an H200's layout, not an H100's
    assert cli.main(["plan", "mixtral-8x7b", "--gpus", "64", "--gpu", "h200", "--layout",
                     "tp=4,ep=8,data_parallel=fsdp"]) == 0
    assert "layout: t=4 p=1 m=1 dp=16(fsdp) ep=8 b=1" in capsys.readouterr().out
    for ep in (8, 1):  # ep=1 too: it replaces the config's own parallel.ep
        items, _ = overrides(Layout(4, 1, 16, ep=ep, data_parallel="fsdp"), tiny(), 64, "bf16")
        assert f"parallel.ep={ep}" in items
    assert not any("parallel.ep" in i for i in overrides(Layout(4, 1, 16), dataclasses.replace(tiny(), moe=None),
                                                         64, "bf16")[0])


def test_per_kind_counts_equal_the_per_layer_sums_and_the_trainers_flops():
    from seqpar import flops
    from seqpar.memory.params import layer_params, root_params
    from seqpar.plan.timing import step_time
    cfg = dataclasses.replace(tiny(every=2, shared_experts=1, router="sigmoid"), layers=8)  # MoE: layers 1, 3, 5, 7
    for pp in (1, 2, 4):
        for stage in range(pp):
            ids = range(stage * 8 // pp, (stage + 1) * 8 // pp)
            for ep in (1, 2):
                layers = sum(layer_params(cfg, 1, layer=i, ep=ep) for i in ids)
                ends = root_params(cfg, 1, first=stage == 0, last=stage == pp - 1, pp=pp)
                assert stage_params(cfg, t=1, pp=pp, stage=stage, ep=ep) == layers + ends
    assert flops.layers_forward_flops(cfg, B=2) == sum(flops.config_layer_forward_flops(cfg, B=2, layer=i)
                                                         for i in range(8))
    plan = step_time(cfg, Layout(1, 1, 4, micro_batch=2, ep=2), H100, global_batch=16)
    assert plan.model_flops == flops.step_model_flops(cfg, sequences=16)  # what the Trainer's MFU divides by


def test_recompute_auto_plans_the_runs_ep():
    from seqpar.errors import UserError
    from seqpar.memory.formulas import load_sections
    from seqpar.plan.recompute import auto_recompute_layers
    need = {}
    for ep in (1, 8):
        _, s = load_sections("mixtral-8x7b", ["parallel.pp=1", "parallel.dp=8", f"parallel.ep={ep}",
                                              "parallel.data_parallel=ddp"])
        with pytest.raises(UserError, match=f"t=4 p=1 m=1 dp=8 {'ep=8 ' if ep > 1 else ''}b=1") as err:
            auto_recompute_layers(s["model"], s["parallel"], s["train"], 30)
        need[ep] = float(re.search(r"smallest that fits is ([\d.]+) GiB", str(err.value)).group(1))
    assert need[1] > need[8] + 50  # ddp: every expert of every layer on each rank, or one of eight


def test_an_overflow_no_single_term_can_absorb_says_so(capsys):
    """Mixtral at t=1 over FSDP2 with ep=8 (a whole expert per layer on every rank) is 47 GiB over an
    H100, more than its largest term: before, the line asked the optimizer to shrink to -2.63 GiB."""
    cli.main(["plan", *MIXTRAL, "--layout", "tp=1,dp=64,ep=8,micro_batch=8,sequence_parallel=false,recompute=full,"
              "data_parallel=fsdp"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("does not fit"))
    assert "more than even the largest term, optimizer (42.19 GiB), holds" in line and "to -" not in line, line
