"""The planner's parts: GPU table, kernel times, memory per GPU, time model, layouts."""
from dataclasses import replace

import pytest

from seqpar.memory.formulas import first_stage_bytes, interleave_factor
from seqpar.model.config import GPTConfig
from seqpar.plan.gpus import GIB, GPUS, custom_gpu, get_gpu
from seqpar.plan.kernels import all_reduce_seconds, gather_seconds, gemm_seconds
from seqpar.plan.layout import Layout, Recompute, check_layout, parse_layout
from seqpar.memory.params import stage_params
from seqpar.plan.memory import inflight_layers, memory_per_gpu
from seqpar.plan.paper import paper_run
from seqpar.plan.timing import layer_times, step_time

A100 = GPUS["a100-80gb"]


def test_gpu_table_and_custom():
    assert set(GPUS) == {"a100-80gb", "h100-sxm", "h200"}
    assert get_gpu("A100-80GB") is A100 and A100.hbm_bytes == 80 * GIB
    assert GPUS["h200"].hbm_bytes > GPUS["h100-sxm"].hbm_bytes
    g = custom_gpu(peak_tflops=500, hbm_gib=96, nvlink_gbps=400, ib_gbps=50)
    assert (g.peak_flops, g.hbm_bytes, g.nvlink_bw, g.ib_bw) == (500e12, 96 * GIB, 400e9, 50e9)
    with pytest.raises(ValueError, match=r"'--hbm-gib': -1"):
        custom_gpu(peak_tflops=500, hbm_gib=-1, nvlink_gbps=400, ib_gbps=50)
    with pytest.raises(ValueError, match="unknown GPU 'v100'"):
        get_gpu("v100")


def test_gemm_time_wave_quantization_and_reduction_overhead():
    ideal = 2 * 8192**3 / (A100.peak_flops * A100.gemm_efficiency)
    big = gemm_seconds(A100, 8192, 8192, 8192)  # 32 x 64 tiles = 2048, 18.96 waves -> 19
    assert big == pytest.approx(ideal * 19 / (2048 / 108) * (8192 + A100.gemm_k_overhead) / 8192)
    # four more tiles than one whole wave (108 SMs) cost a second whole wave
    one_wave = gemm_seconds(A100, 256 * 27, 128 * 4, 8192)  # 27 x 4 = 108 tiles
    assert gemm_seconds(A100, 256 * 28, 128 * 4, 8192) == pytest.approx(2 * one_wave)
    # and never faster than streaming its operands: a thin product is memory-bound
    thin = gemm_seconds(A100, 65536, 8, 8192)
    assert thin == pytest.approx(2 * (65536 * 8192 + 8192 * 8 + 65536 * 8) / (A100.hbm_bw * A100.hbm_efficiency))
    # a short reduction (the attention core's K = head dim) is far less efficient per FLOP
    per_flop = lambda m, n, k: gemm_seconds(A100, m, n, k) / (m * n * k)  # noqa: E731
    assert per_flop(2048, 2048, 128) > 2 * per_flop(2048, 2048, 8192)


def test_collectives_are_ring_formulas():
    assert gather_seconds(8e9, 8, 100e9) == pytest.approx(7 / 8 * 0.08)
    assert all_reduce_seconds(8e9, 8, 100e9) == pytest.approx(2 * 7 / 8 * 0.08)
    assert gather_seconds(8e9, 1, 100e9) == 0.0


def test_parameters_of_the_paper_models():
    for name, billions in (("175b", 175), ("530b", 530), ("1t", 1000)):
        run = paper_run(name)
        layout = replace(run.layout, pp=1, virtual_stages=1)  # one stage holds everything, per TP rank
        total = stage_params(run.model, t=layout.tp) * run.layout.tp
        assert total == pytest.approx(billions * 1e9, rel=0.03), name


def test_state_bytes_and_fsdp_sharding():
    run = paper_run("175b")
    layout = run.layout
    mem = memory_per_gpu(run.model, layout, A100.hbm_bytes, 64)
    params = stage_params(run.model, t=layout.tp, pp=layout.pp, stage=mem.stage)
    kept = mem.parts["parameters"] + mem.parts["gradients"] + mem.parts["optimizer"]
    assert kept == 16 * params and mem.parts["state_during_step"] == 4 * params  # bf16 recipe: the bf16 copies
    fsdp = replace(layout, pp=4, dp=2, data_parallel="fsdp")
    sharded = memory_per_gpu(run.model, fsdp, A100.hbm_bytes, 64)
    shard = stage_params(run.model, t=fsdp.tp, pp=fsdp.pp, stage=sharded.stage)
    assert sharded.parts["optimizer"] == pytest.approx(8 * shard / 2)
    assert sharded.parts["parameters"] == pytest.approx(4 * shard / 2)  # no whole-model bf16 copies under fsdp
    assert sharded.parts["state_during_step"] > 0  # the gathered units


