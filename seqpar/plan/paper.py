"""The paper's measurements the planner is calibrated on (Table 4) and checked against (Table 5).

Table 3's layouts come from the shipped configs ``paper/22b`` ... ``paper/1t`` (dp = 1: the
GPU count is t x p). "Full recompute" is Table 5's baseline: TP without SP, every layer
recomputed; "present work" is TP + SP + selective recompute.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..memory.formulas import PAPER_MODELS, load_sections
from ..model.config import GPTConfig
from .gpus import GPU
from .layout import Layout, Recompute
from .timing import StepTime, step_time

# Table 5: iteration seconds with full recompute and with this work, MFU and HFU of this work
TABLE5: dict[str, tuple[float, float, float, float]] = {
    "22b": (1.42, 1.10, 0.415, 0.437),
    "175b": (18.13, 13.75, 0.514, 0.528),
    "530b": (49.05, 37.83, 0.560, 0.570),
    "1t": (94.42, 71.49, 0.563, 0.570),
}
# Table 4: one layer of the 22B model on A100, (forward, backward) milliseconds
TABLE4_MS: dict[str, tuple[float, float]] = {
    "tp": (7.7, 11.9),
    "tp_sp": (7.2, 11.8),
    "full": (7.7, 19.5),
    "tp_selective": (7.7, 13.2),
    "tp_sp_selective": (7.2, 13.1),
}
TABLE4_SETTINGS: dict[str, tuple[bool, str]] = {  # row -> (sequence parallel, recompute)
    "tp": (False, "none"), "tp_sp": (True, "none"), "full": (False, "full"),
    "tp_selective": (False, "selective"), "tp_sp_selective": (True, "selective"),
}


@dataclass(frozen=True)
class PaperRun:
    """One Table 3 row: the model, its layout with SP + selective recompute, batch and GPU count."""

    name: str
    model: GPTConfig
    layout: Layout
    global_batch: int

    @property
    def gpus(self) -> int:
        return self.layout.gpus

    def full_recompute(self) -> Layout:
        """Table 5's baseline: the same layout without SP, every layer recomputed."""
        return Layout(self.layout.tp, self.layout.pp, self.layout.dp, self.layout.virtual_stages,
                      self.layout.micro_batch, False, Recompute("full"))


@lru_cache(maxsize=None)
def paper_run(name: str) -> PaperRun:
    """The Table 3 row ``name`` (``22b``, ``175b``, ``530b``, ``1t``) from its shipped config."""
    if name not in PAPER_MODELS:
        raise ValueError(f"unknown paper model {name!r}; expected one of {PAPER_MODELS}")
    _, sections = load_sections(f"paper/{name}")
    par, train = sections["parallel"], sections["train"]
    layout = Layout(tp=par.tp, pp=par.pp, dp=1, virtual_stages=par.virtual_stages, micro_batch=train.micro_batch,
                    sequence_parallel=True, recompute=Recompute("selective"))
    return PaperRun(name, sections["model"], layout, train.global_batch)


def predict(run: PaperRun, gpu: GPU) -> tuple[StepTime, StepTime]:
    """(full recompute, present work) predicted step times of ``run`` on ``gpu``."""
    full = step_time(run.model, run.full_recompute(), gpu, run.global_batch)
    present = step_time(run.model, run.layout, gpu, run.global_batch)
    return full, present


