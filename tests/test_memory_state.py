"""Training-state bytes have one formula (seqpar.memory.state): the planner and ``seqpar memory
--dp`` print the same figures for every precision x data-parallel mode."""
import pytest

from seqpar.memory.formulas import load_sections
from seqpar.memory.params import layer_params, root_params, stage_params
from seqpar.memory.state import FSDP_UNSHARDED_LAYERS, state_bytes_formula, state_bytes_per_parameter
from seqpar.plan import Layout
from seqpar.plan.layout import check_layout
from seqpar.plan.memory import memory_per_gpu
from seqpar.tools.memory_cli import main

T, DP = 8, 4


def _model():
    return load_sections("paper/175b")[1]["model"]


def _cli_row(capsys, mode: str, precision: str) -> list[str]:
    assert main(["paper/175b", "--tp", str(T), "--dp", str(DP), "--data-parallel", mode,
                 "--precision", precision]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(f"| {DP} | {mode} |"))
    return [c.strip() for c in line.strip("|").split("|")][2:]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_planner_and_seqpar_memory_print_the_same_state(capsys, mode, precision):
    model = _model()
    layout = Layout(tp=T, pp=1, dp=DP, data_parallel=mode)
    parts = memory_per_gpu(model, layout, 80 * 2**30, 64 * DP, precision).parts
    formula = state_bytes_formula(model, t=T, dp=DP, data_parallel=mode, precision=precision)
    planned = [parts["parameters"], parts["gradients"], parts["optimizer"]]
    assert planned == [formula["parameters"], formula["gradients"], formula["optimizer"]]
    assert parts["state_during_step"] == formula["step_transient"]
    cells = [f"{x / 2**30:.3f} GiB" for x in (*planned, sum(planned), parts["state_during_step"])]
    assert _cli_row(capsys, mode, precision) == cells


def test_what_a_rank_holds_per_parameter():
    # ddp: fp32 masters, fp32 grads, AdamW m and v kept; the bf16 recipe adds bf16 copies and grads in a step
    assert [state_bytes_per_parameter("bf16", "ddp").kept, state_bytes_per_parameter("bf16", "ddp").step_copies] == [16, 4]
    assert state_bytes_per_parameter("fp32", "ddp").step_copies == 0
    # fsdp over dp > 1: the same 16 bytes sharded, no whole-model bf16 copies; a gathered unit holds
    # its bf16 compute copy and its fp32 gradient before the reduce-scatter
    per = state_bytes_per_parameter("bf16", "fsdp", dp=DP)
    assert (per.kept, per.sharded, per.step_copies, per.gathered) == (16, True, 0, 2 + 4)
    assert not state_bytes_per_parameter("bf16", "fsdp", dp=1).sharded  # nothing to shard over
    model = _model()
    n, layer, root = stage_params(model, t=T), layer_params(model, T), root_params(model, T)
    b = state_bytes_formula(model, t=T, dp=DP, data_parallel="fsdp", precision="bf16")
    assert sum(b[k] for k in ("parameters", "gradients", "optimizer")) == 16 * n / DP
    assert b["step_transient"] == 6 * (FSDP_UNSHARDED_LAYERS * layer + root)
    with pytest.raises(ValueError, match="precision"):
        state_bytes_per_parameter("fp8", "ddp")
    with pytest.raises(ValueError, match="data_parallel"):
        state_bytes_per_parameter("fp32", "zero3")


def test_the_planner_refuses_fsdp_with_pipeline_stages_like_the_run_config():
    model = _model()
    with pytest.raises(ValueError, match="fsdp with pp=8"):
        check_layout(Layout(tp=8, pp=8, dp=2, data_parallel="fsdp"), model, 128, 64, 8)
