"""Pipeline parallelism: the same losses, gradients, clip norms and weights as the unsplit model,
the first stage's activation memory as PAPER.md §4.2.3 says, and RNG-exact recompute per stage.

Two 4-rank spawns carry most checks (each spawn costs seconds): every layout is built on the
same ranks one after another.
"""
import dataclasses

import pytest
import torch

from distributed_harness import rel_err
from seqpar.distributed import ParallelMesh, init_parallel
from seqpar.memory import bytes_per_layer
from seqpar.memory.formulas import first_stage_bytes
from seqpar.model import GPT, GPTConfig
from seqpar.parallel import build_pipeline, build_stage_modules, check_stage_split, local_stage_indices, resolve_schedule, stage_layers
from seqpar.memory import PeakActivationLedger, layers_in_flight
from seqpar.parallel.grads import clip_grad_norm
from seqpar.parallel.precision import Precision

BASE = dict(vocab_size=64, seq_len=8, hidden=16, heads=4, layers=8, dropout=0.0, attention_dropout=0.0)
B, STEPS, CLIP = 8, 3, 0.5  # global batch (sequences), optimizer steps, clip norm (clips every step here)

# (tp, pp, m, schedule, n_microbatches per dp rank, config overrides)
LAYOUTS = [
    (2, 2, 1, "1F1B", 4, dict(sequence_parallel=True, recompute="selective")),
    (2, 2, 1, "1F1B", 2, dict(sequence_parallel=False, recompute="full", recompute_method="uniform",
                              recompute_num_layers=3)),
    (1, 4, 2, "Interleaved1F1B", 4, dict(sequence_parallel=True, recompute="selective")),
    (1, 4, 2, "Interleaved1F1B", 4, dict(sequence_parallel=False, recompute="full", recompute_method="block",
                                         recompute_num_layers=1)),
    (1, 4, 1, "1F1B", 4, dict(recompute="none")),
    (1, 2, 1, "GPipe", 2, dict(recompute="none", tie_embeddings=False)),  # dp = 2
]


def _batches(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (B, 8), generator=g), torch.randint(0, 64, (B, 8), generator=g)


def _reference_step(ref, opt, tokens, labels):
    opt.zero_grad(set_to_none=True)
    loss = ref(tokens, labels)
    loss.backward()
    loss = loss.detach()
    norm = clip_grad_norm(ref, CLIP)
    grads = ref.to_dense({n: p.grad for n, p in ref.named_parameters()})
    opt.step()
    return float(loss), float(norm), grads


def _compare_layout(mesh, tp, pp, m, schedule, n, overrides) -> dict:
    cfg = GPTConfig(**{**BASE, **overrides})
    ref = GPT(dataclasses.replace(cfg), ParallelMesh.single(), seed=3)
    loaded = cfg.recompute == "full"  # these layouts load the unsplit model's dense dict, the others share its seed
    pipe = build_pipeline(cfg, mesh, seed=4 if loaded else 3, schedule=schedule, virtual_stages=m, n_microbatches=n)
    if loaded:
        pipe.load_dense_state_dict(ref.dense_state_dict())
    # SGD: Adam's 1/sqrt(v) would turn fp32 rounding in near-zero grads into lr-sized steps
    opt = torch.optim.SGD(pipe.module.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    rows = B // mesh.dp_size
    worst = dict(loss=0.0, norm=0.0, grad=0.0, param=0.0, eval=0.0)
    for step in range(STEPS):
        tokens, labels = _batches(step)
        r_loss, r_norm, r_grads = _reference_step(ref, ref_opt, tokens, labels)
        opt.zero_grad(set_to_none=True)
        mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
        loss = float(pipe.step(tokens[mine], labels[mine]))
        if mesh.dp_size > 1:  # each dp rank saw half the batch: the mean of the two halves' losses
            loss = float(_dp_mean(torch.tensor(loss, dtype=torch.float64), mesh))
        norm = float(pipe.clip_grad_norm(CLIP))
        grads = pipe.dense_state_dict(grads=True)  # this rank's stages; the tied copy on both ends
        opt.step()
        if step == 0:  # forward-only in between: the next step switches the stages back to training
            worst["eval"] = _eval_error(pipe, ref, mesh)
        worst["loss"] = max(worst["loss"], abs(loss - r_loss))
        worst["norm"] = max(worst["norm"], abs(norm - r_norm) / r_norm)
        errs = {k: rel_err(grads[k], r_grads[k]) for k in grads}
        k = max(errs, key=errs.get)
        if errs[k] > worst["grad"]:
            worst["grad"], worst["grad_key"] = errs[k], (step, k, float(r_grads[k].abs().max()))
    params = pipe.full_dense_state_dict()
    ref_params = ref.dense_state_dict()
    assert set(params) == set(ref_params), sorted(set(params) ^ set(ref_params))
    worst["param"] = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
    unsplit = GPT(dataclasses.replace(cfg), ParallelMesh.single(), seed=9)
    unsplit.load_dense_state_dict(params)  # the pipeline's dense dict loads into p = 1, t = 1
    return worst


def _dp_mean(x, mesh):
    from seqpar.distributed.collectives import all_reduce
    all_reduce(x, mesh.dp_group)
    return x / mesh.dp_size


def _eval_error(pipe, ref, mesh) -> float:
    tokens, labels = _batches(STEPS)
    rows = B // mesh.dp_size
    mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    pipe.train(False), ref.eval()
    with torch.no_grad():
        err = abs(float(_dp_mean(pipe.evaluate(tokens[mine], labels[mine]), mesh)) - float(ref(tokens, labels)))
    pipe.train(True), ref.train()
    return err


def _equivalence(rank, world):
    out = {}
    for tp, pp, m, schedule, n, overrides in LAYOUTS:
        mesh = init_parallel(tp, pp=pp)
        out[(tp, pp, m, schedule, n, str(overrides))] = _compare_layout(mesh, tp, pp, m, schedule, n, overrides)
    mesh = init_parallel(1, pp=4)
    try:  # 6 layers into 4 x 2 stages: refused on every rank before any collective
        build_pipeline(GPTConfig(**{**BASE, "layers": 6}), mesh, virtual_stages=2)
        out["split_error"] = None
    except ValueError as e:
        out["split_error"] = str(e)
    return out


def test_pipeline_layouts_equal_the_unsplit_model(spawn):
    for rank, res in enumerate(spawn(_equivalence, 4)):
        assert "L=6" in res["split_error"] and "p=4" in res["split_error"] and "m=2" in res["split_error"]
        for layout, worst in res.items():
            if layout == "split_error":
                continue
            assert worst["loss"] <= 1e-5 and worst["eval"] <= 1e-5, (rank, layout, worst)
            assert worst["norm"] <= 1e-5 and worst["grad"] <= 1e-5, (rank, layout, worst)
            assert worst["param"] <= 1e-5, (rank, layout, worst)


# ----------------------------------------------------------------------------- memory, RNG, bubble
MEM = dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4, dropout=0.1, attention_dropout=0.1,
           recompute="none", sequence_parallel=True, dtype="bfloat16")


