"""GPT: embeddings -> L pre-norm blocks -> final norm -> vocab-parallel head and loss.

Tokens come in batch-first ``[b, s]`` and are processed sequence-first ``[s, b, h]``; under
sequence parallelism the residual stream between blocks is the shard ``[s/t, b, h]``. The same
decoder is GPT-2 (LayerNorm, learned positions, GeLU) or Llama (RMSNorm, RoPE, SwiGLU,
grouped-query attention) by its :class:`GPTConfig`; the vocabulary is padded to the TP layout
(:mod:`seqpar.model.vocab`) and the padding is invisible outside the model.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import Sequence

import torch
import torch.nn as nn

from .. import sharding
from ..distributed.collectives import check_group, group_rank, group_size
from ..distributed.context import CPComm, ContextParallel, check_context_layout
from ..distributed.mesh import ParallelMesh
from ..distributed.rng import RNGStreams
from ..errors import UserError
from ..layers import ColumnParallelLinear, VocabParallelEmbedding, column_parallel_linear, vocab_parallel_cross_entropy
from ..recompute import recompute_runs, run_layers
from .recompute_ops import recompute_output
from ..sharding import mark_sp_replicated
from .attention import SelfAttention
from .config import GPTConfig
from .context import build_context, context_mean_loss, position_rows, split_batch, stream_rank
from .mlp import MLP
from .moe import LossGradScale, MoE, capture_loss_grad
from .moe_sharding import expert_dense_shapes, gather_experts, slice_experts
from .norm import make_norm
from .rope import RopeTables
from .vocab import check_token_ids, mask_padded_logits, pad_rows, padded_normal_init, trim_rows, true_dense_shapes


class Dropout(nn.Module):
    """Dropout drawing from a named seqpar RNG stream; keeps a 1-byte mask (``torch.native_dropout``),
    or with ``redraw`` the stream's generator state, redrawing the same mask in backward."""

    def __init__(self, p: float, streams: RNGStreams, stream: str, redraw: bool = False):
        super().__init__()
        self.p, self.streams, self.stream, self.redraw = p, streams, stream, redraw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return self.streams.dropout(x, self.p, self.stream, redraw=self.redraw)

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream!r}" + (", redraw=True" if self.redraw else "")


