"""The MoE layer's bytes: what its FFN keeps for backward, and what its all-to-alls carry.

Per MoE layer and micro-batch, on one rank holding ``n = s b / t`` tokens (SP; ``s b`` without),
each routed to ``k`` of ``E`` experts: ``m = n k`` assignments (dropless) and ``m'`` rows reaching
this rank's experts (``m`` without expert parallelism; with ep, ``m`` on average and whatever the
router sent in fact). ``a``: activation bytes; ``f``: the expert width; ``f_s``: the shared experts'.
The terms replace the dense MLP's fc1 input, activation input and fc2 input:

====================================  ==============================================
MoE input (router, shared fc1)        ``n h a`` (the router keeps it in its own dtype)
router probabilities / scores         ``4 n E`` (fp32)
top-k indices                         ``8 n k``
top-k normalisation (``norm_topk``)   ``4 n k + 4 n``
balancing probabilities (sigmoid)     ``4 n`` (with a balancing loss)
routing weights                       ``a n k``
permutation indices                   ``16 m`` (gather and scatter back); ``+ 16 m'`` under ep
expert rows, act input, fc2 input     ``m' h a``, ``m' f a`` (x2 for SwiGLU), ``m' f a``
grouped GEMM offsets                  ``4 E/ep`` per GEMM run as ``torch._grouped_mm``
combined outputs                      ``m h a`` (the weighted sum keeps them)
balancing loss / z-loss               ``4 E`` / ``4 n E + 4 n``
shared experts                        the dense MLP's activation and fc2 inputs at ``f_s``
====================================  ==============================================

Recomputing the expert activation (``moe.recompute_experts``, the MLP's choice after fused attention,
``docs/memory.md``) drops the ``m' f a`` (x2 for SwiGLU) term and fc1's offsets, and keeps the
per-expert counts (``8 E/ep``) instead. A capacity
factor caps ``m`` at the kept assignments and its scatter keeps the rows once more (``m h a``).
Expert-TP = t (``moe.expert_tp``): under SP the experts see the TP group's ``t n`` tokens (``m = t n k``,
routing weights ``a t n k``) at width ``f/t``.
"""
from __future__ import annotations

from fractions import Fraction

from ..layers.experts import grouped_mm_supported
from ..model.config import GPTConfig


def _grouped_gemms(cfg: GPTConfig, f: int, device: str, act: int, first_only: bool = False) -> int:
    """How many of the two expert GEMMs (``first_only``: whether fc1) run as ``torch._grouped_mm`` at
    ``act``-byte rows on ``device``."""
    import torch
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[act]
    rows = 2 * f if cfg.mlp == "swiglu" else f
    fc1 = grouped_mm_supported(device, dtype, rows, cfg.hidden)
    return fc1 if first_only else fc1 + grouped_mm_supported(device, dtype, cfg.hidden, f)


