"""The mixture-of-experts FFN: a router, routed experts over expert parallelism, shared experts.

``MoE(x)``, ``x [s/t, b, h]`` (SP) or ``[s, b, h]``, each rank routing the tokens it holds:

1. router logits ``[n, E]`` in fp32 whatever the compute dtype; top-k by softmax probabilities
   (Mixtral, Qwen3-MoE) or by sigmoid scores plus a balancing bias (DeepSeek-V3);
2. per-expert counts summed over the micro-batch's token shards (the TP group under SP, the CP group): the
   load-balancing loss, the z-loss and the capacity limit see the whole micro-batch, so they equal
   the one-process model's;
3. assignments sorted by expert, over capacity ones dropped (``capacity_factor``), rows
   exchanged with the expert-parallel ranks (:mod:`seqpar.distributed.expert_dispatch`), one
   grouped GEMM per expert weight (:mod:`seqpar.layers.experts`), and back;
4. each token's k outputs weighted and summed, plus the shared experts (a TP-split MLP).

The auxiliary losses reach backward without changing the model's output: the block output
carries them (:class:`_AttachAux`), and their gradient is the final loss's own gradient
(captured by :func:`capture_loss_grad` on the loss, so gradient accumulation and loss scaling
scale them too).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed.collectives import all_gather_dim0, all_reduce, group_rank, group_size
from ..distributed.expert_dispatch import combine, dispatch
from ..distributed.regions import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
from ..layers.experts import GroupedExperts, inverse_permutation, sort_by_expert
from ..sharding import mark_sp_replicated
from ..errors import UserError
from ..recompute import checkpoint
from .config import GPTConfig
from .mlp import MLP, SwiGLU


class LossGradScale:
    """The gradient the final loss received (a 0-dim tensor), set in backward before any MoE
    layer's backward runs; None until then (the auxiliary losses then get gradient 1)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


class _CaptureLossGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, cell):
        ctx.cell = cell
        return loss.clone()  # a 0-dim copy, not a view (FSDP2 warns about views it returns)

    @staticmethod
    def backward(ctx, grad):
        ctx.cell.value = grad.detach()
        return grad, None


def capture_loss_grad(loss: torch.Tensor, cell: LossGradScale) -> torch.Tensor:
    """``loss`` unchanged; its backward records the incoming gradient in ``cell``."""
    return _CaptureLossGrad.apply(loss, cell)


class _AttachAux(torch.autograd.Function):
    """Identity on ``y``; backward gives the auxiliary loss ``aux`` the loss's gradient."""

    @staticmethod
    def forward(ctx, y, aux, cell):
        ctx.cell = cell
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.cell.value
        one = torch.ones((), dtype=torch.float32, device=grad.device)
        return grad, (one if scale is None else scale.to(one)), None


def in_backward() -> bool:
    """True while autograd's engine runs (a recompute re-running a forward)."""
    return torch._C._current_graph_task_id() != -1


class _RouterLinear(torch.autograd.Function):
    """``x @ weight.T`` in fp32 at least (fp64 stays fp64), keeping ``x`` in its own dtype: the
    MoE input is kept once (the shared experts' fc1 keeps the same tensor), never an fp32 copy."""

    @staticmethod
    def forward(ctx, x, weight):
        dt = torch.promote_types(x.dtype, torch.float32)
        ctx.save_for_backward(x, weight)
        return F.linear(x.to(dt), weight.to(dt))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = (grad @ weight.to(grad.dtype)).to(x.dtype)
        grad_w = (grad.t() @ x.to(grad.dtype)).to(weight.dtype)
        return grad_x, grad_w


