"""The PyTorch-native peer: a plain GPT parallelized from outside with DTensor tensor parallelism.

The model is seqpar's architecture written in plain PyTorch, batch-first ``[b, s, h]``: learned
positions, pre-LN blocks with separate q/k/v projections, math attention (QK^T, softmax, @V), GeLU
MLP of 4h, final LayerNorm, LM head tied to the token embedding. ``parallelize_module`` then applies
torchtitan's Llama plan: the vocabulary-parallel embedding reduce-scatters into the sequence shard
``[b, s/t, h]``, LayerNorms run on that shard (``SequenceParallel``), attention and MLP all-gather
it (``PrepareModuleInput``), their output projections reduce-scatter back, and the LM head gives
vocabulary-sharded logits for ``loss_parallel``. Recompute then wraps modules in non-reentrant
``torch.utils.checkpoint`` (TP first, then recompute: torchtitan's order).
"""
from __future__ import annotations

import math
import re
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from ...memory import ActivationLedger
from ...model.modes import RECOMPUTE_MODES
from .peer import BenchShape, Recompute, copy_dense


# ---------------------------------------------------------------------------------------- model
class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d) + causal mask) @ V on ``[b, a, s, d]`` -> ``[b, a, s, d]``: the part
    selective recomputation recomputes (keeping only q, k, v)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, d = q.shape[-2], q.shape[-1]
        scores = torch.matmul(q, k.transpose(-2, -1)).mul_(1.0 / math.sqrt(d))      # [b, a, s, s]
        scores.add_(torch.full((s, s), float("-inf"), dtype=scores.dtype, device=scores.device).triu_(1))
        return torch.matmul(torch.softmax(scores, dim=-1), v)


class Attention(nn.Module):
    """``[b, s, h]`` -> ``[b, s, h]``. Under TP q/k/v hold this rank's ``heads`` of the ``a`` heads."""

    def __init__(self, h: int, heads: int, dtype: torch.dtype):
        super().__init__()
        self.heads, self.head_dim = heads, h // heads   # heads: set to a/t when parallelized
        self.q, self.k, self.v = (nn.Linear(h, h, dtype=dtype) for _ in range(3))
        self.core = CoreAttention()
        self.proj = nn.Linear(h, h, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (f(x) for f in (self.q, self.k, self.v))                   # 3 x [b, s, h/t]
        b, s = q.shape[:2]
        q, k, v = (y.view(b, s, self.heads, self.head_dim).transpose(1, 2) for y in (q, k, v))  # [b, a/t, s, d]
        ctx = self.core(q, k, v)
        return self.proj(ctx.transpose(1, 2).reshape(b, s, -1))              # [b, s, h/t] -> [b, s, h]


class MLP(nn.Module):
    def __init__(self, h: int, f: int, dtype: torch.dtype):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(h, f, dtype=dtype), nn.GELU(), nn.Linear(f, h, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, shape: BenchShape, dtype: torch.dtype):
        super().__init__()
        h = shape.hidden
        self.ln1, self.ln2 = nn.LayerNorm(h, dtype=dtype), nn.LayerNorm(h, dtype=dtype)
        self.attn = Attention(h, shape.heads, dtype)
        self.mlp = MLP(h, shape.ffn_hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PlainGPT(nn.Module):
    """Tokens ``[b, s]`` -> logits ``[b, s, v]`` (vocabulary-sharded DTensor once parallelized)."""

    def __init__(self, shape: BenchShape):
        super().__init__()
        dt, h = getattr(torch, shape.dtype), shape.hidden
        self.wte = nn.Embedding(shape.vocab_size, h, dtype=dt)
        self.wpe = nn.Embedding(shape.seq_len, h, dtype=dt)
        self.layers = nn.ModuleList(Block(shape, dt) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(h, dtype=dt)
        self.lm_head = nn.Linear(h, shape.vocab_size, bias=False, dtype=dt)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)                        # DTensor [b, s, h], Shard(1) under SP
        x = x + self.wpe.weight[:tokens.shape[1]]   # [s, h] Replicate: each rank adds its own rows
        if isinstance(x, DTensor):
            x = x.to_local()                        # [b, s/t, h] under SP
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))

    def load_dense(self, state: dict[str, torch.Tensor]) -> None:
        """Copy seqpar's dense state dict (``blocks.{i}.attn.qkv`` rows ``[q; k; v]``) into this model."""
        mine = {}
        for name, w in state.items():
            name = re.sub(r"^blocks\.", "layers.", name)
            if ".attn.qkv." in name:
                for part, chunk in zip("qkv", w.chunk(3, dim=0)):
                    mine[name.replace(".qkv.", f".{part}.")] = chunk
            else:
                mine[name] = w
        copy_dense(self, mine)  # lm_head.weight is wte.weight (tied): named once


