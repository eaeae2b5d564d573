"""Expert parallelism equals the one-process model: ep=2 (edp=2), ep=2 x tp=2 with sequence
parallelism, expert-TP, ep (2 and 4) carved from dp x cp, under ddp and FSDP2 (experts sharded over edp), over
several optimizer steps (losses, every gradient, the global norm, the balancing
bias and the tokens per expert); fp64 gradients at 1e-10; Mixtral and Qwen3-MoE imports in the
ep x tp layout give Hugging Face's logits; saved activations and all-to-all bytes equal their formulas.
Each peer bug class is re-created by breaking one reduction, and the same comparison must catch it.
All in one 4-rank spawn."""
import pytest
import torch

from seqpar.config import load_run_config
from seqpar.distributed import collectives
from seqpar.distributed.mesh import ParallelMesh, expert_parallel, init_parallel
from seqpar.errors import UserError
from seqpar.model import GPT, GPTConfig
from seqpar.model import moe as moe_module
from seqpar.model.config import MoEConfig
from seqpar.parallel import expert_grads
from seqpar.distributed import grad_sync
from seqpar.distributed.layouts import sp_replicated_parameters
from seqpar.distributed.regions import copy_to_tp, reduce_from_tp
from seqpar.model.moe import expert_parameters, moe_layers
from seqpar.parallel.data_parallel import DataParallel
from seqpar.parallel.grads import clip_grad_norm

STEPS, WORLD = 3, 4


def config(dtype="float32", sequence_parallel=True, **moe) -> GPTConfig:
    """The tiny Llama-style MoE model every layout trains (sigmoid router, bias balancing, both losses,
    a shared expert); ``moe`` overrides its MoE settings."""
    settings = dict(experts=4, top_k=2, router="sigmoid", bias_update_rate=0.01, aux_loss_coeff=0.05,
                    z_loss_coeff=0.01, shared_experts=1, **moe)
    return GPTConfig(vocab_size=64, seq_len=8, hidden=16, heads=2, layers=2, ffn_hidden=16, dropout=0.0,
                     attention_dropout=0.0, mlp="swiglu", norm="rmsnorm", position="rope", bias=False,
                     recompute="selective", dtype=dtype, sequence_parallel=sequence_parallel,
                     moe=MoEConfig(**settings))


def batches(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 64, (WORLD, 2, 8), generator=g)
    return tokens, torch.randint(0, 64, (WORLD, 2, 8), generator=g)


