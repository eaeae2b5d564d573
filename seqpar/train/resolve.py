"""The run's configuration resolved once, before anything is built: :func:`resolve_run`.

Every derived value the Trainer needs is computed here by one pure function (no
``torch.distributed``, no files): the data-parallel size from the world size, the pipeline's
batch split, the accumulation steps, ``ddp`` or ``fsdp``, the pipeline schedule and its
micro-batch check, ``model.recompute: auto``'s per-layer modes, and on a resume the global batch
the checkpoint trained with (:func:`keep_saved_batch`; the Trainer reads it from the checkpoint
first and passes it in). Nothing rewrites the config after it: the Trainer reads the frozen
:class:`ResolvedRun`, whose config is a read-only copy (:func:`seqpar.model.config.freeze`;
assigning to any of its sections raises).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from dataclasses import dataclass

from ..config import RunConfig, TrainConfig
from ..distributed.mesh import ParallelMesh, validate_layout
from ..errors import UserError
from ..model.config import freeze
from ..parallel.pipeline import check_microbatches, resolve_schedule
from ..plan.recompute import resolve_recompute


@dataclass(frozen=True)
class ResolvedRun:
    """A run as it trains: the resolved config and the values derived from it."""

    cfg: RunConfig            # the config as run (pipeline batch split, per-layer recompute modes filled in)
    world_size: int           # ranks of the job: pp x dp x tp
    dp: int                   # data-parallel size
    accum: int                # micro-batches per optimizer step on each rank
    dp_mode: str              # "ddp" | "fsdp"
    schedule: str | None      # the pipeline schedule (None without pipeline stages)
    recompute_note: str | None = None  # what model.recompute: auto chose, for the header
    saved_global_batch: int | None = None  # the checkpoint's global batch the run was resolved for (a resume)
    batch_note: str | None = None      # how the run keeps (or changes) the checkpoint's global batch

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: ``micro_batch x accum x dp``."""
        return self.cfg.train.micro_batch * self.accum * self.dp

    def __post_init__(self) -> None:
        object.__setattr__(self, "cfg", freeze(self.cfg))  # a read-only copy: the caller's config stays its own