# -------------------------------------------------------------------------------- TP plans
def layer_plan(sequence_parallel: bool) -> dict:
    """torchtitan's Llama layer plan: column-parallel q/k/v and fc1, row-parallel projections; with
    SP the norms run on the sequence shard and attention/MLP all-gather it on entry."""
    if not sequence_parallel:
        return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "ln1": SequenceParallel(),
        "attn": gather,
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),      # reduce-scatter to [b, s/t, h]
        "ln2": SequenceParallel(),
        "mlp": gather,
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
    }


def model_plan(sequence_parallel: bool) -> dict:
    """Embedding and head: vocabulary-parallel, logits left vocabulary-sharded for ``loss_parallel``."""
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream, use_local_output=False),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["ln_f"] = SequenceParallel()
    return plan


def parallelize(model: PlainGPT, mesh: DeviceMesh, heads: int, sequence_parallel: bool) -> PlainGPT:
    """Apply the TP plans, replicate what they leave, re-tie the head (each style distributes its
    own module's parameters, which unties them) and give attention its local head count."""
    t = mesh.size()
    for layer in model.layers:
        parallelize_module(layer, mesh, layer_plan(sequence_parallel))
        layer.attn.heads = heads // t
    parallelize_module(model, mesh, model_plan(sequence_parallel))
    distribute_module(model.wpe, mesh)       # Replicate: the grad of each rank's rows is gathered
    model.lm_head.weight = model.wte.weight  # both Shard(0) over the vocabulary
    return model


def apply_recompute(model: PlainGPT, mode: Recompute) -> None:
    """Wrap, after TP, what backward recomputes in a non-reentrant ``torch.utils.checkpoint``:
    each layer's attention core ("selective") or each layer ("full"). The wrapper saves its inputs
    as it is entered, inside the wrapped module's name, so the ledger charges them to that layer."""
    for i, layer in enumerate(model.layers):
        if mode == "full":
            model.layers[i] = checkpoint_wrapper(layer)
        elif mode == "selective":
            layer.attn.core = checkpoint_wrapper(layer.attn.core)


# ------------------------------------------------------------------------------------- peer
class DTensorPeer:
    """PyTorch DTensor tensor parallelism (``torch.distributed.tensor.parallel``), torchtitan style."""

    name = "dtensor"

    def build(self, shape: BenchShape, dense_state: dict[str, torch.Tensor], *, tp_group, tp_rank: int,
              tp_size: int, recompute: Recompute, sequence_parallel: bool = True) -> None:
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        bad = [f"{n} ({getattr(shape, n)})" for n in ("heads", "hidden", "vocab_size") if getattr(shape, n) % tp_size]
        if sequence_parallel and shape.seq_len % tp_size:
            bad.append(f"seq_len ({shape.seq_len})")
        if bad:
            raise ValueError(f"DTensorPeer: not divisible by t={tp_size}: {', '.join(bad)}")
        model = PlainGPT(shape)
        model.load_dense(dense_state)
        self.mesh = None
        if tp_size > 1:
            if tp_group is None:
                raise ValueError(f"DTensorPeer: tp_size={tp_size} needs a tp_group")
            self.mesh = DeviceMesh.from_group(tp_group, "cpu")
            parallelize(model, self.mesh, shape.heads, sequence_parallel)
        apply_recompute(model, recompute)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, foreach=False)

    def _loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)                                        # [b, s, v], Shard(-1) under TP
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with loss_parallel() if self.mesh is not None else nullcontext():  # backward must run inside too
            loss = self._loss(tokens, labels)
            loss.backward()
        self.optimizer.step()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return float(loss.detach())

    def saved_bytes_per_layer(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """Mean bytes one forward keeps per layer, DTensors counted by their local shards."""
        with ActivationLedger(self.model, layer_pattern=r"layers\.\d+") as ledger, \
                (loss_parallel() if self.mesh is not None else nullcontext()):
            loss = self._loss(tokens, labels)
        del loss
        return sum(ledger.per_layer().values()) / len(self.model.layers)
