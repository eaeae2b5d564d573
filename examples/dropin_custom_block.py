"""Convert your own PyTorch model by hand: tensor + sequence parallelism with seqpar's layers.

    torchrun --nproc-per-node 2 examples/dropin_custom_block.py
    python examples/dropin_custom_block.py            # the same script on one rank

A small batch-first language model (``[b, s, h]`` hidden states, like most PyTorch code) is
written as usual, then :func:`convert` swaps its linear layers for seqpar's, tags its norms and
marks where the sequence-parallel region starts and ends. Every rank keeps an untouched copy;
both train for a few steps on the same batch and must give the same losses.
"""
from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import seqpar
from seqpar.distributed import RNGStreams, gather_to_replicated, mark_sp_replicated, scatter_to_sp
from seqpar.distributed import sync_sp_replicated_grads
from seqpar.dropin import check_groups
from seqpar.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from seqpar.sharding import to_dense

VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH, STEPS = 128, 32, 64, 4, 2, 4, 5
DROPOUT = 0.0  # > 0 trains with dropout; the masks then come from the RNG streams (not comparable to dense)


class Block(nn.Module):
    """Pre-norm transformer block on ``[b, s, h]``. Written once; runs dense or converted."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.heads = HEADS  # this rank's heads: HEADS / t once converted
        self.streams: RNGStreams | None = None  # dropout streams, set by convert

    def fork(self, stream: str):
        return self.streams.fork(stream) if self.streams is not None else contextlib.nullcontext()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h] (converted: [b, s/t, h])
        qkv = self.qkv(self.norm1(x))                      # [b, s, 3h] (converted: [b, s, 3h/t], gathered)
        b, s, _ = qkv.shape                                # shapes from the projection, not from x
        q, k, v = (y.view(b, s, self.heads, -1).transpose(1, 2) for y in qkv.chunk(3, dim=-1))
        with self.fork("tp"):                              # heads differ per rank: their own masks
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=DROPOUT if self.training else 0.0)
        a = self.out(a.transpose(1, 2).reshape(b, s, -1))  # [b, s, h] (converted: [b, s/t, h], reduce-scattered)
        with self.fork("tp"):                              # sequence shards differ per rank
            x = x + F.dropout(a, DROPOUT, self.training)
            return x + F.dropout(self.down(F.gelu(self.up(self.norm2(x)))), DROPOUT, self.training)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Parameter(0.02 * torch.randn(SEQ, HIDDEN))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
        self.sp_group = None  # the TP group once converted: the sequence is split over it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [b, s] -> loss
        x = self.emb(ids) + self.pos[: ids.shape[1]]           # [b, s, h], the same on every rank
        x = scatter_to_sp(x, self.sp_group, seq_dim=1)         # enter the SP region: [b, s/t, h]
        for block in self.blocks:
            x = block(x)
        x = gather_to_replicated(self.norm(x), self.sp_group, seq_dim=1)  # leave it: [b, s, h] again
        logits = self.head(x)                                  # [b, s, v]
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def convert(model: TinyLM, mesh: seqpar.ParallelMesh) -> TinyLM:
    """Swap ``model``'s layers for seqpar's in place (each rank keeps its slice of the weights)."""
    g, t = mesh.tp_group, mesh.tp_size
    sp = dict(tp_group=g, sequence_parallel=True, seq_dim=1)  # batch-first: the sequence is dim 1
    for i, block in enumerate(model.blocks):
        block.qkv = ColumnParallelLinear.from_dense(block.qkv, chunks=3, **sp)  # fused [q; k; v] split per block
        block.out = RowParallelLinear.from_dense(block.out, **sp)
        block.up = ColumnParallelLinear.from_dense(block.up, **sp)
        block.down = RowParallelLinear.from_dense(block.down, **sp)
        mark_sp_replicated(block.norm1)  # norms see 1/t of the tokens: their gradients are summed over TP
        mark_sp_replicated(block.norm2)
        block.heads //= t
        block.streams = RNGStreams(seed=1234 + i, tp_rank=mesh.tp_rank, device=mesh.device)
    mark_sp_replicated(model.norm)
    model.emb = VocabParallelEmbedding.from_dense(model.emb, tp_group=g)  # vocabulary rows split, output summed
    model.head = ColumnParallelLinear.from_dense(model.head, tp_group=g, gather_output=True)  # logits gathered
    model.sp_group = g
    check_groups(model, mesh)  # every sequence-parallel layer uses the group the sequence is split over
    return model


def train(model: nn.Module, ids: torch.Tensor, group) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(ids)
        loss.backward()
        sync_sp_replicated_grads(model, group)  # or install_sp_grad_hooks(model, group) once; never both
        opt.step()
        losses.append(loss.item())
    return losses


def run(mesh: seqpar.ParallelMesh) -> dict:
    torch.manual_seed(0)  # the same weights and batch on every rank
    reference = TinyLM().to(mesh.device)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ)).to(mesh.device)
    model = convert(copy.deepcopy(reference), mesh)
    losses, ref_losses = train(model, ids, mesh.tp_group), train(reference, ids, None)
    full = to_dense(model, dict(model.named_parameters()), mesh.tp_group)  # a collective: every rank
    saved = TinyLM().to(mesh.device)  # a plain model from the gathered weights
    saved.load_state_dict(full)
    with torch.no_grad():
        final, reloaded = model(ids).item(), saved(ids).item()
    if mesh.is_first:
        print(f"custom batch-first model on t={mesh.tp_size} ranks, sequence parallel")
        print(model.blocks[0].qkv)
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            print(f"step {step}: converted loss {a:.6f}   original loss {b:.6f}")
        print(f"max |loss difference| {max(abs(a - b) for a, b in zip(losses, ref_losses)):.2e}")
        print(f"after training: converted loss {final:.6f}, gathered weights in the original model {reloaded:.6f}")
    return dict(losses=losses, ref_losses=ref_losses, final=final, reloaded=reloaded)


def main() -> None:
    mesh = seqpar.init_parallel(tp=int(os.environ.get("WORLD_SIZE", "1")))  # all ranks in one TP group
    run(mesh)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