def _split_for_pipeline(tc: TrainConfig, pp: int, dp: int) -> TrainConfig:
    """pp > 1 without ``train.global_batch``: the step's batch stays ``micro_batch x dp`` (the
    run p = 1 would train) and runs as ``pp`` micro-batches, the fewest 1F1B needs."""
    if tc.micro_batch % pp:
        raise UserError(f"parallel.pp={pp} needs at least {pp} micro-batches per step: set train.global_batch "
                        f"(a multiple of micro_batch x dp x {pp}), or a train.micro_batch divisible by {pp} "
                        f"(got {tc.micro_batch})")
    return dataclasses.replace(tc, micro_batch=tc.micro_batch // pp, global_batch=tc.micro_batch * dp)


def keep_saved_batch(cfg: RunConfig, dp: int, saved: int) -> tuple[RunConfig, str | None]:
    """A resume trains the global batch its checkpoint trained with, ``saved`` sequences, at any dp.

    ``train.global_batch`` given: it is kept (a deliberate change, noted when it differs).
    Otherwise, when ``micro_batch x dp`` is not ``saved``, the config gets ``global_batch=saved``
    and the largest ``micro_batch`` (at most the configured one) that splits it over ``dp`` ranks
    into whole micro-batches (with ``pp > 1``: enough for the schedule); the note says what
    changed. Raises :class:`~seqpar.errors.UserError` naming both batches when no micro-batch can (``saved`` not a
    multiple of ``dp``)."""
    tc, pc = cfg.train, cfg.parallel
    if tc.global_batch is not None:
        same = tc.global_batch == saved
        return cfg, None if same else (f"train.global_batch={tc.global_batch} replaces the checkpoint's global "
                                       f"batch of {saved} sequences")
    if tc.micro_batch * dp == saved:
        return cfg, None
    schedule = resolve_schedule(pc.pp_schedule, pc.virtual_stages) if pc.pp > 1 else None
    for micro in range(min(tc.micro_batch, saved // dp), 0, -1):
        accum, rest = divmod(saved, micro * dp)
        if rest:
            continue
        if schedule is not None:
            try:
                check_microbatches(accum, pc.pp, schedule)
            except UserError:
                continue
        note = (f"resume keeps the checkpoint's global batch of {saved} sequences at dp={dp}: "
                f"train.micro_batch {tc.micro_batch}" + (f" -> {micro}" if micro != tc.micro_batch else "")
                + f", accumulation {accum} (set train.global_batch to change it)")
        return dataclasses.replace(cfg, train=dataclasses.replace(tc, micro_batch=micro, global_batch=saved)), note
    raise UserError(f"the checkpoint in checkpoint.dir={cfg.checkpoint.dir!r} trained with a global batch of "
                    f"{saved} sequences, which dp={dp} data-parallel ranks cannot split (this layout's "
                    f"micro_batch x dp = {tc.micro_batch} x {dp} would train {tc.micro_batch * dp}); resume "
                    f"at a dp that divides {saved}, or set train.global_batch to change the global batch")


def _auto_recompute(cfg: RunConfig, dp: int, device: str) -> tuple[RunConfig, str]:
    """``model.recompute: auto`` -> ``model.recompute_layers`` (the same search as ``seqpar plan``)."""
    planned = resolve_recompute(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=dp)),
                                device=device)
    modes = planned.model.recompute_layers
    note = (f"recompute auto under train.memory_budget_gib={cfg.train.memory_budget_gib}: "
            f"{modes.count('none')} none, {modes.count('selective')} selective, "
            f"{modes.count('full')} full layers ({', '.join(modes)})")
    if planned.model.recompute_ops:
        note += f", model.recompute_ops {list(planned.model.recompute_ops)}"
    return dataclasses.replace(cfg, model=planned.model), note


def resolve_run(cfg: RunConfig, world_size: int, device: str = "cpu", *,
                saved_global_batch: int | None = None) -> ResolvedRun:
    """Validate ``cfg`` and resolve it for ``world_size`` ranks on ``device`` (``"cpu"`` or
    ``"cuda"``: what ``recompute: auto`` plans for). ``saved_global_batch``: the global batch of
    the checkpoint the run resumes (:func:`seqpar.train.checkpointing.resume_global_batch`), kept
    at any dp (:func:`keep_saved_batch`). Pure arithmetic on the config: every rank raises the
    same :class:`~seqpar.errors.UserError` before any collective. ``cfg`` itself is left untouched; the run holds a
    read-only copy of it."""
    cfg.validate()
    pc = cfg.parallel
    dp = validate_layout(pc.tp, pc.dp, world_size, pc.pp, pc.cp)
    batch_note = None
    if saved_global_batch is not None:
        cfg, batch_note = keep_saved_batch(cfg, dp, saved_global_batch)
    if pc.pp > 1 and cfg.train.global_batch is None:
        cfg = dataclasses.replace(cfg, train=_split_for_pipeline(cfg.train, pc.pp, dp))
    accum = cfg.accumulation_steps(dp)
    schedule = None
    if pc.pp > 1:
        schedule = resolve_schedule(pc.pp_schedule, pc.virtual_stages)
        check_microbatches(accum, pc.pp, schedule)
    note = None
    if cfg.model.recompute == "auto":
        cfg, note = _auto_recompute(cfg, dp, device)
    return ResolvedRun(cfg=cfg, world_size=world_size, dp=dp, accum=accum, dp_mode=pc.data_parallel_mode(dp),
                       schedule=schedule, recompute_note=note, saved_global_batch=saved_global_batch,
                       batch_note=batch_note)


__all__ = ["ResolvedRun", "keep_saved_batch", "resolve_run"]


def check_trainer_arguments(cfg, mesh) -> None:
    """``Trainer``'s arguments are of the types it takes; its folders are folders, not files."""
    if not isinstance(cfg, (RunConfig, ResolvedRun)):
        raise UserError(f"Trainer(cfg): cfg must be a RunConfig (seqpar.config.load_run_config) or a ResolvedRun, "
                        f"got {type(cfg).__name__}")
    if mesh is not None and not isinstance(mesh, ParallelMesh):
        raise UserError(f"Trainer(mesh=...): mesh must be a ParallelMesh (seqpar.init_parallel), got "
                        f"{type(mesh).__name__}")
    run = cfg.cfg if isinstance(cfg, ResolvedRun) else cfg
    for key, path in (("checkpoint.dir", run.checkpoint.dir), ("out_dir", run.out_dir)):
        if Path(path).exists() and not Path(path).is_dir():
            raise UserError(f"{key}={path} is a file, not a folder; point {key} at a folder")


def check_mesh(run: ResolvedRun, mesh: ParallelMesh | None) -> None:
    """A given mesh has the config's layout (else throughput and the global batch would be wrong)."""
    if mesh is None:
        return
    pc = run.cfg.parallel
    want = {"tp": pc.tp, "pp": pc.pp, "cp": pc.cp, "dp": run.dp}
    got = {"tp": mesh.tp_size, "pp": mesh.pp_size, "cp": mesh.cp_size, "dp": mesh.dp_size}
    if want != got:
        diff = ", ".join(f"parallel.{k}={want[k]} but mesh {k}={got[k]}" for k in want if want[k] != got[k])
        raise UserError(f"Trainer(cfg, mesh): the mesh contradicts the config: {diff}; set the config's parallel "
                        f"section to the mesh's layout (or leave mesh out)")
