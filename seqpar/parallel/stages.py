"""Pipeline stage modules cut from a built :class:`~seqpar.model.GPT` by layer count.

Stage ``i`` of ``n = p * m`` holds layers ``[i L/n, (i+1) L/n)``; stage 0 also holds the
embeddings (token table, learned positions, embedding dropout), stage ``n - 1`` the final norm,
the output layer (the token table itself when tied) and the loss. Stage ``i`` runs on pipeline
rank ``i % p`` (the looped placement of the interleaved schedule). Parameter names are the
GPT's own (``wte.weight``, ``blocks.3.attn.qkv.weight``, ``ln_f.weight``), so a stage's dense
state dict is keyed exactly like the unsplit model's.

Between stages travels the residual stream ``[s/t, b, h]`` (SP) or ``[s, b, h]`` (plain TP).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from ..distributed.rng import RNGStreams
from ..layers import column_parallel_linear, vocab_parallel_cross_entropy
from ..model.config import GPTConfig
from ..model.context import context_mean_loss, position_rows, split_batch, stream_rank
from ..model.gpt import GPT
from ..model.moe_sharding import gather_experts
from ..model.vocab import check_token_ids, trim_rows
from ..recompute import recompute_runs, run_layers
from .. import sharding

STAGE_SEED_OFFSET = 7919  # stage i draws dropout masks from seed + i * offset (stage 0: the GPT's seed)


def check_stage_split(layers: int, pp: int, virtual_stages: int) -> None:
    """Raise ``ValueError`` naming L, p and m unless ``L % (p * m) == 0``. Pure arithmetic: every
    rank raises it before any collective."""
    for name, v in (("layers", layers), ("pp", pp), ("virtual_stages", virtual_stages)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"pipeline split: {name} must be a positive integer, got {v!r}")
    if layers % (pp * virtual_stages):
        raise ValueError(f"pipeline split: layers L={layers} is not divisible by pp x virtual_stages = "
                         f"p={pp} x m={virtual_stages} = {pp * virtual_stages}; each of the p*m stages "
                         f"needs the same whole number of layers")


def stage_layers(layers: int, num_stages: int, index: int) -> range:
    """The global layer indices of stage ``index`` of ``num_stages``."""
    per = layers // num_stages
    return range(index * per, (index + 1) * per)


def local_stage_indices(pp: int, virtual_stages: int, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds: ``pp_rank, pp_rank + p, ...``."""
    return [pp_rank + j * pp for j in range(virtual_stages)]


def _set_streams(module: nn.Module, streams: RNGStreams) -> None:
    """Point every dropout (and the attention core) inside ``module`` at ``streams``."""
    for m in module.modules():
        if isinstance(getattr(m, "streams", None), RNGStreams):
            m.streams = streams


