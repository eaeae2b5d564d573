"""The run schema: typed sections of a training run, loaded strictly from YAML plus ``key=value`` overrides.

Precedence: command line > file > defaults. Unknown keys and wrong types are errors naming the
dotted key (see :mod:`seqpar.config.loader`); each section's ``validate()`` refuses out-of-range
values (a NaN learning rate, a zero batch, ...) naming the dotted key and the value, at load time,
before any data or process work. Nothing here touches ``torch.distributed``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal

from ..distributed.context import CP_COMMS, CPComm, check_context_layout
from ..errors import UserError
from ..model.config import Freezable, GPTConfig
from ..recompute import compile_unsupported
from ..model.modes import DATA_PARALLEL_MODES, PRECISION_SETTINGS, DataParallelMode, PrecisionSetting
from . import loader
from .shipped import resolve_config

_RULES = {
    "finite": lambda v: True,
    ">= 0": lambda v: v >= 0,
    "> 0": lambda v: v > 0,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in (0, 1)": lambda v: 0 < v < 1,
}


def check_number(key: str, value: float, rule: str = "finite") -> None:
    """Raise :class:`~seqpar.errors.UserError` naming ``key`` and ``value`` unless ``value`` is
    finite and obeys ``rule`` (one of ``finite``, ``>= 0``, ``> 0``, ``in [0, 1)``, ``in (0, 1)``)."""
    if not (math.isfinite(value) and _RULES[rule](value)):
        what = "a finite number" + ("" if rule == "finite" else f" {rule}")
        raise UserError(f"{key} must be {what}, got {value!r}")


def check_at_least(key: str, value: int | None, low: int) -> None:
    """Raise :class:`~seqpar.errors.UserError` naming ``key`` and ``value`` if ``value`` (``None``
    passes) is below ``low``."""
    if value is not None and value < low:
        raise UserError(f"{key} must be >= {low}, got {value!r}")


def check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raise :class:`~seqpar.errors.UserError` naming ``key`` and ``value`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise UserError(f"{key} must be one of {list(allowed)}, got {value!r}")


@dataclass
class ParallelConfig(Freezable):
    tp: int = 1                  # tensor-parallel size t (one node's GPUs on a cluster)
    dp: int | None = None        # data-parallel size; None = world size / (pp x cp x tp)
    pp: int = 1                  # pipeline stages p (outermost: each stage is dp x tp consecutive ranks)
    virtual_stages: int = 1      # model chunks m per pipeline rank (the interleaved schedule)
    timeout_minutes: float = 10  # a collective, or a wait for the data cache's lock, lasting longer fails the job
    # how gradients (and state) are shared over dp: "fsdp" shards parameters, gradients and AdamW
    # state over dp (FSDP2 fully_shard per block and on the root); "ddp" replicates them and
    # all-reduces gradients. None = fsdp when dp > 1 (with dp = 1 nothing is sharded either way)
    data_parallel: DataParallelMode | None = None
    # fsdp: free the gathered parameters after each block's forward and gather them again for its
    # backward (ZeRO-3-like, least memory) or keep them until backward (ZeRO-2-like, fewer gathers)
    reshard_after_forward: bool = True
    # ddp: gradients are all-reduced over dp (x cp) in buckets of about this many MiB, each launched
    # as soon as backward has produced all of its gradients (the bf16 recipe's fp32 buckets, or DDP's)
    bucket_mib: float = 25.0
    # pipeline schedule: None = "1F1B" when virtual_stages is 1, else "Interleaved1F1B"; "GPipe"
    # (all forwards, then all backwards) for comparison
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "GPipe"] | None = None
    # context parallelism: each sequence cut into 2*cp chunks, CP rank r holding chunks r and
    # 2cp-1-r (the mesh is pp x dp x cp x tp); attention exchanges K/V over cp by one all-gather
    # ("allgather") or by a ring of point-to-point steps overlapped with the blocks ("ring")
    cp: int = 1
    cp_comm: CPComm = "allgather"
    # sequence parallelism's all-gather before each column-parallel GEMM and reduce-scatter after
    # each row-parallel GEMM cut into per-rank chunks, each transfer under another chunk's GEMM
    # (forward and backward; PyTorch's async-TP kernels on CUDA + NCCL); same results and bytes
    tp_overlap: bool = False
    # expert parallelism: each MoE layer's experts split over ep ranks carved from dp x cp (ep divides
    # dp x cp); tokens reach their experts by all-to-all over ep; expert grads reduced over dp x cp / ep ranks
    ep: int = 1

    def validate(self) -> None:
        check_choice("parallel.cp_comm", self.cp_comm, CP_COMMS)
        for name in ("tp", "dp", "pp", "virtual_stages", "cp", "ep"):
            check_at_least(f"parallel.{name}", getattr(self, name), 1)
        check_number("parallel.timeout_minutes", self.timeout_minutes, "> 0")
        check_number("parallel.bucket_mib", self.bucket_mib, "> 0")
        if self.data_parallel is not None:
            check_choice("parallel.data_parallel", self.data_parallel, DATA_PARALLEL_MODES)
        if self.pp_schedule is not None:
            check_choice("parallel.pp_schedule", self.pp_schedule, ("1F1B", "Interleaved1F1B", "GPipe"))

    def data_parallel_mode(self, dp: int) -> str:
        """``ddp`` or ``fsdp`` for ``dp`` data-parallel ranks (``None`` resolves to fsdp when dp > 1
        without pipeline stages)."""
        if self.data_parallel is not None:
            return self.data_parallel
        return "fsdp" if dp > 1 and self.pp == 1 and self.cp == 1 and self.ep == 1 else "ddp"


@dataclass
class BlendSource(Freezable):
    source: str                  # any data.source form (text, datasets files, token files, Megatron)
    weight: float = 1.0          # share of the sequences drawn from it (normalised over the blend)


@dataclass
class DataConfig(Freezable):
    source: str | None = None    # text file or folder, datasets file(s) (.jsonl/.parquet/.arrow), token file
    #                              (.bin/.npy) or folder of shards, Megatron prefix (.bin+.idx); None = Python's stdlib
    sources: list[BlendSource] = field(default_factory=list)  # a blend [{source, weight}, ...] instead of source
    max_bytes: int = 8_000_000   # cap on the text read from a text source (raise it for a real corpus)
    eval_fraction: float = 0.05  # tail of the token stream held out for eval (of each source in a blend)
    cache_dir: str | None = None # tokenizer + token cache; None = $SEQPAR_CACHE or ~/.cache/seqpar
    # tokenizer.json or a local Hugging Face model folder that encodes text sources; None = the
    # tokenizer of the checkpoint being resumed when it was given or imported, else a BPE trained on the text
    tokenizer: str | None = None
    eot_id: int | None = None    # id placed between documents; None = the tokenizer's end-of-text/eos token
    text_field: str = "text"     # the column of datasets files that holds each record's text
    workers: int = 1             # tokenizer processes per rank while a text cache is built
    # keep attention inside each document (packed sequences are separated by end-of-text only): not supported yet
    document_masking: bool = False

    def validate(self) -> None:
        check_at_least("data.max_bytes", self.max_bytes, 1)
        check_at_least("data.workers", self.workers, 1)
        check_at_least("data.eot_id", self.eot_id, 0)
        check_number("data.eval_fraction", self.eval_fraction, "in (0, 1)")
        if self.sources and self.source is not None:
            raise UserError(f"set data.source={self.source!r} or data.sources (a blend), not both")
        for i, part in enumerate(self.sources):
            check_number(f"data.sources[{i}].weight ({part.source!r})", part.weight, "> 0")
        if self.document_masking:
            raise UserError("data.document_masking=true (attention kept inside each document) is not supported "
                            "yet; sequences are packed across documents, separated by the end-of-text id")


@dataclass
class TrainConfig(Freezable):
    steps: int = 200
    micro_batch: int = 8         # sequences per rank per micro-step
    global_batch: int | None = None  # sequences per optimizer step; None = micro_batch * dp (no accumulation),
    #                                  or on a resume the checkpoint's (kept at any dp)
    lr: float = 1e-3
    min_lr: float = 1e-4         # cosine decay floor
    warmup_steps: int = 20
    weight_decay: float = 0.1    # on matrices only (not norms, biases, embeddings)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0       # global norm, TP-aware; 0 disables
    seed: int = 1234
    # fp32 | bf16 (the paper: bf16 compute on fp32 master weights, fp32 grads and AdamW) |
    # bf16-autocast (torch.autocast over fp32 parameters) | auto (bf16 on CUDA, fp32 on CPU)
    precision: PrecisionSetting = "auto"
    log_interval: int = 10
    eval_interval: int = 50      # 0 disables
    eval_batches: int = 4
    threads_per_rank: int = 1    # CPU intra-op threads per rank
    # a step whose gradients hold NaN/inf: "stop" the run naming the step, or "skip" the optimizer
    # step (weights untouched) and count it
    nonfinite_grads: Literal["stop", "skip"] = "stop"
    # under nonfinite_grads=skip: the most steps skipped in a row; one more stops the run (exit 2)
    # naming them and the last good checkpoint to roll back to
    max_skipped_steps: int = 10
    # compile each transformer block (torch.compile, fullgraph): true | false | auto (on for CUDA,
    # off for the CPU, where compiled blocks measured no faster: docs/benchmarks.md)
    compile: bool | Literal["auto"] = "auto"
    # GiB per GPU that model.recompute: auto must fit (state, activations and the planner's
    # workspace allowance, seqpar.plan.memory); None = no budget
    memory_budget_gib: float | None = None
    # refuse, before anything is built, a run whose predicted peak memory per rank (the planner's
    # formulas) exceeds the device's (a GPU's memory; on the CPU the host's RAM over its ranks)
    memory_check: bool = True
    # the end-of-run sample's prompt; None = the first tokens of a held-out document
    sample_prompt: str | None = None
    # new tokens of the end-of-run sample; 0 = no sample (a whole-model forward per token: under
    # TP or FSDP each one runs the layers' collectives)
    sample_tokens: int = 48

    def validate(self) -> None:
        for name in ("steps", "micro_batch", "global_batch", "log_interval", "eval_batches", "threads_per_rank",
                     "max_skipped_steps"):
            check_at_least(f"train.{name}", getattr(self, name), 1)
        for name in ("warmup_steps", "eval_interval", "seed", "sample_tokens"):
            check_at_least(f"train.{name}", getattr(self, name), 0)
        check_number("train.lr", self.lr, "> 0")
        check_number("train.min_lr", self.min_lr, ">= 0")
        if self.min_lr > self.lr:
            raise UserError(f"train.min_lr ({self.min_lr!r}) must be <= train.lr ({self.lr!r})")
        for name, rule in (("beta1", "in [0, 1)"), ("beta2", "in [0, 1)"), ("weight_decay", ">= 0"),
                           ("grad_clip", ">= 0")):
            check_number(f"train.{name}", getattr(self, name), rule)
        check_choice("train.precision", self.precision, PRECISION_SETTINGS)
        check_choice("train.nonfinite_grads", self.nonfinite_grads, ("stop", "skip"))
        check_choice("train.compile", self.compile, (True, False, "auto"))
        if self.memory_budget_gib is not None:
            check_number("train.memory_budget_gib", self.memory_budget_gib, "> 0")


@dataclass
class CheckpointConfig(Freezable):
    dir: str = "runs/checkpoints"
    interval: int = 100          # save every N steps (and at the end); 0 = only at the end
    keep: int = 2                # newest checkpoints kept
    # auto: continue from the newest checkpoint in dir; never: start afresh; a path: that checkpoint
    # folder (step_N), or the newest checkpoint of that dir (seqpar.checkpoint.resume_named)
    resume: str = "auto"
    # checkpoint.async: write a checkpoint in the background (torch.distributed.checkpoint's
    # async_save) while training goes on; it is sealed (marker, latest, keep-N) before the next one
    async_save: bool = field(default=False, metadata={"key": "async"})
    # check every file of a checkpoint against the CRC-32 its complete.json records before
    # loading it; a damaged newest checkpoint is then skipped for the previous one (auto resume)
    verify: bool = True
    # resume even when the checkpoint was trained on another token stream or tokenizer (e.g.
    # fine-tuning on new data); otherwise such a resume is refused (seqpar.checkpoint.compat)
    allow_data_change: bool = False

    def validate(self) -> None:
        check_at_least("checkpoint.interval", self.interval, 0)
        check_at_least("checkpoint.keep", self.keep, 1)
        if not self.resume.strip():
            raise UserError(f"checkpoint.resume must be auto, never or a checkpoint path, got {self.resume!r}")


@dataclass
class RunConfig(Freezable):
    model: GPTConfig = field(default_factory=GPTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    out_dir: str = "runs"        # metrics, TensorBoard logs, the resolved config

    def validate(self) -> None:
        """Every section's checks (the loader has run them already; configs built in Python have not),
        then the cross-section ones."""
        for section in (self.parallel, self.data, self.train, self.checkpoint):
            section.validate()
        if self.model.recompute == "auto" and self.train.memory_budget_gib is None:
            raise UserError("model.recompute=auto needs train.memory_budget_gib (GiB per GPU the per-layer "
                            "recompute must fit); set it, or choose model.recompute none|selective|full")
        self._validate_pipeline()
        self.model.check_parallel(self.parallel.tp)
        self._validate_context()
        self._validate_experts()
        if self.train.compile is True and (why := compile_unsupported(self.model, self.parallel.cp)):
            raise UserError(f"{why} (train.compile=auto runs such a run eagerly)")
        if self.parallel.tp_overlap and not self.model.sequence_parallel:
            raise UserError("parallel.tp_overlap=true overlaps sequence parallelism's all-gather and reduce-scatter "
                            "with the GEMMs; it needs model.sequence_parallel=true")

    def _validate_context(self) -> None:
        """Context parallelism: the sequence into 2*cp chunks (over t under SP); what cp does not
        compose with yet is refused here, naming the keys."""
        pc, mc = self.parallel, self.model
        if pc.cp == 1:
            return
        try:
            check_context_layout(mc.seq_len, pc.cp, pc.tp, mc.sequence_parallel)
        except UserError as e:
            raise UserError(f"model.seq_len / parallel.cp: {e}") from None
        if mc.attention_dropout > 0:
            raise UserError(f"model.attention_dropout={mc.attention_dropout} with parallel.cp={pc.cp} is not "
                            f"supported yet; set model.attention_dropout=0")
        if pc.pp > 1 and pc.cp_comm != "allgather":
            raise UserError(f"parallel.cp_comm={pc.cp_comm} with parallel.pp={pc.pp} is not supported yet: "
                            f"pipeline stages exchange K/V by allgather (set parallel.cp_comm=allgather)")

    def _validate_experts(self) -> None:
        """Expert parallelism and MoE: what does not compose yet is refused here, naming the keys."""
        pc, moe = self.parallel, self.model.moe
        if moe is not None and self.train.compile is True:
            raise UserError("model.moe with train.compile=true is not supported yet: the router's token counts "
                            "and the all-to-all splits are data-dependent (train.compile=auto runs MoE eagerly)")
        if moe is not None and pc.cp > 1 and moe.capacity_factor is not None:
            raise UserError(f"model.moe.capacity_factor with parallel.cp={pc.cp} is not supported yet (a rank's "
                            f"two sequence chunks are not contiguous, so the capacity queue has no global order)")
        if pc.ep == 1:
            return
        if moe is None:
            raise UserError(f"parallel.ep={pc.ep} splits experts, but the model has none (set model.moe)")
        moe.check_experts_parallel(pc.ep)
        if pc.dp is not None and (pc.dp * pc.cp) % pc.ep:
            raise UserError(f"parallel.ep={pc.ep} must divide parallel.dp x parallel.cp = {pc.dp} x {pc.cp} (experts "
                            f"are split over ranks carved from dp x cp)")

    def _validate_pipeline(self) -> None:
        """Pipeline stages: L divisible into pp x virtual_stages stages, a schedule that fits m."""
        pc, L = self.parallel, self.model.layers
        if pc.pp == 1:
            if pc.virtual_stages != 1:
                raise UserError(f"parallel.virtual_stages={pc.virtual_stages} needs parallel.pp > 1 (pp=1)")
            return
        stages = pc.pp * pc.virtual_stages
        if L % stages:
            raise UserError(f"model.layers={L} is not divisible into parallel.pp x parallel.virtual_stages = "
                            f"{pc.pp} x {pc.virtual_stages} = {stages} pipeline stages of equal depth")
        if pc.pp_schedule in ("1F1B", "GPipe") and pc.virtual_stages != 1:
            raise UserError(f"parallel.pp_schedule={pc.pp_schedule} runs one stage per rank; "
                            f"parallel.virtual_stages={pc.virtual_stages} needs Interleaved1F1B")
        if pc.data_parallel == "fsdp":
            raise UserError(f"parallel.data_parallel=fsdp with parallel.pp={pc.pp} is not supported: pipeline "
                            f"stages reduce their gradients over dp themselves (use ddp, the default with pp > 1)")

    def accumulation_steps(self, dp: int) -> int:
        """Micro-batches per optimizer step on each rank."""
        if self.train.global_batch is None:
            return 1
        per_step = self.train.micro_batch * dp
        if self.train.global_batch % per_step:
            raise UserError(f"train.global_batch ({self.train.global_batch}) must be a multiple of "
                            f"micro_batch x dp = {self.train.micro_batch} x {dp} = {per_step}")
        return self.train.global_batch // per_step


def load_run_config(path: str | Path | None, overrides: Iterable[str] = ()) -> RunConfig:
    """Load ``path`` with ``key=value`` overrides; raise :class:`~seqpar.config.ConfigError` (a
    :class:`~seqpar.errors.UserError`) on any bad key/value.

    ``path`` is a YAML file or the name of a shipped config (``tiny-cpu``, ``paper/175b``; see
    :func:`~seqpar.config.shipped.resolve_config`); ``None`` means the built-in defaults.
    """
    return loader.load(RunConfig, None if path is None else resolve_config(path), list(overrides))


def dump(cfg: RunConfig) -> str:
    """The YAML text of ``cfg``; :func:`load_run_config` of it rebuilds an equal config."""
    return loader.dump_yaml(cfg)