def test_the_backward_transient_is_composed_from_the_memory_formulas():
    """seqpar.memory holds the transient's formula and the cp [c, c] block; the planner adds them."""
    from seqpar.memory.transient import backward_transient_bytes, context_block_bytes
    from seqpar.plan.memory import per_layer_activations

    per = {"none": 100.0, "selective": 60.0, "full": 10.0}
    assert backward_transient_bytes(per) == 100
    assert backward_transient_bytes(per, selective=True) == 140  # the attention terms rebuilt
    assert backward_transient_bytes(per, unit_layers=3, selective=True) == 400  # a 3-layer unit rebuilt
    assert context_block_bytes(heads=16, seq_len=2048, micro_batch=2, t=2, cp=1) == 0
    assert context_block_bytes(heads=16, seq_len=2048, micro_batch=2, t=2, cp=4) == 3 * 4 * 2 * 8 * 256 ** 2
    model = GPTConfig(vocab_size=51200, seq_len=2048, hidden=2048, heads=16, layers=24, attention_dropout=0.0)
    for rc, unit, sel in ((Recompute("none"), 0, False), (Recompute("selective"), 0, True),
                          (Recompute("full", "uniform", 2), 2, False), (Recompute("full", "block", 3), 1, False)):
        for cp in (1, 4):
            layout = Layout(tp=2, pp=1, dp=1, micro_batch=2, recompute=rc, cp=cp)
            per = per_layer_activations(model, layout)
            want = backward_transient_bytes(per, unit_layers=unit, selective=sel) + context_block_bytes(
                heads=16, seq_len=2048, micro_batch=2, t=2, cp=cp)
            assert memory_per_gpu(model, layout, A100.hbm_bytes, 8).parts["backward_transient"] == want, (rc, cp)


def test_first_stage_in_flight_is_the_papers_interleave_factor():
    for p, m in ((8, 3), (35, 3), (64, 1), (4, 2)):
        layout = Layout(tp=8, pp=p, dp=1, virtual_stages=m)
        assert inflight_layers(layout, 1000, 0) == pytest.approx(p * interleave_factor(p, m))
        assert first_stage_bytes(1, L=96, p=p, m=m) == pytest.approx(96 / p * inflight_layers(layout, 1000, 0))
    assert inflight_layers(Layout(tp=8, pp=8, dp=1), 3, 0) == 3  # fewer micro-batches than stages
    assert inflight_layers(Layout(tp=8, pp=8, dp=1), 64, 7) == 1  # the last stage holds one


def test_overflow_names_the_term_and_the_amount():
    run = paper_run("175b")
    mem = memory_per_gpu(run.model, replace(run.layout, recompute=Recompute("none")), A100.hbm_bytes, 64)
    assert not mem.fits
    msg = mem.overflow()
    over = (mem.total - mem.capacity) / GIB
    assert f"over by {over:.2f} GiB" in msg and "activations" in msg


def test_recompute_costs_time_sequence_parallel_saves_it():
    run = paper_run("22b")
    t = {k: step_time(run.model, replace(run.layout, recompute=Recompute(k)), A100, 4).seconds
         for k in ("none", "selective", "full")}
    assert t["none"] < t["selective"] < t["full"]
    assert 1.02 < t["selective"] / t["none"] < 1.08  # Table 4: +4% for selective + SP
    lt_sp = layer_times(run.model, run.layout, A100)
    lt_tp = layer_times(run.model, replace(run.layout, sequence_parallel=False), A100)
    assert lt_sp.forward < lt_tp.forward  # Table 4: 7.2 ms against 7.7 ms


def test_bubble_is_p_minus_1_over_m_n():
    run = paper_run("175b")
    st = step_time(run.model, run.layout, A100, 64)
    per_micro = (st.parts["layers"] + st.parts["p2p"]) / 64
    assert st.parts["bubble"] == pytest.approx(per_micro * 7 / 3)  # (p-1)/(m n) of n micro-batches


def test_data_parallel_reduction_is_partly_hidden():
    model = GPTConfig(vocab_size=51200, seq_len=2048, hidden=4096, heads=32, layers=32)
    for b in (1, 8):
        layout = Layout(tp=8, pp=1, dp=16, micro_batch=b, sequence_parallel=True)
        st = step_time(model, layout, A100, 16 * b)
        assert 0 < st.parts["data_parallel"]
    layout = Layout(tp=8, pp=1, dp=16, micro_batch=1, sequence_parallel=True)
    assert step_time(model, layout, A100, 16).parts["data_parallel"] > \
        step_time(model, replace(layout, micro_batch=8), A100, 128).parts["data_parallel"]


def test_parse_layout_and_its_errors():
    layout = parse_layout("tp=8,pp=8,virtual_stages=3,micro_batch=1,sequence_parallel=true,recompute=selective", 64)
    assert layout == Layout(8, 8, 1, 3, 1, True, Recompute("selective"))
    full = parse_layout("tp=4,recompute=full,recompute_method=block,recompute_num_layers=2", 8)
    assert full.dp == 2 and full.recompute == Recompute("full", "block", 2)
    for text, match in (("tp=3", "does not divide --gpus 8"), ("bogus=1", "'bogus=1'"),
                        ("recompute=some", "recompute='some'"), ("tp=0", "tp='0'"),
                        ("sequence_parallel=yes", "sequence_parallel='yes'")):
        with pytest.raises(ValueError, match=match):
            parse_layout(text, 8)


def test_check_layout_names_the_values():
    run = paper_run("175b")
    with pytest.raises(ValueError, match=r"layers 96 not divisible by pp x virtual_stages = 40"):
        check_layout(Layout(8, 8, 1, 5, 1), run.model, 64, 64, 8)
    with pytest.raises(ValueError, match=r"!= --gpus 128"):
        check_layout(run.layout, run.model, 128, 64, 8)
    with pytest.raises(ValueError, match=r"tp=16 must divide --gpus-per-node 8"):
        check_layout(Layout(16, 4, 1, 1, 1), run.model, 64, 64, 8)
    with pytest.raises(ValueError, match=r"global batch 63 is not a multiple"):
        check_layout(Layout(8, 8, 1, 1, 2), run.model, 64, 63, 8)