class Router(nn.Module):
    """``weight [E, h]`` (and, for ``sigmoid``, a balancing ``expert_bias [E]`` moved by a rule,
    not by gradients). Logits and scores in fp32 (fp64 for an fp64 model)."""

    def __init__(self, hidden: int, moe, dtype: torch.dtype, std: float):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.experts, hidden, dtype=dtype).normal_(0.0, std))
        self.expert_bias = None
        if moe.router == "sigmoid":
            self.expert_bias = nn.Parameter(torch.zeros(moe.experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return _RouterLinear.apply(x, self.weight)  # [n, E]

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(expert ids ``[n, k]``, routing weights ``[n, k]``, and -- only with a balancing loss --
        the per-token probabilities ``[n, E]`` it averages)."""
        moe, probs = self.moe, None
        if moe.router == "softmax":
            scores = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(scores, moe.top_k, dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            ids = torch.topk(scores + self.expert_bias.detach(), moe.top_k, dim=-1)[1]
            weights = scores.gather(-1, ids)
            if moe.aux_loss_coeff > 0:
                probs = scores / scores.sum(-1, keepdim=True)
        if moe.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if moe.router == "sigmoid" else 0.0))
        return ids, weights * moe.route_scale, probs


class MoE(nn.Module):
    """See the module docstring. ``mesh``: its ``tp_group`` (shared experts; the token shards
    under SP) and ``ep_group`` (experts split over it); ``cell``: the GPT's :class:`LossGradScale`."""

    def __init__(self, config: GPTConfig, mesh, layer_std: tuple[float, float], cell: LossGradScale):
        super().__init__()
        moe, h, dt = config.moe, config.hidden, config.torch_dtype
        self.moe, self.cell = moe, cell
        t, sp = mesh.tp_size, config.sequence_parallel
        self.token_group = mesh.tp_group if sp and t > 1 else None  # ranks holding other tokens of the batch
        self.cp_group = mesh.cp_group if mesh.cp_size > 1 else None  # ... and the other chunks of its sequences
        if self.cp_group is not None and moe.capacity_factor is not None:
            raise UserError(f"model.moe.capacity_factor with parallel.cp={mesh.cp_size} is not supported yet")
        self.ep_group, ep, ep_rank = getattr(mesh, "ep_group", None), mesh.ep_size, mesh.ep_rank
        moe.check_experts_parallel(ep)
        f = moe.expert_ffn(config.ffn_hidden)
        self.router = Router(h, moe, dt, layer_std[0])
        swiglu = config.mlp == "swiglu"
        act = SwiGLU() if swiglu else nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        local = moe.experts // ep
        self.tp_group, self.sp = mesh.tp_group, sp
        self.expert_tp = moe.expert_tp and t > 1  # experts split over TP: tokens gathered over TP into them
        self.experts = GroupedExperts(moe.experts, local, ep_rank * local, h, f, act, gated=swiglu,
                                      std=layer_std[0], out_std=layer_std[1], dtype=dt,
                                      sp_replicated=self.token_group is not None,
                                      tp_rank=mesh.tp_rank if self.expert_tp else 0, tp_size=t if self.expert_tp else 1)
        self.shared = None
        if moe.shared_experts:
            shared_cfg = dataclasses.replace(config, ffn_hidden=moe.shared_experts * f, moe=None, bias=False)
            self.shared = MLP(shared_cfg, mesh.tp_group, layer_std)
        if self.token_group is not None:
            mark_sp_replicated(self.router, ["weight"])
        self._recompute = checkpoint if moe.recompute_experts else None  # the experts' fc1 + activation
        self.load: torch.Tensor | None = None  # tokens per expert summed over this step's micro-batches
        self.received_rows: int | None = None  # ep > 1: rows the last forward brought to this rank's experts
        self.dropped: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, shape = self.moe, x.shape
        tokens = x.reshape(-1, shape[-1])                                     # [n, h]
        logits = self.router(tokens)                                          # [n, E] fp32
        ids, weights, probs = self.router.route(logits)
        local_counts = torch.bincount(ids.reshape(-1), minlength=moe.experts)
        counts = local_counts.clone()
        for group in (self.token_group, self.cp_group):                      # the micro-batch's counts
            all_reduce(counts, group)
        n_total = tokens.shape[0] * group_size(self.token_group) * group_size(self.cp_group)
        order, _ = sort_by_expert(ids, moe.experts)
        order, kept = self._capacity(ids, order, local_counts, n_total)
        self._record(counts, kept)
        if self.expert_tp:
            y = self._expert_tp(tokens, ids, weights).view(shape)
        else:
            y = self._routed(tokens, ids, weights, order, kept).view(shape)
        if self.shared is not None:
            y = y + self.shared(x)
        aux = self._aux_loss(logits, probs, counts, n_total)
        return y if aux is None else _AttachAux.apply(y, aux, self.cell)

    def _routed(self, tokens, ids, weights, order, kept) -> torch.Tensor:
        """Rows sorted by expert, to this rank's experts (over ep) and back, each token's k outputs
        weighted and summed: ``[n, h]``."""
        rows = tokens.index_select(0, torch.div(order, self.moe.top_k, rounding_mode="floor"))  # [m, h] by expert
        sent = torch.bincount(ids.reshape(-1).index_select(0, order), minlength=self.moe.experts)
        if group_size(self.ep_group) > 1:
            local_rows, routed = dispatch(rows, sent, self.ep_group)
            self.received_rows = sum(routed.recv_rows)  # this rank's experts' rows (host ints already)
            out_rows = combine(self.experts(local_rows, routed.local_counts, self._recompute), routed, self.ep_group)
        else:
            out_rows = self.experts(rows, sent, self._recompute)
        if kept is None:  # dropless: back to assignment order by a gather, which keeps only its index
            y = out_rows.index_select(0, inverse_permutation(order))
        else:  # dropped assignments stay zero (index_copy also keeps its source)
            y = out_rows.new_zeros(ids.numel(), tokens.shape[-1]).index_copy(0, order, out_rows)
        return (y.view(*ids.shape, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(1)

    def _expert_tp(self, tokens, ids, weights) -> torch.Tensor:
        """Expert-TP = t: every TP rank's experts hold ``f/t`` of each expert, so each needs all the TP
        group's routed tokens. Under SP the tokens and routing weights are all-gathered over TP (g:
        backward reduce-scatter sums the ranks' partial gradients) and the partial outputs
        reduce-scattered back (g-bar); without SP, f and f-bar do the same for replicated tokens."""
        tp = self.tp_group
        if self.sp:
            tokens, weights = gather_from_sp(tokens, tp), gather_from_sp(weights, tp)
            ids = all_gather_dim0(ids.contiguous(), tp)[0]
        else:
            tokens, weights = copy_to_tp(tokens, tp), copy_to_tp(weights, tp)
        order, _ = sort_by_expert(ids, self.moe.experts)
        y = self._routed(tokens, ids, weights, order, None)                # this rank's share of the sum
        return reduce_scatter_to_sp(y, tp) if self.sp else reduce_from_tp(y, tp)

    def _capacity(self, ids, order, local_counts, n_total):
        """(kept assignments in expert order, count of kept) under ``capacity_factor``; the
        positions in an expert's queue are global over the token shards (earlier ranks first)."""
        cf = self.moe.capacity_factor
        if cf is None:
            return order, None
        E, k = self.moe.experts, self.moe.top_k
        capacity = math.ceil(cf * n_total * k / E)
        expert = ids.reshape(-1).index_select(0, order)
        start = torch.cumsum(local_counts, 0) - local_counts                  # first sorted row of each expert
        earlier = all_gather_dim0(local_counts.unsqueeze(0), self.token_group)[0][:group_rank(self.token_group)]
        position = torch.arange(order.numel(), device=order.device) - start[expert] + earlier.sum(0)[expert]
        keep = position < capacity
        kept = keep.sum()
        all_reduce(kept, self.token_group)
        return order[keep], kept

    def _record(self, counts: torch.Tensor, kept: torch.Tensor | None) -> None:
        """Tokens per expert (before capacity) and dropped assignments of a training forward
        (not of a recompute), summed until :func:`take_load` reads them."""
        if not self.training or in_backward():
            return
        c = counts.detach().to(torch.float64)
        dropped = torch.zeros((), dtype=torch.float64, device=c.device) if kept is None else \
            (c.sum() - kept.to(torch.float64))
        self.load = c if self.load is None else self.load + c
        self.dropped = dropped if self.dropped is None else self.dropped + dropped

    def _aux_loss(self, logits, probs, counts, n_total) -> torch.Tensor | None:
        """Load-balancing loss ``coeff E/k sum_e (count_e / n) (sum_t p_te / n)`` and z-loss
        ``coeff mean_t logsumexp(logits_t)^2``, over the micro-batch (summed over its token shards
        by f-bar: forward all-reduce, backward identity)."""
        moe, total = self.moe, None
        if moe.aux_loss_coeff > 0:
            p_sum = reduce_from_tp(reduce_from_tp(probs.sum(0), self.token_group), self.cp_group)
            total = moe.aux_loss_coeff * moe.experts / (moe.top_k * n_total ** 2) * (counts.float() * p_sum).sum()
        if moe.z_loss_coeff > 0:
            z = reduce_from_tp(reduce_from_tp(torch.logsumexp(logits, -1).square().sum(), self.token_group),
                               self.cp_group)
            z = moe.z_loss_coeff * z / n_total
            total = z if total is None else total + z
        return total


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, layer) of every MoE layer of ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameter name -> parameter, for the routed experts' weights (split over ep)."""
    out = {}
    for name, layer in moe_layers(model):
        for pname, p in layer.experts.named_parameters():
            out[f"{name}.experts.{pname}"] = p
    return out


__all__ = ["LossGradScale", "MoE", "Router", "capture_loss_grad", "expert_parameters", "moe_layers"]
