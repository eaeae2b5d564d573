"""Compiled transformer blocks: each block's forward compiled on its own with ``fullgraph=True``.

Applied after TP/SP and the recompute settings and before FSDP2 (whose hooks stay outside the
compiled graph), in the Trainer, in pipeline stages and for drop-in models. A block runs inside
``torch.utils.checkpoint`` with the selective-checkpoint policy of its recompute mode
(:func:`seqpar.recompute.run_with_policy`): selective recomputes exactly the attention core, and
nothing else is re-planned by the compiler, so the compiled step keeps Table 2's bytes. Dropout
draws through ``seqpar::stream_dropout`` (:mod:`seqpar.distributed.rng`) and the fused attention
kernel's through ``seqpar::stream_sdpa`` (:func:`seqpar.recompute.stream_sdpa`), so compiled masks
are the eager masks, replayed exactly by recomputation. Full recomputation checkpoints around the
compiled blocks, as in eager mode.

The block's parameters keep their names (the compiled function is set as the block instance's
``forward``; nothing is wrapped), so state dicts, checkpoints and FSDP2 are unchanged. All blocks
share one compiled graph per distinct shape and mode. Only training-mode forwards are compiled:
evaluation and generation (whose sequence grows token by token) run the eager block.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from ..recompute import COMPILE_OPTIONS, COMPILED_MARK, compile_unsupported, is_compiled_block, run_with_policy

@dataclasses.dataclass
class CompileReport:
    """What :func:`compile_blocks` compiled; ``seconds`` is filled in by :func:`compile_seconds`
    deltas once the first step has traced the graphs."""

    blocks: int
    mode: str
    seconds: float | None = None

    def line(self) -> str:
        took = "" if self.seconds is None else f", {self.seconds:.1f} s compiling in the first step"
        blocks = f"{self.blocks} transformer block" + ("s" if self.blocks != 1 else "")
        return (f"compile: {blocks} compiled one by one (fullgraph, {self.mode} "
                f"recompute policy){took}")


def merge_reports(reports: list[CompileReport]) -> CompileReport:
    """One report for several model parts (a rank's pipeline stages)."""
    modes = sorted({m for r in reports for m in r.mode.split("/")})
    return CompileReport(sum(r.blocks for r in reports), "/".join(modes))


def compile_enabled(setting: bool | str, device: torch.device, config=None, cp: int = 1) -> bool:
    """``train.compile``: true, false, or auto: on for CUDA, off for the CPU, and off where compiled
    blocks are not supported yet (:func:`~seqpar.recompute.compile_unsupported`; ``true`` there is an
    error naming it). MoE models run eagerly under auto (data-dependent token counts and all-to-all
    splits; ``true`` is refused by the run config)."""
    if setting == "auto":
        if getattr(config, "moe", None) is not None:
            return False
        return torch.device(device).type == "cuda" and compile_unsupported(config, cp) is None
    return bool(setting)


def compile_seconds() -> float:
    """Seconds torch.compile has spent so far in this process (dynamo, AOT and Inductor, forward and
    backward graphs), from dynamo's own timing table."""
    from torch._dynamo.utils import compilation_time_metrics
    keys = [k for k in compilation_time_metrics if k.endswith("compile_inner") or k.endswith("bw_compiler")]
    return float(sum(sum(compilation_time_metrics[k]) for k in keys))


def _policy_forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    mode = "selective" if getattr(block.attn, "recompute", False) else "none"
    ops = (("norm",) if getattr(block, "recompute_norm", False) else ()) + \
        (("activation",) if getattr(block.mlp, "recompute_activation", False) else ())
    return run_with_policy(lambda y: type(block).forward(block, y), x, mode, ops)


def _fresh_forward(backend: str | Callable = "inductor") -> Callable:
    """A compiled :func:`_policy_forward` with a code object of its own. Dynamo keeps its graphs
    (and its recompile limit) per code object: every block of one model shares this function's
    graphs (the block is an argument, one graph per distinct shape and mode), and another model
    in the same process does not eat into them."""
    fn = types.FunctionType(_policy_forward.__code__.replace(), _policy_forward.__globals__, "_policy_forward")
    return torch.compile(fn, fullgraph=True, backend=backend)


class _DropNotice(logging.Filter):
    """Drops the records of one logger whose message contains ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.msg)


# torch's advice, logged by every rank when it traces a checkpoint with a selective policy: keep the
# region free of in-place ops. Ours holds none (the compiled-vs-eager tests compare them exactly).
_SAC_NOTICE = ("torch._higher_order_ops.wrap", "context_fn is passed to torch.utils.checkpoint under torch.compile")


@contextlib.contextmanager
def _known_notices_dropped() -> Iterator[None]:
    """Around a compiled block's call (where tracing happens): :data:`_SAC_NOTICE` is not printed."""
    log, drop = logging.getLogger(_SAC_NOTICE[0]), _DropNotice(_SAC_NOTICE[1])
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def _compiled(block: nn.Module, compiled: Callable) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not block.training:  # evaluation and generation (growing lengths) run the eager block
            return type(block).forward(block, x)
        with torch._dynamo.config.patch(**COMPILE_OPTIONS), _known_notices_dropped():
            return compiled(block, x)
    setattr(forward, COMPILED_MARK, True)
    return forward


def compile_blocks(model: nn.Module, blocks: Iterable[nn.Module] | None = None, *,
                   backend: str | Callable = "inductor") -> CompileReport:
    """Compile each transformer block of ``model`` (a seqpar GPT, or the blocks given) in place.

    A block is compiled once: calling this again is a no-op for it. The model's dropout streams
    are seeded first (creating generators cannot be traced). ``backend``: torch.compile's."""
    from ..model.gpt import Block  # parallel applies to the model from outside
    check_compilable(model)
    rng = getattr(model, "rng", None)
    if rng is not None:
        rng.materialize()
    chosen = [b for b in (model.blocks if blocks is None else blocks) if isinstance(b, Block)]
    tables: dict[tuple, torch.Tensor] = {}  # one causal-bias table per shape, shared by the layers
    compiled = _fresh_forward(backend)
    for block in chosen:
        if not is_compiled_block(block):
            _prepare_tables(block, getattr(model, "config", None), tables)
            block.forward = _compiled(block, compiled)
    modes = sorted({"selective" if b.attn.recompute else "none" for b in chosen}) or ["none"]
    return CompileReport(len(chosen), "/".join(modes))


def _prepare_tables(block: nn.Module, config, tables: dict) -> None:
    """Build the RoPE and causal-bias tables at the model's sequence length before tracing (built
    inside the graph they would be side effects and a recompile at the second call)."""
    core, weight = block.attn.core, block.attn.qkv.weight
    if config is None:
        return
    rope = block.attn.rope
    if rope is not None:  # held as buffers too: a compiled graph keeps them, and they are no activation
        cos, sin = rope.tables.get(config.seq_len, weight.dtype, weight.device)
        rope.register_buffer("cos_table", cos, persistent=False)
        rope.register_buffer("sin_table", sin, persistent=False)
    if core.kernel(weight.device) != "math":
        return
    from ..model.attention import causal_bias
    r = block.attn.local_heads // block.attn.local_kv_heads
    key = (config.seq_len, r, weight.dtype, weight.device)
    if key not in tables:
        tables[key] = causal_bias(*key)
    core.prepare(tables[key], r)


def uncompile_blocks(model: nn.Module) -> None:
    """Undo :func:`compile_blocks`: the blocks run their eager forward again."""
    for block in model.modules():
        if is_compiled_block(block):
            del block.forward


def check_compilable(model: nn.Module) -> None:
    """Refuse what compiled blocks do not support yet, naming the setting."""
    why = compile_unsupported(getattr(model, "config", None), getattr(getattr(model, "cp", None), "size", 1))
    if why is not None:
        raise ValueError(why)