def _peak(mesh, m, schedule):
    pipe = build_pipeline(GPTConfig(**MEM), mesh, seed=1, schedule=schedule, virtual_stages=m, n_microbatches=4)
    tokens, labels = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
    with PeakActivationLedger(pipe.module) as ledger:
        pipe.step(tokens, labels)
    return ledger.peak_layer_bytes, ledger.live_bytes, pipe.last_timing.idle_fraction


def _grads_with(mesh, m, schedule, **overrides):
    cfg = GPTConfig(**{**BASE, "layers": 4, "dropout": 0.2, "attention_dropout": 0.2, **overrides})
    pipe = build_pipeline(cfg, mesh, seed=5, schedule=schedule, virtual_stages=m, n_microbatches=2)
    tokens, labels = _batches(0)
    loss = pipe.step(tokens[:4], labels[:4])
    return float(loss), pipe.dense_state_dict(grads=True)


def _precisions(mesh) -> dict:
    """fp32, bf16 autocast over fp32 weights (fp32 residual between stages) and bf16 weight copies
    (bf16 residual; grads moved into the fp32 masters, then finished): losses and grads near fp32."""
    cfg = GPTConfig(**{**BASE, "layers": 4, "recompute": "selective"})
    tokens, labels = _batches(0)
    out = {}
    for name in ("fp32", "bf16-autocast", "bf16"):
        prec = Precision(name, mesh.device)
        pipe = build_pipeline(cfg, mesh, seed=5, n_microbatches=2,
                              activation_dtype=torch.bfloat16 if prec.master_weights else None)
        weights = prec.compute_weights(pipe.module)
        with prec.weights_in(pipe.module, weights), prec.autocast():
            loss = pipe.step(tokens[:4], labels[:4], finish=False)
        prec.accumulate(pipe.module, weights)
        pipe.finish_grads()
        out[name] = (float(loss), pipe.dense_state_dict(grads=True))
    ref_loss, ref = out.pop("fp32")
    return {k: (abs(loss - ref_loss), max(rel_err(g[n], ref[n]) for n in ref)) for k, (loss, g) in out.items()}


def _memory_and_rng(rank, world):
    mesh = init_parallel(2, pp=2)
    out = {"pp_rank": mesh.pp_rank, "precision": _precisions(mesh)}
    for m, schedule in ((1, "1F1B"), (2, "Interleaved1F1B")):
        out[schedule] = _peak(mesh, m, schedule)
        base_loss, base = _grads_with(mesh, m, schedule, recompute="none")
        for rc in (dict(recompute="selective"), dict(recompute="full", recompute_num_layers=1,
                                                      recompute_method="block" if m == 1 else "uniform")):
            loss, grads = _grads_with(mesh, m, schedule, **rc)
            out[(schedule, rc["recompute"])] = (abs(loss - base_loss), max(rel_err(grads[k], base[k]) for k in base))
    return out


