"""The run schema: typed sections of a training run, loaded strictly from YAML plus ``key=value`` overrides.

Precedence: command line > file > defaults. Unknown keys and wrong types are errors naming the
dotted key (see :mod:`seqpar.config.loader`). Nothing here touches ``torch.distributed``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal

from ..model.config import GPTConfig
from . import loader
from .shipped import resolve_config


@dataclass
class ParallelConfig:
    tp: int = 1                  # tensor-parallel size t (one node's GPUs on a cluster)
    dp: int | None = None        # data-parallel size; None = world size / tp
    pp: int = 1                  # pipeline size: memory planning only (training supports pp=1)
    virtual_stages: int = 1      # interleaved pipeline chunks m: memory planning only
    timeout_minutes: float = 10  # a collective waiting longer fails the job instead of hanging it

    def validate(self) -> None:
        if self.tp < 1 or (self.dp is not None and self.dp < 1) or self.pp < 1 or self.virtual_stages < 1:
            raise ValueError(f"parallel sizes must be >= 1: tp={self.tp}, dp={self.dp}, pp={self.pp}, "
                             f"virtual_stages={self.virtual_stages}")


@dataclass
class DataConfig:
    source: str | None = None    # text file, directory, token file (.bin/.npy); None = Python's stdlib sources
    max_bytes: int = 8_000_000   # cap on the text read for the default corpus
    eval_fraction: float = 0.05  # tail of the token stream held out for eval
    cache_dir: str | None = None # tokenizer + token cache; None = $SEQPAR_CACHE or ~/.cache/seqpar


@dataclass
class TrainConfig:
    steps: int = 200
    micro_batch: int = 8         # sequences per rank per micro-step
    global_batch: int | None = None  # sequences per optimizer step; None = micro_batch * dp (no accumulation)
    lr: float = 1e-3
    min_lr: float = 1e-4         # cosine decay floor
    warmup_steps: int = 20
    weight_decay: float = 0.1    # on matrices only (not norms, biases, embeddings)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0       # global norm, TP-aware; 0 disables
    seed: int = 1234
    autocast: Literal["auto", "bf16", "none"] = "auto"  # auto: bf16 on CUDA, none on CPU
    log_interval: int = 10
    eval_interval: int = 50      # 0 disables
    eval_batches: int = 4
    threads_per_rank: int = 1    # CPU intra-op threads per rank

    def validate(self) -> None:
        for name in ("steps", "micro_batch", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= train.min_lr ({self.min_lr}) <= train.lr ({self.lr}) and lr > 0")


@dataclass
class CheckpointConfig:
    dir: str = "runs/checkpoints"
    interval: int = 100          # save every N steps (and at the end); 0 = only at the end
    keep: int = 2                # newest checkpoints kept
    resume: Literal["auto", "never"] = "auto"  # auto: continue from the newest checkpoint in dir


@dataclass
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    out_dir: str = "runs"        # metrics, TensorBoard logs, the resolved config

    def validate(self) -> None:
        if self.parallel.pp != 1:
            raise ValueError(f"parallel.pp={self.parallel.pp}: pipeline parallelism is for memory planning only "
                             f"(`seqpar memory`); training needs pp=1")
        self.model.check_parallel(self.parallel.tp)

    def accumulation_steps(self, dp: int) -> int:
        """Micro-batches per optimizer step on each rank."""
        if self.train.global_batch is None:
            return 1
        per_step = self.train.micro_batch * dp
        if self.train.global_batch % per_step:
            raise ValueError(f"train.global_batch ({self.train.global_batch}) must be a multiple of "
                             f"micro_batch x dp = {self.train.micro_batch} x {dp} = {per_step}")
        return self.train.global_batch // per_step


def load_run_config(path: str | Path | None, overrides: Iterable[str] = ()) -> RunConfig:
    """Load ``path`` with ``key=value`` overrides; raise ``ValueError`` on any bad key/value.

    ``path`` is a YAML file or the name of a shipped config (``tiny-cpu``, ``paper/175b``; see
    :func:`~seqpar.config.shipped.resolve_config`); ``None`` means the built-in defaults.
    """
    return loader.load(RunConfig, None if path is None else resolve_config(path), list(overrides))


def dump(cfg: RunConfig) -> str:
    """The YAML text of ``cfg``; :func:`load_run_config` of it rebuilds an equal config."""
    return loader.dump_yaml(cfg)
