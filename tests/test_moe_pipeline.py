"""Expert parallelism inside pipeline stages equals the one-process model: pp=2 x ep=2 carved from
dp=2, and from cp=2, through the Trainer's step engine over 3 AdamW steps (losses, every gradient,
the global norm, the parameters after the steps, the balancing bias and the tokens per expert);
fp64 gradients at 1e-10; each stage's ep groups lie inside the stage. Broken reductions (the expert
gradients reduced over dp like dense ones, left unreduced, or left out of the clip's count; the
auxiliary losses without the pipeline's 1/n scale) are caught by the same comparison. All in one
4-rank spawn."""
import torch
import torch.distributed as dist

from seqpar.config.schema import ParallelConfig, RunConfig, TrainConfig
from seqpar.distributed import collectives
from seqpar.distributed.mesh import ParallelMesh, init_parallel
from seqpar.model import GPTConfig
from seqpar.model.moe import moe_layers
from seqpar.parallel import engine as engine_module, expert_grads
from seqpar.parallel.engine import build_engine
from seqpar.parallel.grads import clip_grad_norm
from seqpar.parallel.pipeline import PipelineParallel
from seqpar.parallel.precision import Precision
from test_moe_parallel import STEPS, WORLD, batches, config, train, worst

PP = 2


def _engine(cfg: GPTConfig, ep: int, cp: int):
    run = RunConfig(model=cfg, parallel=ParallelConfig(pp=PP, ep=ep, cp=cp), train=TrainConfig(seed=7))
    mesh = init_parallel(tp=1, dp=WORLD // (PP * cp), pp=PP, cp=cp, backend="gloo")
    accum = WORLD // mesh.dp_size  # micro-batches per dp rank: the one process's WORLD split over dp
    return build_engine(run, mesh, accum=accum, precision=Precision("fp32", mesh.device))


def pipe_train(cfg: GPTConfig, ep: int, cp: int = 1, steps: int = STEPS) -> list[dict]:
    """:func:`test_moe_parallel.train`'s record (and the parameters after the last step) for this
    rank's pipeline engine; the per-layer bias and load gathered from both stages."""
    engine = _engine(cfg, ep, cp)
    mesh, pipe = engine.mesh, engine.pipe
    opt = torch.optim.AdamW(engine.module.parameters(), lr=1e-2)
    accum, out = WORLD // mesh.dp_size, []
    for step in range(steps):
        tokens, labels = batches(step)
        mine = range(mesh.dp_rank * accum, (mesh.dp_rank + 1) * accum)
        loss = engine.forward_backward([(tokens[i], labels[i]) for i in mine])
        collectives.all_reduce(loss, mesh.dp_group)
        grads = pipe.full_dense_state_dict(grads=True)
        norm = engine.clip(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = pipe.full_dense_state_dict()
        loads = {int(name.split(".")[2]): torch.cat([m.step_load, m.step_dropped.view(1)])
                 for name, m in moe_layers(engine.module)}  # "0.blocks.1.mlp": layer 1
        for d in collectives.all_gather_object(loads, mesh.pp_group):
            loads.update(d)
        moe = sorted(loads)  # the MoE layers' indices
        out.append(dict(loss=loss.item() / mesh.dp_size, grads=grads, norm=norm.item(), params=state,
                        bias=[state[f"blocks.{i}.mlp.router.expert_bias"] for i in moe],
                        load=[loads[i] for i in moe]))
    return out


def _params_gap(run: list[dict], ref: list[dict]) -> float:
    return max(float((run[-1]["params"][n] - p).abs().max()) for n, p in ref[-1]["params"].items())


def _ep_layout() -> dict:
    """The engine's ep size, the experts this rank holds per MoE layer, and the pipeline stage of
    each rank of its ep group (ranks are pp-outermost: a stage is WORLD / PP consecutive ranks)."""
    engine = _engine(config(), 2, 1)
    mesh = engine.mesh
    return dict(ep=mesh.ep_size, local=[m.experts.local for _, m in moe_layers(engine.module)], pp_rank=mesh.pp_rank,
                stages=[r // (WORLD // PP) for r in dist.get_process_group_ranks(mesh.ep_group)])


def _experts_over_dp(self):
    """The refused code's reduction: expert gradients summed over dp like dense ones (other ranks' experts)."""
    collectives.all_reduce_coalesced([p.grad for p in self.params], self.mesh.dp_group, divide_by=self.mesh.dp_size)


def _clip_without_experts(self, max_norm):
    mesh = self.mesh
    return clip_grad_norm(self.module, max_norm, tp_group=mesh.tp_group, dp_group=mesh.dp_group,
                          pp_group=mesh.pp_group, exclude=self.norm_exclude(), device=mesh.device)


BROKEN = {"experts-over-dp": (expert_grads.ExpertGrads, "reduce", _experts_over_dp),
          "experts-unreduced": (expert_grads.ExpertGrads, "reduce", lambda self: None),
          "norm-undercount": (PipelineParallel, "clip_grad_norm", _clip_without_experts),
          "aux-unscaled": (engine_module, "moe_layers", lambda module: [])}  # the stage's 1/n never set


def _run_everything(rank, world):
    ref = train(config(), ParallelMesh.single(), params=True)
    layouts = {"pp2-ep2-dp2": (pipe_train(config(), 2), ref),
               "pp2-ep2-cp2": (pipe_train(config(), 2, cp=2), ref)}
    cfg64 = config("float64")
    ref64 = train(cfg64, ParallelMesh.single(), steps=1, params=True)
    layouts["fp64"] = (pipe_train(cfg64, 2, steps=1), ref64)
    dense0 = config("float64", first_dense=1)  # stage 0 holds no experts: the clip's sums must still pair up
    layouts["fp64-dense-stage"] = (pipe_train(dense0, 2, steps=2), train(dense0, ParallelMesh.single(), steps=2,
                                                                       params=True))
    gaps = {name: dict(worst(run, q), params=_params_gap(run, q)) for name, (run, q) in layouts.items()}
    broken = {}
    for kind, (owner, name, wrong) in BROKEN.items():
        real = getattr(owner, name)
        setattr(owner, name, wrong)
        try:
            broken[kind] = worst(pipe_train(cfg64, 2, steps=1), ref64)
        finally:
            setattr(owner, name, real)
    return gaps, broken, _ep_layout()


def test_expert_parallel_pipeline_stages_equal_one_process_and_broken_reductions_are_caught(spawn):
    for gaps, broken, layout in spawn(_run_everything, WORLD):
        assert layout["ep"] == 2 and layout["local"] == [2], layout  # 2 of the 4 experts of its stage's layer
        assert layout["stages"] == [layout["pp_rank"]] * 2, layout   # its ep group lies in its stage
        for name, d in gaps.items():
            tol = 1e-10 if name.startswith("fp64") else 1e-5
            assert d["loss"] < tol and d["norm"] < tol and d["params"] < tol, (name, d)
            assert max(d["grad"], d["router"], d["expert"]) < (1e-10 if tol < 1e-5 else 1e-4), (name, d)
            assert d["bias"] < 1e-6 and d["load"] == 0.0, (name, d)
        assert broken["experts-over-dp"]["expert"] > 1e-3, broken    # other ranks' experts' gradients added
        assert broken["experts-unreduced"]["expert"] > 1e-3, broken  # not divided by dp: twice too large
        assert broken["norm-undercount"]["norm"] > 1e-8, broken      # the other dp rank's experts not counted
        assert broken["aux-unscaled"]["router"] > 1e-3, broken       # aux losses n times too strong
