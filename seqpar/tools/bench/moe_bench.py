"""``seqpar bench --moe``: one MoE layer step of seqpar next to Megatron-LM core's ``MoELayer``.

Megatron's layer is its local spec (``SequentialMLP``: one ``MLP`` per expert, a loop over the
experts) with the all-gather token dispatcher (its all-to-all dispatcher needs CUDA streams), a
softmax top-k router in fp32 and no balancing loss; seqpar's is :class:`seqpar.model.moe.MoE`
(grouped GEMM where the CPU allows it). Both get the same weights and the same input on one CPU
rank, in fp32; the table shows the largest output and gradient differences and the median time of
a forward and backward.
"""
from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from ...distributed.local import run_local
from ...distributed.mesh import ParallelMesh
from ...model.config import GPTConfig, MoEConfig
from ...model.moe import LossGradScale, MoE


def _megatron_layer(h: int, f: int, experts: int, top_k: int):
    """Megatron-core's MoELayer (local spec) for SwiGLU experts of width ``f``; call inside its CPU patches."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_world_size() != 1:
        parallel_state.destroy_model_parallel()  # (every rank of the world calls this: new groups are collective)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=1, ffn_hidden_size=f,
                            num_moe_experts=experts, moe_router_topk=top_k, moe_ffn_hidden_size=f,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                            moe_grouped_gemm=False, moe_router_dtype="fp32", use_cpu_initialization=True,
                            perform_initialization=False, params_dtype=torch.float32, hidden_dropout=0.0,
                            bias_activation_fusion=False, gradient_accumulation_fusion=False)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False).submodules.mlp
    return MoELayer(cfg, submodules=spec.submodules)


def _load(theirs, ours: MoE) -> None:
    """seqpar's router and experts into Megatron's layer (both keep ``[gate; up]`` rows in fc1)."""
    params = dict(theirs.named_parameters())
    with torch.no_grad():
        params["router.weight"].copy_(ours.router.weight)
        for e in range(ours.experts.local):
            params[f"experts.local_experts.{e}.linear_fc1.weight"].copy_(ours.experts.w1[e])
            params[f"experts.local_experts.{e}.linear_fc2.weight"].copy_(ours.experts.w2[e])


def _median_step(forward, x: torch.Tensor, g: torch.Tensor, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        x.grad = None
        t0 = time.perf_counter()
        (forward(x) * g).sum().backward()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_rank(rank: int, world: int, shape: dict, repeats: int, warmup: int) -> dict:
    """One rank's comparison (every rank of an initialised world runs it; each compares on its own)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    from .megatron_peer import megatron_patches
    s, b, h, f, E, k = (shape[n] for n in ("seq", "batch", "hidden", "ffn", "experts", "top_k"))
    torch.manual_seed(0)
    cfg = GPTConfig(hidden=h, heads=1, layers=1, seq_len=s, ffn_hidden=f, mlp="swiglu", bias=False,
                    moe=MoEConfig(experts=E, top_k=k))
    ours = MoE(cfg, ParallelMesh.single(), (0.02, 0.02), LossGradScale())
    x, g = torch.randn(s, b, h, requires_grad=True), torch.randn(s, b, h)
    if getattr(moe_utils, "te_general_gemm", None) is None:
        moe_utils.te_general_gemm = None  # Megatron 0.16 names it only when Transformer Engine imports
    with warnings.catch_warnings(), megatron_patches(cpu=True):
        warnings.simplefilter("ignore")
        theirs = _megatron_layer(h, f, E, k)
        _load(theirs, ours)
        out = {"megatron-core": _median_step(lambda y: theirs(y)[0], x, g, repeats, warmup)}
        grad_theirs = x.grad.clone()
        y_theirs = theirs(x)[0].detach()
    out["seqpar"] = _median_step(ours, x, g, repeats, warmup)
    out["output_diff"] = float((ours(x).detach() - y_theirs).abs().max())
    out["input_grad_diff"] = float((x.grad - grad_theirs).abs().max())
    return out


def moe_bench(shape: dict, repeats: int = 10, warmup: int = 2) -> dict:
    """Run the comparison on one local rank (a gloo group of one); ``shape``: seq, batch, hidden,
    ffn, experts, top_k."""
    return run_local(bench_rank, 1, shape, repeats, warmup, timeout=600)[0]


def moe_table(shape: dict, r: dict) -> str:
    """The Markdown table of :func:`moe_bench`'s result."""
    tokens = shape["seq"] * shape["batch"]
    rows = ["| system | median fwd+bwd ms | tokens/s | vs seqpar |", "|---|---|---|---|"]
    for system in ("seqpar", "megatron-core"):
        rows.append(f"| {system} | {r[system] * 1e3:.2f} | {tokens / r[system]:,.0f} | {r[system] / r['seqpar']:.2f} |")
    rows.append(f"\nsame weights and input: max |output diff| {r['output_diff']:.2e}, "
                f"max |input-gradient diff| {r['input_grad_diff']:.2e}")
    return "\n".join(rows)


__all__ = ["bench_rank", "moe_bench", "moe_table"]
