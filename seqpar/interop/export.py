"""``seqpar export CHECKPOINT OUT --format hf``: a seqpar checkpoint as a Hugging Face model folder.

``OUT`` gets ``config.json`` (a ``GPT2Config`` or ``LlamaConfig``), ``model.safetensors`` and, when
the checkpoint carries a tokenizer, ``tokenizer.json``, ``tokenizer_config.json`` and
``generation_config.json`` with its bos / eos / pad ids (:mod:`seqpar.interop.hf_tokens`), so
``AutoModelForCausalLM`` and ``AutoTokenizer`` load it and ``generate`` stops at end of text.
The family follows the model config: LayerNorm + learned positions + GeLU with biases is GPT-2,
RMSNorm + RoPE + SwiGLU is Llama; other mixes have no Hugging Face class and are refused.
Tensors are read from the checkpoint one at a time (a DCP load of one key) and streamed into the
safetensors file, so the whole model is never in memory.
"""
from __future__ import annotations

import argparse
import shutil
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..checkpoint.safetensors import write_safetensors
from ..errors import UserError, file_error
from ..model.config import DTYPES, GPTConfig
from .hf_tokens import special_ids, write_tokenizer_files

Loader = Callable[[str], torch.Tensor]
# every file an export of either format writes; a folder holds one export, so after writing one the
# others (left by an earlier export, in the other format or from a checkpoint with a tokenizer) go
EXPORT_FILES = ("config.json", "config.yaml", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json")


def family_of(config: GPTConfig) -> str:
    """``"gpt2"``, ``"llama"``, or for an MoE model ``"qwen3_moe"`` (with QK-norm) or ``"mixtral"``; a
    :class:`UserError` naming the fields of a mix no family has."""
    gpt2 = dict(norm="layernorm", position="learned", mlp="gelu", bias=True, kv_heads=None)
    llama = dict(norm="rmsnorm", position="rope", mlp="swiglu")
    values = {k: getattr(config, k) for k in gpt2}
    if values["kv_heads"] == config.heads:
        values["kv_heads"] = None
    if all(values[k] == v for k, v in gpt2.items()):
        return "gpt2"
    if all(values[k] == v for k, v in llama.items()):
        if config.moe is not None:
            return "qwen3_moe" if config.qk_norm else "mixtral"
        return "llama"
    raise UserError(f"no Hugging Face family has this model: {values} (GPT-2 needs {gpt2}; Llama needs {llama})")


def hf_stream(config: GPTConfig, load: Loader) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, tensor)`` for every tensor of the HF state dict (tied weights once),
    calling ``load(dense_name)`` once per seqpar dense tensor, in a fixed order."""
    family = family_of(config)
    if family == "llama":
        from .llama import hf_tensors

        yield from hf_tensors(config, load)
        return
    if family in ("mixtral", "qwen3_moe"):
        from .moe_hf import hf_names

        for ours, parts in hf_names(config).items():
            w = load(ours)
            for theirs, r0, rows in parts:
                yield theirs, (w if rows is None else w.narrow(0, r0, rows))
        return
    from .gpt2 import _names

    for ours, (theirs, transposed) in _names(config.layers, config.tie_embeddings).items():
        w = load(ours)
        yield theirs, (w.t() if transposed else w)


def hf_config(config: GPTConfig, shapes: dict[str, torch.Size], **hf_kwargs):
    """The ``transformers`` config object of ``config``: ``to_hf`` run on the meta device, so its
    name and value mapping is the one used, without allocating the model (``hf_kwargs``: to the
    config, e.g. the special token ids)."""
    from . import gpt2 as interop_gpt2, llama as interop_llama, moe_hf

    family = family_of(config)
    to_hf = {"llama": interop_llama.to_hf, "gpt2": interop_gpt2.to_hf}.get(
        family, lambda c, d, **kw: moe_hf.to_hf(c, d, family, **kw))
    with torch.device("meta"):
        model = to_hf(config, {k: torch.empty(s, dtype=config.torch_dtype) for k, s in shapes.items()}, **hf_kwargs)
    model.config.architectures = [type(model).__name__]
    return model.config


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint folder: ``path`` itself, or the one a checkpoint dir resumes from."""
    from ..checkpoint import checkpoint_problem, latest_checkpoint

    path = Path(path)
    if not (path / "extra.json").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise UserError(f"no complete checkpoint at {path}")
        path = found
    problem = checkpoint_problem(path)
    if problem is not None:
        raise UserError(f"checkpoint {path} is incomplete: {problem}")
    return path


def checkpoint_tensors(path: Path) -> tuple[dict[str, tuple[torch.Size, torch.dtype]], Loader]:
    """Dense model tensor name -> (shape, dtype) from the checkpoint's metadata, and a loader
    reading one of them (one DCP load of that key, through the checkpoint's safe reader)."""
    import torch.distributed.checkpoint as dcp

    from ..checkpoint import SafeReader

    reader = SafeReader(path)
    entries = {k[len("model."):]: (m.size, m.properties.dtype)
               for k, m in reader.read_metadata().state_dict_metadata.items() if k.startswith("model.")}

    def load(name: str) -> torch.Tensor:
        shape, dtype = entries[name]
        buf = torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # one process without a process group is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": {name: buf}}, storage_reader=SafeReader(path), no_dist=True)
        return buf
    return entries, load


