"""A drop-in model (a Hugging Face Llama / GPT-2, or your ``module:function``) in one layout.

The model is built on every rank from the same seed, converted by ``seqpar.parallelize`` with its
plan over the layout's TP group (SP on or off), given ``checkpoint_attention`` for selective
recompute, then wrapped in DDP or FSDP2 over dp: the order docs/dropin.md prescribes. Each rank
takes its dp share of the global batch in one micro-batch; the loss is the model's own.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...dropin import checkpoint_attention
from ...dropin.wrappers import unwrap
from ...parallel.grads import clip_grad_norm
from ...parallelize import parallelize
from .gpt_run import layout_mesh
from .layouts import Layout
from .steps import global_batch, rank_batches
from .target import Target, UserModel, as_user_model, load_function

DROPIN_UNSUPPORTED = {  # layout field -> why a drop-in model cannot run it
    "cp": "drop-in plans have no context-parallel attention",
    "pp": "drop-in models have no pipeline stages",
    "full": "full recompute is seqpar GPT's (wrap your layers in torch.utils.checkpoint yourself)",
    "compile": "compiled drop-in layouts are not run by verify (compile time on CPUs; see docs/dropin.md)",
}


def dropin_skip_reason(lay: Layout) -> str | None:
    """Why ``lay`` does not apply to a drop-in model, or None."""
    if lay.cp > 1:
        return DROPIN_UNSUPPORTED["cp"]
    if lay.pp > 1:
        return DROPIN_UNSUPPORTED["pp"]
    if lay.recompute == "full":
        return DROPIN_UNSUPPORTED["full"]
    if lay.compile:
        return DROPIN_UNSUPPORTED["compile"]
    return None


def _hf_model(target: Target, dtype: torch.dtype, dropout: float | None) -> UserModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    from ... import plans
    keys = dict(target.hf_config)
    keys.pop("model_type", None)
    if dropout is not None:
        keys.update({"gpt2": dict(attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout),
                     "llama": dict(attention_dropout=dropout)}[target.hf_type])
    config = AutoConfig.for_model(target.hf_type, **keys)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    plan = plans.gpt2() if target.hf_type == "gpt2" else plans.llama()
    return UserModel(model, plan, vocab_size=config.vocab_size)


def build_user_model(target: Target, dtype: torch.dtype, seed: int, dropout: float | None = 0.0) -> UserModel:
    """The target's model, the same weights on every rank (torch seeded with ``seed`` first), in
    ``dtype``, training mode, with every dropout at ``dropout`` (the Hugging Face config's
    dropouts, or every ``nn.Dropout`` of your module); None keeps the model's own."""
    torch.manual_seed(seed)
    if target.kind == "hf":
        um = _hf_model(target, dtype, dropout)
    else:
        um = as_user_model(load_function(target.function)(), target.function, target.plan)
        if dropout is not None:
            for m in um.model.modules():
                if isinstance(m, nn.Dropout):
                    m.p = dropout
    um.model.to(dtype).train()
    return um


def _vocab(um: UserModel) -> int:
    if um.vocab_size:
        return um.vocab_size
    size = getattr(getattr(um.model, "config", None), "vocab_size", None)
    if size:
        return int(size)
    emb = next((m for m in um.model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError("verify: cannot tell the vocabulary of the model; set UserModel.vocab_size")
    return emb.num_embeddings


def default_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=tokens, labels=tokens)
    return out if isinstance(out, torch.Tensor) else out.loss


class DropinRun:
    """One layout of a drop-in model, with the calls :func:`~.steps.train_steps` makes."""

    def __init__(self, target: Target, lay: Layout, *, dtype: str, dropout: float | None, seed: int):
        self.lay, self.seed = lay, seed
        um = build_user_model(target, getattr(torch, dtype), seed, dropout)
        self.vocab, self.seq_len, self.loss_fn = _vocab(um), um.seq_len, um.loss or default_loss
        self.mesh = mesh = layout_mesh(lay)
        if callable(um.plan):  # your own convert(model, mesh), for a model converted by hand
            model = um.plan(um.model, mesh)
        else:
            model = parallelize(um.model, um.plan, mesh, sequence_parallel=lay.sp, seed=seed)
        if lay.recompute == "selective":
            checkpoint_attention(model)  # replays the dropout streams parallelize gave the model
        self.inner = unwrap(model)
        self.module = self._data_parallel(model)
        self.parts = [self.inner]

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        lay, mesh = self.lay, self.mesh
        if lay.dp == 1:
            return model
        if lay.dp_mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            return DistributedDataParallel(model, process_group=mesh.dp_group)
        from torch.distributed.fsdp import fully_shard
        return fully_shard(model, mesh=mesh.dp_mesh)

    @property
    def tp_group(self):
        return self.mesh.tp_group

    def batches(self, step: int) -> list:
        tokens, labels = global_batch(self.vocab, self.seq_len, step, self.seed)
        rows = tokens.shape[0] // self.mesh.dp_size
        return rank_batches(tokens, labels, self.mesh.dp_rank, self.mesh.dp_size, rows)

    def forward_backward(self, batches: list) -> torch.Tensor:
        total = None
        for tokens, _ in batches:
            loss = self.loss_fn(self.module, tokens) / len(batches)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total  # in the loss's own dtype (the report's loss tolerance follows it)

    def clip(self) -> torch.Tensor:
        mesh = self.mesh
        return clip_grad_norm(self.inner, 0.0, tp_group=mesh.tp_group, dp_group=mesh.dp_group)


__all__ = ["DropinRun", "build_user_model", "default_loss", "dropin_skip_reason"]