class StageModule(nn.Module):
    """One pipeline stage: ``forward(tokens [b, s])`` on the first stage, ``forward(x [s/t, b, h])``
    elsewhere; returns the residual stream, or on the last stage this rank's logits shard
    ``[s, b, v_pad/t]`` (padded columns not masked: :meth:`loss` masks them)."""

    def __init__(self, model: GPT, index: int, num_stages: int, seed: int):
        super().__init__()
        cfg = model.config
        self.config, self.index, self.num_stages = cfg, index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.tp_group, self.tp_size, self.tp_rank = model.tp_group, model.tp_size, model.tp_rank
        self.cp = model.cp  # context parallelism: the first stage keeps this CP rank's chunks
        self.mesh = model.mesh  # its ep group: the experts' dense rows are gathered over it
        self.layer_ids = stage_layers(cfg.layers, num_stages, index)
        self.rng = RNGStreams(seed + STAGE_SEED_OFFSET * index, tp_rank=stream_rank(model.mesh),
                              device=model.rng.device)
        self.wte = model.wte if (self.is_first or (self.is_last and model.lm_head is None)) else None
        self.wpe = model.wpe if self.is_first else None
        self.drop = model.drop if self.is_first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in self.layer_ids})
        self.ln_f = model.ln_f if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        _set_streams(self, self.rng)
        if cfg.recompute_layers is not None:  # this stage's slice of the per-layer modes
            self.set_recompute([cfg.recompute_layers[i] for i in self.layer_ids])
        else:
            self.set_recompute(cfg.recompute, cfg.recompute_method, cfg.recompute_num_layers)

    @property
    def holds_tied_copy(self) -> bool:
        """True on a last stage that is not also the first and keeps the tied token table for the head."""
        return self.is_last and not self.is_first and self.wte is not None

    def set_recompute(self, mode: str | Sequence[str], method: str = "uniform", num_layers: int = 1) -> None:
        """Recompute inside this stage: "none", "selective" (attention core) or "full" (``method``
        groups of ``num_layers`` of this stage's layers), or one of those per layer of the stage
        (each full layer checkpointed alone); see :func:`seqpar.recompute.recompute_runs`."""
        self.recompute_modes, self.runs = recompute_runs(mode, len(self.blocks), method, num_layers)
        for block, m in zip(self.blocks.values(), self.recompute_modes):
            block.attn.recompute = m == "selective"

    def _run_blocks(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        for i in self.layer_ids[start:end]:
            x = self.blocks[str(i)](x)
        return x

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if tokens.dim() != 2 or tokens.shape[1] > cfg.seq_len:
            raise ValueError(f"the first stage expects tokens [batch, seq <= {cfg.seq_len}], got {tuple(tokens.shape)}")
        check_token_ids(tokens, cfg.vocab_size)
        tokens = split_batch(tokens, None, self.cp)[0]              # [b, s/cp]: this CP rank's chunks
        x = self.wte(tokens.t())                                    # [s/(cp t), b, h] (SP) or [s/cp, b, h]
        if self.wpe is not None:
            n = x.shape[0]
            start = self.tp_rank * n if cfg.sequence_parallel else 0
            x = x + position_rows(self.wpe.weight, tokens.shape[1], start, n, self.cp)
        return self.drop(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self._embed(x)
        x = run_layers(self.runs, self._run_blocks, x, self.rng)
        if not self.is_last:
            return x                                                # [s/t, b, h] to the next stage
        x = self.ln_f(x)
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        return column_parallel_linear(x, weight, tp_group=self.tp_group,
                                      sequence_parallel=self.config.sequence_parallel)  # [s, b, v_pad/t]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of logits ``[s, b, v_pad/t]`` against labels ``[b, s]`` (identical on TP
        ranks; under cp the mean over the whole sequence, identical on CP ranks)."""
        if self.cp.size == 1:
            return vocab_parallel_cross_entropy(logits, labels.t(), tp_group=self.tp_group,
                                                vocab_size=self.config.vocab_size)
        labels = split_batch(labels, None, self.cp)[0]
        summed = vocab_parallel_cross_entropy(logits, labels.t(), tp_group=self.tp_group,
                                              vocab_size=self.config.vocab_size, reduction="sum")
        return context_mean_loss(summed, labels, self.cp)

    def to_dense(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This stage's per-parameter tensors -> the dense layout (vocabulary rows trimmed, experts
        gathered over ep). A TP (and ep) collective."""
        return gather_experts(self, trim_rows(sharding.to_dense(self, local, self.tp_group), self.config.vocab_size))


def build_stage_modules(config: GPTConfig, mesh, seed: int, virtual_stages: int = 1) -> list[StageModule]:
    """Build this pipeline rank's ``virtual_stages`` stages of the GPT: only their layers are built
    (each layer seeded on its own, so the same dense weights as the unsplit model). Raises before
    any collective on a bad split."""
    check_stage_split(config.layers, mesh.pp_size, virtual_stages)
    n = mesh.pp_size * virtual_stages
    stages = local_stage_indices(mesh.pp_size, virtual_stages, mesh.pp_rank)
    layers = {i for s in stages for i in stage_layers(config.layers, n, s)}
    model = GPT(config, mesh, seed=seed, build_layers=layers)  # the other ranks' layers are never built
    return [StageModule(model, i, n, seed) for i in stages]