def full(x: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's shard) gathered whole; a plain tensor as it is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def train(cfg: GPTConfig, mesh: ParallelMesh, steps: int = STEPS, mode: str = "ddp",
          params: bool = False) -> list[dict]:
    """Per step: the mean loss, dense gradients, the global norm, biases and loads (``params``: and the
    dense parameters after the step). One process (dp = 1) runs the WORLD micro-batches with
    accumulation; a dp rank runs its own."""
    model = GPT(cfg, mesh, seed=7)
    dp = DataParallel(model, mesh, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accum = WORLD // mesh.dp_size
    out = []
    for step in range(steps):
        tokens, labels = batches(step)
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(accum):
            i = mesh.dp_rank * accum + micro
            with dp.micro_batch(micro, accum):
                loss = dp.module(tokens[i], labels[i])
                (loss / accum).backward()
            total += loss.detach().double() / accum
        dp.after_backward()
        collectives.all_reduce(total, mesh.dp_group)
        grads = model.to_dense({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        norm = dp.clip(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        layers = [m for _, m in moe_layers(model)]
        out.append(dict(loss=total.item() / mesh.dp_size, grads=grads, norm=norm.item(),
                        bias=[full(m.router.expert_bias.detach()).clone() for m in layers],
                        load=[torch.cat([m.step_load, m.step_dropped.view(1)]) for m in layers]))
        if params:
            out[-1]["params"] = model.to_dense({n: full(p.detach()) for n, p in model.named_parameters()})
    return out


def worst(run: list[dict], ref: list[dict]) -> dict:
    """Largest differences of each kind over the steps (gradients relative to their own size; load:
    tokens per expert and dropped assignments)."""
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))  # noqa: E731
    out = dict(loss=0.0, norm=0.0, grad=0.0, router=0.0, expert=0.0, bias=0.0, load=0.0)
    for r, q in zip(run, ref):
        out["loss"] = max(out["loss"], abs(r["loss"] - q["loss"]))
        out["norm"] = max(out["norm"], abs(r["norm"] - q["norm"]) / q["norm"])
        for n, g in q["grads"].items():
            kind = "router" if "router" in n else "expert" if "experts" in n else "grad"
            out[kind] = max(out[kind], rel(r["grads"][n], g))
        out["bias"] = max(out["bias"], max(float((a - b).abs().max()) for a, b in zip(r["bias"], q["bias"])))
        out["load"] = max(out["load"], max(float((a - b).abs().max()) for a, b in zip(r["load"], q["load"])))
    return out


def _mesh(t: int, ep: int, cp: int = 1) -> ParallelMesh:
    return expert_parallel(init_parallel(tp=t, dp=WORLD // (t * cp), cp=cp, backend="gloo"), ep)


def _copy_after_sum(x, group):
    """A wrong f-bar: forward sum, but backward sums again (t times the gradient)."""
    return copy_to_tp(reduce_from_tp(x, group), group)


def _reduce_mean_over_edp(self):
    collectives.all_reduce_coalesced([p.grad for p in self.params], self.mesh.edp_group, mean=True)


def _clip_without_experts(self, max_norm):
    return clip_grad_norm(self.model, max_norm, tp_group=self.mesh.tp_group, dp_group=self.norm_group)


def _with_experts(model):
    """The SP-replicated parameters, plus TP-split experts: expert-TP = 1's TP sum applied to expert-TP = t."""
    return [*sp_replicated_parameters(model), *expert_parameters(model).values()]


# peer bug -> (layout (t, ep), config, the reduction replaced by a broken one)
BROKEN = {
    "router-tp-sum": ((2, 2), {}, (moe_module, "mark_sp_replicated", lambda m, names=None: m)),  # torchtitan #2416
    "norm-undercount": ((2, 2), {}, (DataParallel, "clip", _clip_without_experts)),          # Megatron-LM #5916
    "expert-edp-mean": ((1, 2), {}, (expert_grads.ExpertGrads, "reduce", _reduce_mean_over_edp)),  # Megatron #1628
    "expert-tp-as-tp1": ((2, 2), {"expert_tp": True},                                         # Megatron-LM #1628
                         (grad_sync, "sp_replicated_parameters", _with_experts)),
    "router-stat-backward": ((2, 2), {}, (moe_module, "reduce_from_tp", _copy_after_sum)),  # transformers #48205
}


def _broken(kind: str) -> dict:
    (t, ep), extra, (owner, name, wrong) = BROKEN[kind]
    cfg, real = config("float64", **extra), getattr(owner, name)  # fp64: a right layout agrees to 1e-10
    ref = train(cfg, ParallelMesh.single(), steps=1)
    setattr(owner, name, wrong)
    try:
        return worst(train(cfg, _mesh(t, ep), steps=1), ref)
    finally:
        setattr(owner, name, real)


# name -> (t, ep, data parallelism, MoE / model settings[, cp])
LAYOUTS = {
    "ep2-edp2": (1, 2, "ddp", {}),
    "ep2xtp2-sp": (2, 2, "ddp", {"capacity_factor": 1.0}),
    "ep2-edp2-fsdp": (1, 2, "fsdp", {}),
    # the experts' fc1 and activation recomputed in backward, under FSDP2 over edp (its all-gathers
    # must hand the recomputation the same expert weights)
    "ep2-edp2-fsdp-recompute-experts": (1, 2, "fsdp", {"recompute_experts": True}),
    "ep2xtp2-no-sp": (2, 2, "ddp", {"sequence_parallel": False}),
    "ep2xtp2-expert-tp": (2, 2, "ddp", {"expert_tp": True}),
    "ep2xtp2-expert-tp-fsdp-no-sp": (2, 2, "fsdp", {"expert_tp": True, "sequence_parallel": False}),
    "ep2xcp2": (1, 2, "ddp", {}, 2), "ep4-over-dp2xcp2-fsdp": (1, 4, "fsdp", {}, 2),
}


def _run_everything(rank, world):
    ref, layouts = {}, {}
    for name, (t, ep, mode, extra, *cp) in LAYOUTS.items():
        key = tuple(sorted(extra.items()))
        if key not in ref:
            ref[key] = train(config(**extra), ParallelMesh.single())
        layouts[name] = worst(train(config(**extra), _mesh(t, ep, *cp), mode=mode), ref[key])
    cfg64 = config("float64", capacity_factor=1.0)
    layouts["fp64"] = worst(train(cfg64, _mesh(2, 2), steps=1), train(cfg64, ParallelMesh.single(), steps=1))
    return layouts, {kind: _broken(kind) for kind in BROKEN}, _hf_logits_in_ep_x_tp(), _bytes_at_ep_x_tp()


def _bytes_at_ep_x_tp() -> dict:
    """At ep=2 x tp=2 (SP): the ledger against the activation formula per layer, and this rank's
    all-to-all bytes (forward and backward) with the formula's for its ep group."""
    from moe_helpers import layer_gaps
    from seqpar.distributed.comm_counter import count_comm
    from seqpar.memory.moe import all_to_all_bytes
    cfg, mesh = config(), _mesh(2, 2)
    model = GPT(cfg, mesh, seed=7)
    tokens, labels = batches(0)
    gaps = layer_gaps(model, tokens[mesh.dp_rank], t=2, ep=2)
    gaps += layer_gaps(GPT(config(expert_tp=True), mesh, seed=7), tokens[mesh.dp_rank], t=2, ep=2)
    with count_comm() as counter:
        model(tokens[mesh.dp_rank], labels[mesh.dp_rank]).backward()
    formula = all_to_all_bytes(cfg, s=8, b=2, t=2, act=4, ep=2)
    from seqpar.memory.params import stage_params
    held = model.num_parameters(dense=False) == stage_params(cfg, t=2, ep=2)
    return dict(gaps=gaps, sent=counter.bytes.get("all_to_all", 0), group_formula=cfg.layers * sum(formula.values()),
                params_formula_holds=held)


def _hf_logits_in_ep_x_tp() -> dict:
    """Mixtral and Qwen3-MoE imports at ep=2 x tp=2 (SP): the largest logit difference to HF's."""
    from hf_helpers import shifted_batch
    from test_moe_interop import hf_moe
    from seqpar.interop.moe_hf import from_hf
    out = {}
    for kind in ("mixtral", "qwen3_moe"):
        hf = hf_moe(kind)
        ids = shifted_batch(64, 2, 8)[0]
        config, state = from_hf(hf)
        mesh = _mesh(2, 2)
        model = GPT(config, mesh)
        model.load_dense_state_dict(state)
        with torch.no_grad():
            logits = collectives.all_gather_dim(model.eval()(ids), mesh.tp_group, -1)
            out[kind] = float((logits - hf(input_ids=ids).logits).abs().max())
    return out


def test_expert_parallel_layouts_equal_one_process_and_broken_reductions_are_caught(spawn):
    results = spawn(_run_everything, WORLD)
    for rank, (layouts, broken, hf, nbytes) in enumerate(results):
        assert max(hf.values()) < 1e-5, hf
        assert nbytes["gaps"] == [0, 0, 0, 0], nbytes  # saved bytes = the formula (expert-TP 1 and t), rows as routed
        assert nbytes["params_formula_holds"]    # parameters per rank: E/ep experts, the rest split over t
        if rank in (0, 1):  # ep groups {0, 2} and {1, 3} (dp rank = ep rank at edp = 1)
            group = nbytes["sent"] + results[rank + 2][3]["sent"]
            assert group == nbytes["group_formula"], (group, nbytes)
        for name, d in layouts.items():
            tol = 1e-10 if name == "fp64" else 2e-5
            assert d["loss"] < tol and d["norm"] < tol, (name, d)
            assert max(d["grad"], d["router"], d["expert"]) < (1e-10 if name == "fp64" else 1e-4), (name, d)
            assert d["bias"] < 1e-6 and d["load"] == 0.0, (name, d)
        assert broken["router-tp-sum"]["router"] > 1e-3          # router grads are one TP rank's share
        assert broken["norm-undercount"]["norm"] > 1e-8          # the clip's norm misses other ranks' experts
        assert broken["expert-edp-mean"]["expert"] > 1e-3        # expert grads dp/edp times too large
        assert broken["expert-tp-as-tp1"]["expert"] > 1e-3       # TP-split expert grads summed over TP
        stat = broken["router-stat-backward"]
        assert stat["loss"] < 1e-10 and stat["router"] > 1e-3   # the loss looks fine, the router does not


def test_moe_run_settings_that_do_not_compose_yet_are_refused():
    base = ["model.moe.experts=4", "model.layers=2"]
    with pytest.raises(UserError, match=r"parallel.ep=2 splits experts, but the model has none"):
        load_run_config(None, ["parallel.ep=2"]).validate()
    with pytest.raises(UserError, match=r"model.moe.experts \(4\) is not divisible by parallel.ep=3"):
        load_run_config(None, [*base, "parallel.ep=3"]).validate()
    with pytest.raises(UserError, match=r"model.moe with train.compile=true is not supported yet"):
        load_run_config(None, [*base, "train.compile=true"]).validate()
    assert load_run_config(None, [*base, "parallel.ep=2"]).parallel.data_parallel_mode(4) == "ddp"