def test_first_stage_memory_is_the_paper_figure_and_recompute_is_rng_exact(spawn):
    per_layer = bytes_per_layer("tp_sp", s=16, b=2, h=32, a=4, t=2)  # micro-batch of 2 sequences
    for res in spawn(_memory_and_rng, 4):
        r = res["pp_rank"]
        for m, schedule in ((1, "1F1B"), (2, "Interleaved1F1B")):
            peak, live_after, idle = res[schedule]
            assert live_after == 0  # every saved tensor freed by the end of the step
            predicted = per_layer * layers_in_flight(schedule, pp_rank=r, pp=2, virtual_stages=m, layers=4,
                                                     n_microbatches=4)
            assert abs(peak - predicted) / predicted <= 0.03, (r, schedule, peak, float(predicted))
            if r == 0:  # §4.2.3: L layers' worth, times 1 + (p-1)/(pm) interleaved
                paper = first_stage_bytes(per_layer, L=4, p=2, m=m)
                assert abs(peak - paper) / paper <= 0.03, (schedule, peak, paper)
                assert idle > 0.0
            else:
                assert peak < first_stage_bytes(per_layer, L=4, p=2, m=m) * 0.75, (schedule, peak)
            for name, (dloss, dgrad) in res["precision"].items():
                assert dloss <= 2e-2 and dgrad <= 5e-2, (r, name, dloss, dgrad)
            for rc in ("selective", "full"):
                dloss, dgrad = res[(schedule, rc)]
                assert dloss <= 1e-6 and dgrad <= 1e-5, (r, schedule, rc, dloss, dgrad)


# ----------------------------------------------------------------------------- single process
def _mesh(pp: int, pp_rank: int = 0) -> ParallelMesh:
    return ParallelMesh(1, 1, 0, 0, 0, pp, torch.device("cpu"), pp_size=pp, pp_rank=pp_rank)


def test_layer_split_placement_and_errors():
    assert [list(stage_layers(8, 4, i)) for i in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert local_stage_indices(4, 2, 1) == [1, 5]
    with pytest.raises(ValueError, match=r"L=6 .* p=2 x m=2"):
        check_stage_split(6, 2, 2)
    with pytest.raises(ValueError, match="L=6"):  # before the GPT is built or any group is used
        build_pipeline(GPTConfig(**{**BASE, "layers": 6}), _mesh(4), virtual_stages=1)
    assert resolve_schedule(None, 1) == "1F1B" and resolve_schedule(None, 3) == "Interleaved1F1B"
    with pytest.raises(ValueError, match="Interleaved1F1B"):
        resolve_schedule("1F1B", 2)
    with pytest.raises(ValueError, match="n_microbatches >= pp"):
        build_pipeline(GPTConfig(**BASE), _mesh(4), n_microbatches=2)


def test_stages_keep_the_gpt_names_and_draw_their_own_dropout_masks():
    cfg = GPTConfig(**{**BASE, "dropout": 0.1})
    first = build_stage_modules(cfg, _mesh(2, 0), seed=0, virtual_stages=2)   # stages 0 and 2 of 4
    last = build_stage_modules(cfg, _mesh(2, 1), seed=0, virtual_stages=2)    # stages 1 and 3
    names = [sorted({n.split(".")[0] + (f".{n.split('.')[1]}" if n.startswith("blocks") else "")
                     for n, _ in part.named_parameters()}) for part in first + last]
    assert names[0] == ["blocks.0", "blocks.1", "wpe", "wte"] and names[1] == ["blocks.4", "blocks.5"]
    assert names[3] == ["blocks.6", "blocks.7", "ln_f", "wte"] and last[1].holds_tied_copy
    dense = GPT(cfg, seed=0).state_dict()
    for part in first + last:  # the same seed: the same weights as the unsplit model, under its names
        for n, p in part.named_parameters():
            assert torch.equal(p, dense[n]), n
    seeds = {part.rng.seed for part in first + last}
    assert len(seeds) == 4  # one dropout stream pair per stage
    for part in first + last:
        assert all(m.streams is part.rng for m in part.modules() if hasattr(m, "streams"))
    with pytest.raises(ValueError, match="pp >= 2"):
        build_pipeline(cfg, _mesh(1))


def test_a_pipeline_rank_builds_only_its_layers_with_the_same_weights():
    from seqpar.model.gpt import NotBuilt
    cfg = GPTConfig(vocab_size=50, seq_len=16, hidden=16, heads=2, layers=4, dropout=0.0, attention_dropout=0.0)
    full, part = GPT(cfg, seed=5), GPT(cfg, seed=5, build_layers={2, 3})
    assert all(isinstance(part.blocks[i], NotBuilt) and not list(part.blocks[i].parameters()) for i in (0, 1))
    whole = dict(full.named_parameters())
    for name, p in part.named_parameters():  # every layer built here equals the unsplit model's
        assert torch.equal(p, whole[name]), name
    assert {n.split(".")[1] for n, _ in part.named_parameters() if n.startswith("blocks.")} == {"2", "3"}
    with pytest.raises(RuntimeError, match="layer 0 is not built on this rank"):
        part(torch.zeros(1, 8, dtype=torch.long))
