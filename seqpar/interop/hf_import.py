"""``seqpar import HF_DIR CHECKPOINT_DIR``: a Hugging Face model folder on disk -> a seqpar checkpoint.

``HF_DIR`` is a local folder (``config.json`` + weights, as ``save_pretrained`` writes them) of a
GPT-2 or Llama-family model; nothing is downloaded. The result is step 0 of ``CHECKPOINT_DIR``:
the weights in seqpar's dense layout, a fresh AdamW state (zero moments), the data position at
the start, ``config.yaml`` (the run config, its ``model`` section read from ``HF_DIR`` and its
``checkpoint.dir`` set to ``CHECKPOINT_DIR``) and the tokenizer as ``tokenizer.json`` (its bos / eos /
pad ids in ``tokenizer_origin.json``, which ``seqpar export`` writes back). So
``seqpar train CHECKPOINT_DIR/step_00000000/config.yaml data.source=...`` resumes from it at any
TP size and ``seqpar generate CHECKPOINT_DIR`` samples from it. The model is held in memory about
twice while converting (the Hugging Face copy, then seqpar's).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from ..config import RunConfig, dump, loader, resolve_config
from ..data.tokenizer import ORIGIN_FILE
from ..errors import UserError
from .hf_tokens import imported_origin

# GPTConfig fields read from the Hugging Face config; everything else (recompute, sequence
# parallelism, ...) comes from --config and the overrides
ARCHITECTURE = ("vocab_size", "seq_len", "hidden", "heads", "layers", "ffn_hidden", "kv_heads", "dropout",
                "attention_dropout", "activation", "tie_embeddings", "layernorm_eps", "bias", "init_std", "norm",
                "position", "rope_theta", "rope_scaling", "mlp", "dtype", "qk_norm", "moe")


def _load_hf(hf_dir: Path, dtype: str):
    """The local model (``transformers`` Auto classes, no download) and its seqpar interop module."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import gpt2 as interop_gpt2, llama as interop_llama, moe_hf

    if not (hf_dir / "config.json").is_file():
        raise UserError(f"{hf_dir} is not a Hugging Face model folder (no config.json)")
    try:
        kind = AutoConfig.from_pretrained(hf_dir, local_files_only=True).model_type
        interop = {"llama": interop_llama, "gpt2": interop_gpt2, "mixtral": moe_hf, "qwen3_moe": moe_hf}.get(kind)
        if interop is None:
            raise UserError(f"{hf_dir}: model_type {kind!r} is not supported (gpt2, llama, mixtral or qwen3_moe)")
        model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:  # transformers' errors for a folder it cannot load
        if isinstance(e, UserError):
            raise
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UserError(f"{hf_dir}: transformers cannot load this model folder ({type(e).__name__}: {first})") from e
    return model, interop


def _tokenizer_file(hf_dir: Path, scratch: Path) -> Path | None:
    """``tokenizer.json`` of ``hf_dir``, or one written from its slow-format files; None if neither."""
    if (hf_dir / "tokenizer.json").is_file():
        return hf_dir / "tokenizer.json"
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
        tok.backend_tokenizer.save(str(scratch / "tokenizer.json"))
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return scratch / "tokenizer.json"


def run_config(model_config, config: str | None, overrides: list[str], checkpoint_dir: Path) -> RunConfig:
    """``config`` (a file or shipped name; None: defaults) with ``model`` from the Hugging Face
    model, then ``overrides`` on top; ``checkpoint.dir`` is ``checkpoint_dir``."""
    data = loader.read_yaml(resolve_config(config)) if config else {}
    arch = {k: v for k, v in loader.to_dict(model_config).items() if k in ARCHITECTURE}
    data = loader.merge(data, {"model": arch, "checkpoint": {"dir": str(checkpoint_dir)}})
    run = loader.from_dict(RunConfig, loader.merge(data, loader.parse_overrides(overrides)))
    run.checkpoint.dir = str(checkpoint_dir)
    run.validate()
    return run


def _zero_adamw(model, run: RunConfig):
    """AdamW as the trainer builds it, with the state of step 0 written out (zero moments)."""
    from ..train.optim import build_optimizer

    tc = run.train
    optimizer = build_optimizer(model, lr=tc.lr, weight_decay=tc.weight_decay, betas=(tc.beta1, tc.beta2))
    for p in model.parameters():
        optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    return optimizer


def import_hf(hf_dir: str | Path, checkpoint_dir: str | Path, *, config: str | None = None,
              overrides: list[str] = (), dtype: str = "float32") -> Path:
    """Convert ``hf_dir`` into step 0 of ``checkpoint_dir`` (which must hold no checkpoint yet);
    returns the checkpoint folder. One process, no process group."""
    from ..model import GPT
    from ..checkpoint import complete_checkpoints, open_checkpoint_dir, save_checkpoint

    hf_dir, root = Path(hf_dir), Path(checkpoint_dir)
    if complete_checkpoints(root):
        raise UserError(f"{root} already holds checkpoints; import into an empty checkpoint dir")
    hf_model, interop = _load_hf(hf_dir, dtype)
    model_config, dense = interop.from_hf(hf_model)
    hf_config = hf_model.config
    del hf_model
    run = run_config(model_config, config, list(overrides), root)
    model = GPT(run.model, seed=run.train.seed)
    model.load_dense_state_dict(dense)
    del dense
    optimizer = _zero_adamw(model, run)
    batch = run.train.global_batch or run.train.micro_batch
    extra = {"data": {"step": 0, "seed": run.train.seed, "global_batch": batch}, "tp": 1, "dp": 1,
             "imported_from": str(hf_dir)}
    with tempfile.TemporaryDirectory() as scratch, open_checkpoint_dir(root, is_first=True):
        tok = _tokenizer_file(hf_dir, Path(scratch))
        attachments = None
        if tok is not None:  # the tokenizer and its special ids (the export writes them back)
            origin = Path(scratch) / ORIGIN_FILE
            origin.write_text(json.dumps(imported_origin(tok, hf_config, hf_dir)))
            attachments = {"tokenizer.json": tok, ORIGIN_FILE: origin}
        return save_checkpoint(root, 0, model, optimizer, extra, dump(run), model.rng, keep=run.checkpoint.keep,
                               attachments=attachments)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqpar import", description="Convert a local Hugging Face model folder "
                                "(GPT-2 or Llama family) into step 0 of a seqpar checkpoint dir.")
    p.add_argument("hf_dir", help="a folder written by save_pretrained (config.json + weights); never downloaded")
    p.add_argument("checkpoint_dir", help="an empty checkpoint dir; train with checkpoint.dir set to it")
    p.add_argument("overrides", nargs="*",
                   help="key=value run-config overrides (e.g. model.seq_len=2048 parallel.tp=2)")
    p.add_argument("--config", default=None, help="run config (file or shipped name) for everything but the model")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="parameter dtype (default float32: seqpar's master weights; train.precision=bf16 computes in bf16 on them)")
    args = p.parse_args(argv)
    path = import_hf(args.hf_dir, args.checkpoint_dir, config=args.config, overrides=args.overrides,
                     dtype=args.dtype)  # bad input: one line and exit 2 (seqpar.cli)
    given = any(o.startswith("data.source=") for o in args.overrides)
    print(f"wrote {path}\n  train:    seqpar train {path / 'config.yaml'}{'' if given else ' data.source=TOKENS'}\n"
          f"  generate: seqpar generate {path.parent}")
    return 0