class Block(nn.Module):
    """Pre-norm transformer layer: ``x + drop(attn(ln1(x)))``, then ``x + drop(mlp(ln2(x)))``.
    ``ln1``/``ln2`` are LayerNorms or RMSNorms (``config.norm``). ``config.recompute_ops``
    (:mod:`seqpar.model.recompute_ops`): ``norm`` keeps neither norm's output (rebuilt in backward from
    its input), ``activation`` the MLP's activation output, ``dropout`` neither dropout mask."""

    def __init__(self, config: GPTConfig, tp_group, streams: RNGStreams, layer_std: tuple[float, float],
                 rope: RopeTables | None = None, cp: ContextParallel | None = None, ffn: nn.Module | None = None):
        """``ffn``: the layer's FFN when it is not the dense MLP (an MoE layer's)."""
        super().__init__()
        h, dt, eps = config.hidden, config.torch_dtype, config.layernorm_eps
        stream = "tp" if config.sequence_parallel else "replicated"  # SP: each rank holds other tokens
        self.ln1 = make_norm(config.norm, h, eps, dt)
        self.attn = SelfAttention(config, tp_group, streams, layer_std, rope, cp)
        ops = config.recompute_ops
        self.attn_dropout = Dropout(config.dropout, streams, stream, redraw="dropout" in ops)
        self.ln2 = make_norm(config.norm, h, eps, dt)
        self.mlp = MLP(config, tp_group, layer_std) if ffn is None else ffn
        self.mlp_dropout = Dropout(config.dropout, streams, stream, redraw="dropout" in ops)
        self.recompute_norm = "norm" in ops
        if config.sequence_parallel and group_size(tp_group) > 1:
            mark_sp_replicated(self.ln1)
            mark_sp_replicated(self.ln2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_norm:  # the QKV and fc1 layers' inputs rebuilt from the norms' inputs in backward
            x = x + self.attn_dropout(recompute_output(self.ln1, x, self.attn))
            return x + self.mlp_dropout(recompute_output(self.ln2, x, self.mlp))
        x = x + self.attn_dropout(self.attn(self.ln1(x)))
        return x + self.mlp_dropout(self.mlp(self.ln2(x)))


def layer_seed(seed: int, layer: int) -> int:
    """The seed of transformer layer ``layer``'s weights (``layer = L``: the final norm and head)."""
    return (seed * 1_000_003 + layer + 1) % 2**63


class NotBuilt(nn.Module):
    """A transformer layer this rank does not hold (another pipeline rank's); holds nothing."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"layer {self.index} is not built on this rank (a pipeline stage of another rank)")

    def extra_repr(self) -> str:
        return f"layer {self.index}"


class GPT(nn.Module):
    """GPT-2/GPT-3 or Llama-family decoder built from seqpar's parallel layers.

    ``model(tokens)``: tokens ``[b, s]`` (identical on all TP ranks) -> this rank's vocabulary
    shard of the logits ``[b, s, v_pad/t]`` (``v_pad = config.padded_vocab(t)``; the padded
    columns are -inf). ``model(tokens, labels)`` -> mean cross-entropy over labels != -100,
    identical on all TP ranks. The same ``seed`` gives the same dense model for every TP size
    (see :meth:`dense_state_dict`), with or without vocabulary padding.
    """

    def __init__(self, config: GPTConfig, mesh: ParallelMesh | None = None, seed: int = 0, *,
                 build_layers: Collection[int] | None = None, cp_comm: CPComm = "allgather"):
        """``build_layers``: build only these transformer layers (a pipeline rank's stages; the
        others are placeholders holding nothing, and this GPT's own forward refuses to run). Each
        layer draws its weights from its own seed, so a layer is the same whichever are built.
        ``cp_comm``: how attention exchanges K/V over ``mesh``'s cp group (``"allgather"`` or
        ``"ring"``; unused when ``mesh.cp_size == 1``)."""
        super().__init__()
        mesh = mesh or ParallelMesh.single()
        t = mesh.tp_size
        config.check_parallel(t)  # before any collective, on every rank
        check_group(mesh.tp_group, "GPT")
        if mesh.ep_size > 1 and config.moe is None:
            raise UserError(f"parallel.ep={mesh.ep_size} splits experts, but the model has none (set model.moe)")
        self.cp = build_context(config, mesh, cp_comm)
        config = dataclasses.replace(config)  # the model's own copy: set_recompute never edits the caller's
        self.config, self.mesh = config, mesh
        self.tp_group, self.tp_size, self.tp_rank = mesh.tp_group, t, group_rank(mesh.tp_group)
        self.moe_scale = LossGradScale() if config.moe is not None else None  # the loss's gradient, for aux losses
        self.rng = RNGStreams(seed, tp_rank=stream_rank(mesh), device=mesh.device)
        h, dt, sp, std = config.hidden, config.torch_dtype, config.sequence_parallel, config.init_std
        layer_std = (std, std / math.sqrt(2 * config.layers))
        embed_stream = "tp" if sp else "replicated"
        v, self.padded_vocab = config.vocab_size, config.padded_vocab(t)
        self.vocab_start = self.tp_rank * (self.padded_vocab // t)  # first vocabulary row of this rank
        rope = RopeTables(config) if config.position == "rope" else None

        # weights come from `seed` through the CPU generator only (built on the CPU, then moved):
        # torch.manual_seed would also reseed every CUDA generator, the caller's included
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            self.wte = VocabParallelEmbedding(self.padded_vocab, h, tp_group=self.tp_group, sequence_parallel=sp,
                                              dtype=dt, init_method=padded_normal_init(v, std))
            self.wpe = None
            if config.position == "learned":
                self.wpe = nn.Embedding(config.seq_len, h, dtype=dt)
                nn.init.normal_(self.wpe.weight, 0.0, std / 2)
            self.drop = Dropout(config.dropout, self.rng, embed_stream)
            self.blocks = nn.ModuleList(self._block(i, seed, build_layers, layer_std, rope)
                                        for i in range(config.layers))
            torch.default_generator.manual_seed(layer_seed(seed, config.layers))
            self.ln_f = make_norm(config.norm, h, config.layernorm_eps, dt)
            self.lm_head = None if config.tie_embeddings else ColumnParallelLinear(
                h, self.padded_vocab, bias=False, tp_group=self.tp_group, sequence_parallel=sp, dtype=dt,
                init_method=padded_normal_init(v, std))
        if sp and t > 1:
            if self.wpe is not None:
                mark_sp_replicated(self.wpe)  # each rank adds the position rows of its own shard
            mark_sp_replicated(self.ln_f)
        if any(w.device != mesh.device for w in (*self.parameters(), *self.buffers())):
            self.to(mesh.device)  # only when needed: fake tensors (seqpar.tools.dryrun) cannot be swapped
        modes = config.layer_recompute()  # recompute: auto must have been resolved to per-layer modes
        self.set_recompute(config.recompute if modes is None else modes, config.recompute_method,
                           config.recompute_num_layers)

    def _block(self, i: int, seed: int, build: Collection[int] | None, layer_std, rope) -> nn.Module:
        """Layer ``i``, its weights drawn from :func:`layer_seed` (or a placeholder when not built)."""
        if build is not None and i not in build:
            return NotBuilt(i)
        torch.default_generator.manual_seed(layer_seed(seed, i))
        moe = self.config.moe
        ffn = MoE(self.config, self.mesh, layer_std, self.moe_scale) if moe and moe.is_moe_layer(i) else None
        return Block(self.config, self.tp_group, self.rng, layer_std, rope, self.cp, ffn)

    def _apply(self, fn, recurse: bool = True):
        """``.to()`` / ``.cuda()`` / ``.half()`` ...: the dropout streams follow the parameters' device."""
        out = super()._apply(fn, recurse)
        self.rng.to(self.wte.weight.device)
        return out

    # ------------------------------------------------------------------ recomputation
    def set_recompute(self, mode: str | Sequence[str], method: str = "uniform", num_layers: int = 1) -> None:
        """Choose what backward recomputes: "none", "selective" (attention core), "full" (``method``
        groups of ``num_layers`` layers), or one of those per layer (a list of ``len(blocks)``:
        selective layers recompute their attention core, each full layer is checkpointed alone).
        The choice lives on the model (``recompute_modes``, ``runs``); its config is left as built."""
        self.recompute_modes, self.runs = recompute_runs(mode, len(self.blocks), method, num_layers)
        for block, m in zip(self.blocks, self.recompute_modes):
            if isinstance(block, Block):
                block.attn.recompute = m == "selective"

    def _run_blocks(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        for block in self.blocks[start:end]:
            x = block(x)
        return x

    # ------------------------------------------------------------------ forward
    def _check_tokens(self, tokens: torch.Tensor) -> None:
        if tokens.dim() != 2:
            raise ValueError(f"GPT expects tokens [batch, seq]; got shape {tuple(tokens.shape)}")
        s = tokens.shape[1]
        if s > self.config.seq_len:
            raise ValueError(f"sequence length {s} exceeds config.seq_len={self.config.seq_len}")
        if self.cp.size > 1:
            check_context_layout(s, self.cp.size, self.tp_size, self.config.sequence_parallel)
        elif self.config.sequence_parallel and s % self.tp_size:
            raise ValueError(f"sequence length {s} is not divisible by t={self.tp_size} (sequence parallelism)")
        check_token_ids(tokens, self.config.vocab_size)  # the padded rows must never be looked up

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        self._check_tokens(tokens)
        if labels is not None and labels.shape != tokens.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal tokens shape {tuple(tokens.shape)}")
        sp = self.config.sequence_parallel
        tokens, labels = split_batch(tokens, labels, self.cp)       # [b, s/cp]: this CP rank's chunks
        x = self.wte(tokens.t())                                    # [s/(cp t), b, h] (SP) or [s/cp, b, h]
        if self.wpe is not None:  # learned positions; RoPE acts on q and k inside attention instead
            n = x.shape[0]
            start = self.tp_rank * n if sp else 0
            x = x + position_rows(self.wpe.weight, tokens.shape[1], start, n, self.cp)  # this rank's rows
        x = self.drop(x)
        x = run_layers(self.runs, self._run_blocks, x, self.rng)
        x = self.ln_f(x)
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = column_parallel_linear(x, weight, tp_group=self.tp_group, sequence_parallel=sp)  # [s, b, v_pad/t]
        v = self.config.vocab_size
        if labels is None:  # padded columns -inf: sampling and argmax never pick them
            return mask_padded_logits(logits, v, self.vocab_start).transpose(0, 1)  # [b, s, v_pad/t]
        if self.cp.size == 1:
            loss = vocab_parallel_cross_entropy(logits, labels.t(), tp_group=self.tp_group, vocab_size=v)
        else:
            summed = vocab_parallel_cross_entropy(logits, labels.t(), tp_group=self.tp_group, vocab_size=v,
                                                  reduction="sum")
            loss = context_mean_loss(summed, labels, self.cp)  # the mean over the whole sequence, reduced over cp once
        # MoE layers' auxiliary losses take the gradient this loss receives (scaled by accumulation)
        return loss if self.moe_scale is None else capture_loss_grad(loss, self.moe_scale)

    # ------------------------------------------------------------------ dense state dict
    def to_dense(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gather per-parameter tensors (parameters, their grads or optimizer moments, keyed by
        parameter name) into the full, layout-invariant form: the vocabulary tables cut to the
        true ``vocab_size`` rows. A collective over TP."""
        dense = trim_rows(sharding.to_dense(self, local, self.tp_group), self.config.vocab_size)
        return gather_experts(self, dense)

    def to_local(self, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Slice full tensors (as from :meth:`to_dense`) into this rank's shards, the vocabulary
        tables zero-padded to this layout's rows first. No communication."""
        return sharding.to_local(self, pad_rows(slice_experts(self, dense), self.padded_vocab), self.tp_group)

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) tensors under stable names, identical for every TP size:
        ``wte.weight [v, h]`` (the true vocabulary, no padding), ``wpe.weight [seq_len, h]``
        (learned positions only), ``blocks.{i}.ln1.{weight,bias}`` (RMSNorm: weight only),
        ``blocks.{i}.attn.qkv.{weight [(a+2g)d, h], bias}`` in ``[q; k; v]`` order,
        ``blocks.{i}.attn.proj.{weight [h, h], bias}``, ``blocks.{i}.ln2.*``,
        ``blocks.{i}.mlp.fc1.{weight [f, h], bias}`` (SwiGLU: ``[2f, h]`` = ``[gate; up]``),
        ``blocks.{i}.mlp.fc2.{weight [h, f], bias}``, ``ln_f.*`` and, when untied,
        ``lm_head.weight [v, h]``. A collective: call on every TP rank."""
        return self.to_dense(dict(self.named_parameters()))

    def load_dense_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Slice full tensors (as from :meth:`dense_state_dict`) into this rank's shards.
        Missing or unexpected keys and wrong shapes raise :class:`~seqpar.errors.UserError` naming
        them (the tensors come from a file: a checkpoint, an export, a Hugging Face model)."""
        expected = self._dense_shapes()
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise UserError(f"dense state dict mismatch: missing {missing}, unexpected {unexpected}")
        bad = [f"{k}: {tuple(state[k].shape)} != {tuple(s)}" for k, s in expected.items() if state[k].shape != s]
        if bad:
            raise UserError(f"dense state dict shape mismatch: {bad}")
        local = self.to_local(state)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(local[name])

    def _dense_shapes(self) -> dict[str, torch.Size]:
        return expert_dense_shapes(self, true_dense_shapes(self))

    def num_parameters(self, dense: bool = True) -> int:
        """Parameter count of the full model (``dense``) or of this rank's shards."""
        if dense:
            return sum(s.numel() for s in self._dense_shapes().values())
        return sum(p.numel() for p in self.parameters())
