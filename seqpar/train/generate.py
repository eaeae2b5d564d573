"""Sampling from a (possibly tensor-parallel) GPT, and ``seqpar generate CHECKPOINT``."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..distributed.regions import gather_from_tp
from ..errors import UserError
from .faults import NonFiniteError


@torch.no_grad()
def sample(model, prompt: list[int], max_new_tokens: int = 64, *, temperature: float = 0.8, top_k: int = 40,
           seed: int = 0, stop_id: int | None = None) -> list[int]:
    """Extend ``prompt`` token by token (no KV cache: each step re-reads the window).

    A collective under TP: call on every TP rank with the same arguments; every rank returns the
    same ids (the vocabulary shards are gathered for the last position only, and all ranks draw
    from identically seeded generators). Under sequence parallelism the window is right-padded to
    a multiple of t; causal attention makes the padding invisible to earlier positions. Logits
    holding NaN/inf (diverged weights) raise :class:`NonFiniteError` on every rank.
    """
    if not prompt:
        raise ValueError("sample: the prompt must contain at least one token")
    was_training = model.training
    model.eval()
    cfg, t = model.config, model.tp_size
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for k in range(max_new_tokens):
        window = ids[-cfg.seq_len:]
        n = len(window)
        pad = (-n) % t if cfg.sequence_parallel else 0  # seq_len is a multiple of t under SP: it fits
        tokens = torch.tensor([window + [0] * pad], device=device)
        logits = gather_from_tp(model(tokens)[:, n - 1].float(), model.tp_group)[0].cpu()  # [v_pad]
        logits = logits[:cfg.vocab_size]  # the padded rows: the same draws as the unpadded model
        if not torch.isfinite(logits).all():  # the same gathered logits on every rank: all raise
            model.train(was_training)
            raise NonFiniteError(f"the model's logits for new token {k + 1} hold NaN/inf: its weights have "
                                 f"diverged")
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        ids.append(nxt)
        if stop_id is not None and nxt == stop_id:
            break
    model.train(was_training)
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqpar generate", description="Print a sample from a seqpar checkpoint "
                                "(one process, any TP size it was trained with).")
    p.add_argument("checkpoint", help="a checkpoint folder (step_N) or a checkpoint dir holding 'latest'")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=int, default=128, help="new tokens to sample (>= 1; default 128)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tokens < 1:
        raise UserError(f"--tokens must be at least 1 (got {args.tokens})")

    from tokenizers import Tokenizer

    from ..config import load_run_config
    from ..model import GPT
    from ..checkpoint import latest_checkpoint, load_model_only

    path = Path(args.checkpoint)
    exported = (path / "model.safetensors").is_file() and (path / "config.yaml").is_file()
    if not exported and not (path / "extra.json").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise UserError(f"no checkpoint (or `seqpar export --format safetensors` folder) "
                             f"found at {path}")
        path = found
    cfg = load_run_config(path / "config.yaml")
    cfg.model.recompute, cfg.model.dropout, cfg.model.attention_dropout = "none", 0.0, 0.0
    model = GPT(cfg.model)
    if exported:
        from ..checkpoint.safetensors import read_safetensors
        model.load_dense_state_dict(read_safetensors(path / "model.safetensors"))
    else:
        load_model_only(path, model)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise UserError(f"{tok_file} is missing (trained from a bare token file?)")
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception types
        raise UserError(f"{tok_file} is unreadable ({type(e).__name__}: {str(e)[:160]})") from e
    prompt = tok.encode(args.prompt).ids
    if not prompt:
        raise UserError(f"--prompt {args.prompt!r} holds no token; give text to continue")
    ids = sample(model, prompt, args.tokens, temperature=args.temperature,
                 top_k=args.top_k, seed=args.seed)
    print(tok.decode(ids, skip_special_tokens=False))
    return 0
