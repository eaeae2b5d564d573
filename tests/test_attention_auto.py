"""``model.attention: auto`` (issue 33 item 1): PyTorch's fused kernels on CUDA, seqpar's math core
where the paper's Table 2 is reproduced (the CPU, where the memory checks measure). The GPU itself
is not here: the resolution is tested with a device argument, and a dry run for CUDA builds it."""
import dataclasses

import pytest
import torch

from gpt_helpers import batch, loss_and_dense_grads, tiny_config
from seqpar.config import ConfigError, load_run_config
from seqpar.memory.ledger import ActivationLedger
from seqpar.memory.whole_model import attention_kernel, layer_bytes
from seqpar.model import GPT
from seqpar.model.modes import resolve_attention


def test_auto_resolves_to_sdpa_on_cuda_and_to_math_on_the_cpu():
    assert resolve_attention("auto", "cuda") == "sdpa" and resolve_attention("auto", torch.device("cuda", 1)) == "sdpa"
    assert resolve_attention("auto", "cpu") == "math" and resolve_attention("auto", "meta") == "math"
    assert resolve_attention("math", "cuda") == "math" and resolve_attention("sdpa", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="'flash'"):
        resolve_attention("flash", "cuda")
    auto = tiny_config(attention="auto", dropout=0.1, attention_dropout=0.1)
    core = GPT(auto).blocks[0].attn.core
    assert core.kernel(torch.device("cuda")) == "sdpa" and core.kernel(torch.device("cpu")) == "math"


def test_auto_keeps_table_2_where_it_is_reproduced():
    """On the CPU auto is the math core: the same bytes per layer as ``attention: math`` (Table 2's
    ``5as^2b`` under none), the same loss and gradients; the planner's GPUs count the fused kernel."""
    auto, math = (tiny_config(attention=a, dropout=0.1, attention_dropout=0.1, sequence_parallel=False)
                  for a in ("auto", "math"))
    assert attention_kernel(auto, "cpu") == "math" and attention_kernel(auto, "cuda") == "fused"
    dims = dict(s=auto.seq_len, b=2, t=1, act=4, device="cpu")
    for mode in ("none", "selective"):
        assert layer_bytes(auto, mode, **dims) == layer_bytes(math, mode, **dims)
    fused = dataclasses.replace(auto, attention="sdpa")
    assert layer_bytes(auto, "none", **dict(dims, device="cuda")) == layer_bytes(fused, "none", **dict(dims, device="cuda"))
    measured, results = [], []
    for cfg in (auto, math):
        model = GPT(cfg, seed=1)
        with ActivationLedger(model) as ledger:
            results.append(loss_and_dense_grads(model, *batch(cfg)))
        measured.append(ledger.per_layer())
    assert measured[0] == measured[1]
    (la, ga), (lm, gm) = results
    assert torch.equal(la, lm) and all(torch.equal(ga[k], gm[k]) for k in gm)


def test_the_config_takes_auto_and_names_it_among_the_choices():
    assert load_run_config("tiny-cpu", ["model.attention=auto"]).model.attention == "auto"
    with pytest.raises(ConfigError, match=r"model.attention: expected one of \['auto', 'math', 'sdpa'\], got 'flash'"):
        load_run_config("tiny-cpu", ["model.attention=flash"])


SMALL = ["model.vocab_size=64", "model.seq_len=64", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
         "model.layers=2", "model.dropout=0.0", "model.attention_dropout=0.0", "model.recompute=none",
         "parallel.tp=1", "train.micro_batch=2", "train.global_batch=2", "train.precision=bf16",
         "model.attention=auto"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_dry_run_builds_the_target_devices_kernel_for_auto(device):
    """The dry run's fake tensors are CPU tensors: without resolving for the target, auto built the
    math core for a CUDA target while the planner counted the fused kernel."""
    from seqpar.tools.dryrun_report import dry_run
    cfg = load_run_config(None, SMALL)
    (_, _, check), = dry_run(cfg, 1, [0], device=device, tolerance=0.01)
    measured, planned = next((m, p) for part, m, p in check.rows if part == "activations")
    assert measured / planned == pytest.approx(1, abs=0.01) and not check.problems