def export_hf(checkpoint: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the Hugging Face folder of ``checkpoint`` into ``out`` (created; files replaced)."""
    from ..config import load_run_config

    path, out = resolve_checkpoint(checkpoint), Path(out)
    config = load_run_config(path / "config.yaml").model
    entries, load = checkpoint_tensors(path)
    target = DTYPES[dtype or config.dtype]
    shapes = {k: s for k, (s, _) in entries.items()}
    header = [(name, tuple(t.shape), target) for name, t in
              hf_stream(config, lambda n: torch.empty(shapes[n], device="meta"))]
    out.mkdir(parents=True, exist_ok=True)
    ids = special_ids(path)  # the checkpoint's tokenizer's, never a family default outside the vocabulary
    cfg = hf_config(config, shapes, **ids)
    cfg.dtype = target
    cfg.save_pretrained(out)
    write_safetensors(out / "model.safetensors", header, hf_stream(config, load))
    written = _copy_tokenizer(path, out) | write_tokenizer_files(path, out, ids, config.seq_len)
    _drop_stale(out, {"config.json", "model.safetensors"} | written)
    return out


def _copy_tokenizer(checkpoint: Path, out: Path) -> set[str]:
    """The checkpoint's ``tokenizer.json`` into ``out``; the names written."""
    if not (checkpoint / "tokenizer.json").is_file():
        return set()
    shutil.copyfile(checkpoint / "tokenizer.json", out / "tokenizer.json")
    return {"tokenizer.json"}


def _drop_stale(out: Path, written: set[str]) -> None:
    """Remove the :data:`EXPORT_FILES` this export did not write (an earlier export's, replaced by
    ``--force``): a stale ``config.json`` beside seqpar's names, ``config.yaml`` beside Hugging
    Face's, or a tokenizer of another checkpoint would make the folder load as the wrong thing.
    Other files are left alone."""
    for name in EXPORT_FILES:
        if name not in written:
            (out / name).unlink(missing_ok=True)


def export_safetensors(checkpoint: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the dense model of ``checkpoint`` under seqpar's own names (:meth:`GPT.dense_state_dict`)
    as ``out/model.safetensors``, one tensor read from the checkpoint at a time, with its
    ``config.yaml`` (and ``tokenizer.json``). ``seqpar generate OUT`` reads the folder;
    ``seqpar.interop.gpt2.to_hf`` / ``seqpar.interop.llama.to_hf`` take the loaded tensors."""
    path, out = resolve_checkpoint(checkpoint), Path(out)
    entries, load = checkpoint_tensors(path)
    header = [(name, tuple(shape), DTYPES[dtype] if dtype else dt) for name, (shape, dt) in entries.items()]
    target = {name: dt for name, _, dt in header}
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", header, ((n, load(n).to(target[n])) for n in entries))
    shutil.copyfile(path / "config.yaml", out / "config.yaml")
    _drop_stale(out, {"config.yaml", "model.safetensors"} | _copy_tokenizer(path, out))
    return out


def _check_out(out: Path, force: bool) -> None:
    """Refuse an ``out`` that is a file, or a folder holding files unless ``force``."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a folder; choose another output folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"{out} already holds files; pass --force to write into it (an earlier export "
                        f"replaced)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqpar export", description="Write a seqpar checkpoint as one dense model "
                                "file: a Hugging Face model folder (--format hf: config.json + model.safetensors "
                                "[+ tokenizer.json]) or seqpar's own names (--format safetensors: model.safetensors "
                                "+ config.yaml [+ tokenizer.json]). Tensors are read and written one at a time.")
    p.add_argument("checkpoint", help="a checkpoint folder (step_N) or a checkpoint dir holding 'latest'")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--format", choices=["hf", "safetensors"], default="hf",
                   help="hf: a Hugging Face transformers folder (default); safetensors: seqpar's dense names")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="tensor dtype in the export (default: the checkpoint's)")
    p.add_argument("--force", action="store_true", help="write into OUT even when it already holds files: "
                   "an earlier export there, of either format, is replaced (its files removed); other files stay")
    args = p.parse_args(argv)
    _check_out(Path(args.out), args.force)
    try:
        out = (export_hf if args.format == "hf" else export_safetensors)(args.checkpoint, args.out, args.dtype)
    except OSError as e:  # a file of the checkpoint unreadable, or the output folder not writable
        if isinstance(e, UserError):
            raise
        raise file_error(f"seqpar export {args.checkpoint} {args.out}", e) from e
    if args.format == "hf":
        print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    else:
        print(f"wrote {out / 'model.safetensors'} and {out / 'config.yaml'} (seqpar generate {out})")
    return 0
