"""The systems of the side-by-side benchmark, each built fresh for one cell and stepped alike.

A builder takes a :class:`~seqpar.tools.bench.side_by_side.Cell`, the shape, the dropout and the
device and returns a :class:`Stepper`: ``step(tokens, labels)`` runs forward, backward and the
optimizer step and returns the loss (a tensor, or None where the step keeps it on the device).

* ``seqpar``: seqpar's GPT on one device (no TP), ``model.attention`` and ``model.recompute`` as the
  cell says, blocks compiled by ``seqpar.parallel.compile.compile_blocks``, the Trainer's AdamW
  groups (fused on CUDA) over parameters in the shape's dtype.
* ``trainer``: the Trainer's own step (:meth:`seqpar.train.Trainer.train_step`) with the paper's
  precision recipe (``train.precision=bf16``: fp32 master weights and AdamW states, bf16 compute
  copies) on random token ids written to a token file.
* ``plain``: :class:`~seqpar.tools.bench.plain_peer.UserGPT`, a GPT as a user writes it (SDPA,
  per-block ``compile``, fused AdamW).
* ``megatron-core``: :class:`~seqpar.tools.bench.megatron_peer.MegatronPeer` (local layer spec) on a
  one-rank world; skipped with the reason when ``megatron.core`` does not import.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch

from ...distributed.mesh import ParallelMesh
from ...model import GPT, GPTConfig
from ...parallel.compile import compile_blocks
from ...train.optim import build_optimizer
from .peer import BenchShape


class SkipCell(Exception):
    """The cell cannot run in this environment (an optional package, a feature of another build)."""


class Stepper(Protocol):
    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None: ...

    def close(self) -> None: ...


def split_recompute(recompute: str) -> tuple[str, tuple[str, ...]]:
    """``"selective+norm+activation"`` -> ``("selective", ("norm", "activation"))``: the layer mode
    and the op-level choices (``model.recompute_ops``)."""
    mode, *ops = recompute.split("+")
    return mode, tuple(ops)


def model_config(shape: BenchShape, *, attention: str = "math", recompute: str = "none",
                 dropout: float = 0.0) -> GPTConfig:
    """The cell's GPTConfig at ``t = 1`` (also what every system's FLOPs are counted from)."""
    mode, ops = split_recompute(recompute)
    return GPTConfig(vocab_size=shape.vocab_size, seq_len=shape.seq_len, hidden=shape.hidden, heads=shape.heads,
                     layers=shape.layers, dropout=dropout, attention_dropout=dropout, sequence_parallel=False,
                     recompute=mode, attention=attention, dtype=shape.dtype, recompute_ops=ops)


class _Closing:
    def close(self) -> None:
        pass


class SeqparStepper(_Closing):
    def __init__(self, cell, shape: BenchShape, dropout: float, device: torch.device, backend: str):
        cfg = model_config(shape, attention=cell.attention, recompute=cell.recompute, dropout=dropout)
        self.model = GPT(cfg, ParallelMesh.single(device), seed=0)
        if cell.compiled:
            compile_blocks(self.model, backend=backend)
        self.optimizer = build_optimizer(self.model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.model(tokens, labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


class PlainStepper(_Closing):
    def __init__(self, cell, shape: BenchShape, dropout: float, device: torch.device, backend: str):
        from .plain_peer import UserGPT, user_adamw
        if cell.attention != "sdpa":
            raise ValueError(f"the plain peer's attention is F.scaled_dot_product_attention (sdpa), "
                             f"got attention={cell.attention!r}")
        self.model = UserGPT(shape, dropout=dropout, recompute=cell.recompute, device=device)
        if cell.compiled:
            self.model.compile_blocks(backend)
        self.optimizer = user_adamw(self.model)

    step = SeqparStepper.step


class MegatronStepper(_Closing):
    """Megatron-core's GPTModel through :class:`MegatronPeer` on a one-rank world (NCCL on CUDA,
    gloo with the peer's CPU patches elsewhere) made here and destroyed by :meth:`close`."""

    def __init__(self, cell, shape: BenchShape, dropout: float, device: torch.device, backend: str):
        try:
            import megatron.core  # noqa: F401
        except ImportError as e:
            raise SkipCell(f"megatron.core does not import ({e}); pip install -e '.[bench]'") from None
        if cell.compiled or cell.attention != "math":
            raise ValueError("Megatron-core's local layer spec runs eagerly with its own unfused attention core: "
                             f"its cell is megatron-core/eager/math/..., got {cell.name}")
        self.peer = None
        # on the CPU the peer's patches make Megatron's "CUDA" RNG states the CPU generator's, so
        # its notice that the CPU state changed inside a dropout fork is expected: hidden here
        self._rng_log = logging.getLogger("megatron.core.tensor_parallel.random")
        self._rng_level = self._rng_log.level
        if device.type != "cuda":
            self._rng_log.setLevel(logging.ERROR)
        self._world = _one_rank_world(device)
        try:
            self._build(cell, shape, dropout, device)
        except BaseException:
            self.close()
            raise

    def _build(self, cell, shape: BenchShape, dropout: float, device: torch.device) -> None:
        from .megatron_peer import MegatronPeer
        reference = GPT(model_config(shape), ParallelMesh.single(device), seed=0)
        dense = reference.dense_state_dict()  # Megatron loads seqpar's weights (its init is off)
        del reference
        self.peer = MegatronPeer()
        self.peer.build(dataclasses.replace(shape, dropout=dropout), dense, tp_group=None, tp_rank=0, tp_size=1,
                        recompute=cell.recompute, sequence_parallel=False)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.peer.step(tokens, labels))

    def close(self) -> None:
        self.peer = None
        self._rng_log.setLevel(self._rng_level)
        if self._world is not None:
            self._world()