def moe_ffn_terms(cfg: GPTConfig, *, s: int, b: int, t: int, act: int, ep: int = 1, received: int | None = None,
                  device: str = "cuda") -> dict[str, Fraction]:
    """Bytes one MoE layer's FFN keeps for one micro-batch (the table above; dropless)."""
    moe, h = cfg.moe, cfg.hidden
    E, k = moe.experts, moe.top_k
    f = moe.expert_ffn(cfg.ffn_hidden)
    n = Fraction(s * b, t if cfg.sequence_parallel else 1)
    etp = moe.expert_tp and t > 1  # expert-TP: the TP group's tokens gathered into f/t of every expert
    n_in = n * t if etp and cfg.sequence_parallel else n
    fe = f // t if etp else f  # each expert's width on this rank
    m = n_in * k
    m_in = m if received is None else Fraction(received)
    gated = 2 if cfg.mlp == "swiglu" else 1
    terms = {"moe_input": n * h * act, "router_probs": 4 * n * E, "topk_indices": 8 * n * k,
             "routing_weights": act * n_in * k, "permutation_indices": 16 * m + (16 * m_in if ep > 1 else 0),
             "expert_rows": m_in * h * act, "expert_act_input": gated * m_in * fe * act,
             "expert_fc2_input": m_in * fe * act, "combined_outputs": m * h * act}
    if moe.norm_topk:
        terms["topk_norm"] = 4 * n * k + 4 * n
    if moe.router == "sigmoid" and moe.aux_loss_coeff > 0:
        terms["balancing_probs"] = 4 * n
    if moe.aux_loss_coeff > 0:
        terms["aux_loss"] = Fraction(4 * E)
    if moe.z_loss_coeff > 0:
        terms["z_loss"] = 4 * n * E + 4 * n
    gemms = _grouped_gemms(cfg, fe, device, act)
    if moe.recompute_experts:  # fc1 + activation recomputed: their inputs' counts kept instead
        del terms["expert_act_input"]
        gemms = gemms - 1 if _grouped_gemms(cfg, fe, device, act, first_only=True) else gemms
        terms["expert_counts"] = Fraction(8 * E // ep)
    if gemms:
        terms["grouped_mm_offsets"] = Fraction(gemms * 4 * E // ep)  # int32 [E/ep] per grouped GEMM
    if moe.shared_experts:
        fs = moe.shared_experts * f
        terms["shared_act_input"] = Fraction(gated * s * b * fs * act, t)
        terms["shared_fc2_input"] = Fraction(s * b * fs * act, t)
    return terms


def all_to_all_bytes(cfg: GPTConfig, *, s: int, b: int, t: int, act: int, ep: int) -> dict[str, int]:
    """Bytes the ``ep`` ranks of one expert-parallel group hand to their all-to-alls for one MoE
    layer and micro-batch (each rank's whole input tensor, its own share included, as the
    communication counter records them), dropless: per rank ``E`` int64 counts, then its ``n k``
    rows out and the same rows back, forward; backward the rows again both ways. On the wire a
    rank sends ``(ep-1)/ep`` of its rows when the load is even."""
    n = s * b // (t if cfg.sequence_parallel and not (cfg.moe.expert_tp and t > 1) else 1)  # expert-TP: gathered
    rows = n * cfg.moe.top_k * cfg.hidden * act
    return {"counts": ep * cfg.moe.experts * 8, "forward_rows": ep * 2 * rows, "backward_rows": ep * 2 * rows}


def all_to_all_wire_bytes(cfg: GPTConfig, *, s: int, b: int, t: int, act: int, ep: int) -> Fraction:
    """Bytes one rank sends to the other ranks in ONE row all-to-all of one MoE layer and micro-batch
    (dispatch or combine: forward runs two, backward two, a full recompute's second forward two
    more), dropless with an even load: its ``n k`` rows of ``h``
    elements (:func:`all_to_all_bytes`' ``forward_rows / (2 ep)``) of which ``(ep-1)/ep`` leave it,
    ``n k h a (ep-1)/ep`` with ``n`` the tokens it routes (``s b / t`` under SP, ``s b`` without or
    under expert-TP)."""
    rows = all_to_all_bytes(cfg, s=s, b=b, t=t, act=act, ep=ep)["forward_rows"]
    return Fraction(rows, 2 * ep) * Fraction(ep - 1, ep)


def expert_layer_comm(cfg: GPTConfig, *, s: int, b: int, t: int, act: int, ep: int,
                      recompute: str = "selective") -> dict[str, tuple[int, int]]:
    """The all-to-alls over ep ONE rank issues in one MoE layer for one micro-batch, forward and
    backward: ``{"all_to_all": (calls, bytes)}``, the bytes as the communication counter records
    them (each call's whole input, :func:`all_to_all_bytes` divided by ``ep``), dropless with an even
    load: the counts, the rows out and back; backward the rows both ways (the counts carry no
    gradient); a full recompute repeats the forward's three. Nothing at ``ep = 1``."""
    if ep == 1:
        return {}
    one = all_to_all_bytes(cfg, s=s, b=b, t=t, act=act, ep=ep)
    calls, nbytes = 5, one["counts"] + one["forward_rows"] + one["backward_rows"]
    if recompute == "full":
        calls, nbytes = calls + 3, nbytes + one["counts"] + one["forward_rows"]
    return {"all_to_all": (calls, nbytes // ep)}


def moe_layer_comm(cfg: GPTConfig, *, s: int, b: int, t: int, act: int,
                   recompute: str = "selective") -> dict[str, tuple[int, int]]:
    """The TP collectives seqpar's MoE layer issues for one micro-batch, forward and backward, as
    :func:`seqpar.memory.comm.layer_comm` counts a dense layer's (``kind -> (calls, bytes)``):
    attention's half of them; the MLP's half again for shared experts (a TP-split MLP); under
    expert-TP the tokens and routing weights brought to the experts (g, or f without SP) and the
    outputs back (g-bar, f-bar), the expert ids gathered; under SP the router's sums over the TP
    group (the counts, ``E`` int64; the balancing loss's probabilities, ``E`` fp32; the z-loss, one
    fp32; a capacity's counts gathered and kept ones summed). A full recompute repeats the forward's."""
    from .comm import layer_comm
    if t == 1:
        return {}
    moe, h, sp = cfg.moe, cfg.hidden, cfg.sequence_parallel
    dense = layer_comm(s=s, b=b, h=h, t=t, act=act, sequence_parallel=sp, recompute=recompute)
    halves = 2 if moe.shared_experts else 1
    out = {kind: [c // 2 * halves, n // 2 * halves] for kind, (c, n) in dense.items()}
    r = 8 if act == 8 else 4                    # the router's dtype: fp32 (fp64 for an fp64 model)
    fwd: list[tuple[str, int]] = []             # (kind, bytes) of the forward's collectives
    n_all = s * b                               # the TP group's tokens
    if moe.expert_tp:
        tokens, weights = n_all * h * act, n_all * moe.top_k * r
        if sp:
            fwd += [("all_gather", tokens), ("all_gather", weights), ("all_gather", n_all * moe.top_k * 8),
                    ("reduce_scatter", tokens)]
            bwd = [("reduce_scatter", tokens), ("reduce_scatter", weights), ("all_gather", tokens)]
        else:
            fwd, bwd = [("all_reduce", tokens)], [("all_reduce", tokens), ("all_reduce", weights)]
    else:
        bwd = []
    if sp:
        fwd += [("all_reduce", moe.experts * 8)]
        fwd += [("all_reduce", moe.experts * r)] if moe.aux_loss_coeff > 0 else []
        fwd += [("all_reduce", r)] if moe.z_loss_coeff > 0 else []
        fwd += [("all_gather", t * moe.experts * 8), ("all_reduce", 8)] if moe.capacity_factor is not None else []
    for kind, nbytes in fwd * (2 if recompute == "full" else 1) + bwd:
        row = out.setdefault(kind, [0, 0])
        row[0], row[1] = row[0] + 1, row[1] + nbytes
    return {kind: (c, n) for kind, (c, n) in out.items()}


__all__ = ["all_to_all_bytes", "all_to_all_wire_bytes", "expert_layer_comm", "moe_ffn_terms", "moe_layer_comm"]