def _one_rank_world(device: torch.device) -> Callable[[], None] | None:
    """Start a one-rank default process group (file rendezvous) unless one exists; returns the
    function that ends it (and Megatron's parallel state), or None when it was there before."""
    import torch.distributed as dist
    if dist.is_initialized():
        return None
    folder = tempfile.mkdtemp(prefix="seqpar-sbs-")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{folder}/rdzv",
                            rank=0, world_size=1)

    def end() -> None:
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)

    return end


def trainer_overrides(cell, shape: BenchShape, dropout: float, folder: Path) -> list[str]:
    """The Trainer's ``key=value`` overrides for ``cell``: the shape, one micro-batch per step, the
    paper's bf16 recipe, nothing logged, evaluated or saved, random token ids from ``folder``."""
    mode, ops = split_recompute(cell.recompute)
    tokens = np.random.default_rng(0).integers(0, shape.vocab_size,
                                               size=max(200_000, 100 * shape.micro_batch * (shape.seq_len + 1)))
    np.save(folder / "tokens.npy", tokens.astype(np.uint16 if shape.vocab_size <= 2**16 else np.int32))
    over = {"model.vocab_size": shape.vocab_size, "model.seq_len": shape.seq_len, "model.hidden": shape.hidden,
            "model.heads": shape.heads, "model.layers": shape.layers, "model.dropout": dropout,
            "model.attention_dropout": dropout, "model.sequence_parallel": "false", "model.recompute": mode,
            "model.attention": cell.attention, "train.precision": "bf16", "train.compile": str(cell.compiled).lower(),
            "train.micro_batch": shape.micro_batch, "train.global_batch": shape.micro_batch,
            "train.steps": 100_000, "train.log_interval": 100_000, "train.eval_interval": 0,
            "checkpoint.interval": 0, "checkpoint.resume": "never", "data.source": str(folder / "tokens.npy"),
            "data.cache_dir": str(folder / "cache"), "checkpoint.dir": str(folder / "ckpt"),
            "out_dir": str(folder / "out")}
    if ops:
        over["model.recompute_ops"] = "[" + ",".join(ops) + "]"
    return [f"{k}={v}" for k, v in over.items()]


class TrainerStepper:
    """The Trainer on one device, ``train.precision=bf16``: each call is ``train_step`` of the next
    step; its loss stays on the device (None) where the Trainer does not read it."""

    def __init__(self, cell, shape: BenchShape, dropout: float, device: torch.device, backend: str):
        from ...config import load_run_config
        from ...train import Trainer
        self._tmp = tempfile.TemporaryDirectory(prefix="seqpar-sbs-trainer-")
        self._threads = torch.get_num_threads()  # the Trainer sets train.threads_per_rank on the CPU
        try:
            cfg = load_run_config(None, trainer_overrides(cell, shape, dropout, Path(self._tmp.name)))
            self.trainer = Trainer(cfg, mesh=ParallelMesh.single(device))
        except BaseException:
            torch.set_num_threads(self._threads)
            self._tmp.cleanup()
            raise
        self.trainer.logger.enabled = False
        self._step = 0

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        self.trainer.train_step(self._step)
        self._step += 1

    def close(self) -> None:
        self.trainer.close()
        self._tmp.cleanup()
        torch.set_num_threads(self._threads)  # the next cells run as the ones before


BUILDERS: dict[str, Callable[..., Stepper]] = {"seqpar": SeqparStepper, "trainer": TrainerStepper,
                                               "plain": PlainStepper, "megatron-core": MegatronStepper}


def build(cell, shape: BenchShape, dropout: float, device: torch.device, backend: str) -> Stepper:
    """A fresh stepper for ``cell`` (unknown systems are a ValueError naming the known ones)."""
    if cell.system not in BUILDERS:
        raise ValueError(f"unknown system {cell.system!r}; systems are {sorted(BUILDERS)}")
    return BUILDERS[cell.system](cell, shape, dropout, device, backend)
