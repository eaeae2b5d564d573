"""Drop-in use at the edges, at t=2 with sequence parallelism, on tiny random Hugging Face models:
Hugging Face save/load, compiled and DDP-wrapped models, sequence parallelism switched off for
generation with a KV cache, frozen weights, bf16, wrong groups, and no graph breaks in seqpar's
layers under torch.compile. One group of ranks runs everything; each test reads its part."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from distributed_harness import rel_err, run_ranks, tp_group_of  # noqa: E402
from dropin_helpers import batch, gpt2, grads_of, llama, loss_of  # noqa: E402
from gpt_helpers import mesh_for  # noqa: E402
from seqpar.dropin import checkpoint_attention  # noqa: E402
from seqpar import parallelize, plans  # noqa: E402
from seqpar.distributed import sync_sp_replicated_grads  # noqa: E402
from seqpar.dropin import (  # noqa: E402
    check_groups,
    dense_state_dict,
    load_dense_state_dict,
    load_pretrained,
    save_pretrained,
    set_sequence_parallel,
    unwrap,
)
from seqpar.layers import ColumnParallelLinear  # noqa: E402

BUILD = {"gpt2": (gpt2, plans.gpt2), "llama": (llama, plans.llama)}
SAVE_SETS = ("_name_or_path", "architectures", "dtype")  # config keys any save_pretrained fills in
BF16_LOSS_TOL = 1e-3  # relative, parallelized vs unparallelized, both bf16
BF16_GRAD_TOL = 3e-2  # max |difference| over the largest entry, per gradient (bf16 vs fp32 alone: ~1.7e-2)


def _save_load(mesh, tmp):
    ids, out = batch(), {}
    for name, (build, plan) in BUILD.items():
        ref = build()
        model = parallelize(copy.deepcopy(ref), plan(), mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loss_of(model, ids).backward()
        opt.step()  # trained weights, not the initial ones
        path = os.path.join(tmp, name)
        try:
            model.save_pretrained(path + "-own")
            own = None
        except ValueError as e:
            own = str(e)
        save_pretrained(model, path)
        plain = type(ref).from_pretrained(path)
        with torch.no_grad():
            losses = [loss_of(m, ids) for m in (model, plain, load_pretrained(type(ref), path, plan(), mesh))]
        shapes = {k: tuple(v.shape) for k, v in plain.state_dict().items()}
        config = {k: v for k, v in plain.config.to_dict().items() if k not in SAVE_SETS}
        out[name] = dict(own=own, own_written=os.path.exists(path + "-own"), losses=losses,
                         shapes_ok=shapes == {k: tuple(v.shape) for k, v in ref.state_dict().items()},
                         config_ok=config == {k: v for k, v in ref.config.to_dict().items() if k not in SAVE_SETS})
    return out


def _wrappers(mesh, rank, world):
    ids, ref = batch(), gpt2()
    model = parallelize(copy.deepcopy(ref), plans.gpt2(), mesh)
    own = [dist.new_group([r]) for r in range(world)][rank]  # DDP over this rank alone
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=own)
    plain = dense_state_dict(model)
    same = {}
    for what, wrapped in (("compiled", torch.compile(model)), ("ddp", ddp), ("compiled ddp", torch.compile(ddp))):
        got = dense_state_dict(wrapped)
        same[what] = sorted(got) == sorted(plain) and all(torch.equal(got[k], plain[k]) for k in plain)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_dense_state_dict(torch.compile(model), ref.state_dict())
    with torch.no_grad():
        reloaded = (loss_of(model, ids), loss_of(ref, ids))
    errors = {}
    loss_of(model, ids).backward()
    for what, call in (("sync", lambda: sync_sp_replicated_grads(model, mesh.tp_group)),
                       ("ddp_first", lambda: parallelize(torch.nn.parallel.DistributedDataParallel(
                           gpt2(), process_group=own), plans.gpt2(), mesh))):
        try:
            call()
        except ValueError as e:
            errors[what] = str(e)
    compiled = parallelize(torch.compile(gpt2()), plans.gpt2(), mesh)  # parallelized inside its wrapper
    inside = type(compiled).__name__ == "OptimizedModule" and unwrap(compiled).seqpar.tp_size == 2
    return dict(same=same, reloaded=reloaded, errors=errors, inside=inside)


def _generate(mesh):
    """KV-cache generation with SP switched off equals HF's tokens; switching back on restores
    SP training with dense gradients (norm gradients summed exactly once in both modes)."""
    prompt, ids, out = batch(seed=3, length=5), batch(), {}
    for name, (build, plan) in BUILD.items():
        ref = build().eval()
        model = parallelize(copy.deepcopy(ref), plan(), mesh).eval()
        try:
            model.generate(prompt, max_new_tokens=6, do_sample=False)
            err = None
        except ValueError as e:
            err = str(e)
        q = model.transformer.h[0].attn.c_attn if name == "gpt2" else model.model.layers[0].self_attn.q_proj
        reprs = [repr(q)]
        set_sequence_parallel(model, False)
        reprs.append(repr(q))
        tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)
        ref_tokens = ref.generate(prompt, max_new_tokens=6, do_sample=False)
        loss_of(ref, ids).backward()
        dense, modes = grads_of(ref, False), {}
        for sp in (False, True):
            set_sequence_parallel(model, sp)
            model.zero_grad(set_to_none=True)
            loss = loss_of(model, ids)
            loss.backward()
            grads = grads_of(model, True)
            with torch.no_grad():
                modes[sp] = (rel_err(loss, loss_of(ref, ids)), max(rel_err(grads[n], dense[n]) for n in dense))
        out[name] = dict(err=err, reprs=reprs, tokens=(tokens, ref_tokens), modes=modes)
    return out


def _bf16(mesh):
    ids, out = batch(), {}
    for name, (build, plan) in BUILD.items():
        for mode in ("autocast", "bf16 parameters"):
            runs = []
            for parallel in (False, True):
                model = build() if mode == "autocast" else build().to(torch.bfloat16)
                if parallel:
                    model = parallelize(model, plan(), mesh)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                    loss = loss_of(model, ids)
                loss.backward()
                runs.append((loss.detach().float(), grads_of(model, parallel)))
            (ref_loss, ref_grads), (loss, grads) = runs
            out[(name, mode)] = (rel_err(loss, ref_loss),
                                 {n: rel_err(grads[n].float(), g.float()) for n, g in ref_grads.items()})
    return out


def _frozen_and_groups(mesh):
    model = llama()
    for name, p in model.named_parameters():
        if ".layers.0." in name or "embed" in name:
            p.requires_grad_(False)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    parallelize(model, plans.llama(), mesh)
    kept = {n: p.requires_grad for n, p in model.named_parameters()} == before and any(not v for v in before.values())
    kept_buffers = {n: b for n, b in model.named_buffers()}
    kept &= kept_buffers.keys() == buffers.keys() and all(torch.equal(kept_buffers[n], b) for n, b in buffers.items())
    errors = []
    stray = torch.nn.Sequential(torch.nn.LayerNorm(32), ColumnParallelLinear(32, 64, tp_group=None,
                                                                             sequence_parallel=True))
    for call in (lambda: check_groups(stray, mesh),
                 lambda: parallelize(torch.nn.ModuleDict({"block": stray, "out": torch.nn.Linear(64, 8)}),
                                     {"out": "row"}, mesh, sequence_parallel=False)):
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return kept, errors


def _graph_breaks(mesh):
    """torch._dynamo's own account of a parallelized GPT-2 (SP) forward + traced backward."""
    import seqpar.parallelize  # noqa: F401  (the import form must not disturb tracing either)

    model = parallelize(gpt2(n_layer=1), plans.gpt2(), mesh)
    ids = batch()
    torch._dynamo.reset()
    root = os.path.dirname(os.path.abspath(seqpar.__file__))  # the package's own frames
    out = []
    for selective in (False, True):  # checkpoint_attention's recomputation traces too
        if selective:
            checkpoint_attention(model)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(input_ids=ids, use_cache=False)  # logits: transformers' loss breaks
        inside = [f"{b.reason} at {f.filename}:{f.lineno}" for b in explained.break_reasons for f in b.user_stack
                  if os.path.abspath(f.filename).startswith(root + os.sep)]
        out.append((explained.graph_break_count, inside))
    return out


def _t2(rank, world, tmp):
    mesh = mesh_for(tp_group_of(world))
    return {"save": _save_load(mesh, tmp), "wrappers": _wrappers(mesh, rank, world), "generate": _generate(mesh),
            "bf16": _bf16(mesh), "frozen": _frozen_and_groups(mesh), "compile": _graph_breaks(mesh)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_t2, 2, tmp_path_factory.mktemp("dropin"), str(tmp_path_factory.mktemp("saved")))


@pytest.mark.parametrize("name", list(BUILD))
def test_save_pretrained_writes_the_full_model_and_own_method_refuses(ranks, name):
    for r in ranks:
        got = r["save"][name]
        assert got["own"] and "seqpar.dropin.save_pretrained(model, path)" in got["own"], got["own"]
        assert not got["own_written"], "the model's own save_pretrained must not write shards"
        assert got["shapes_ok"] and got["config_ok"]
        trained, reloaded, loaded_parallel = got["losses"]
        assert rel_err(reloaded, trained) <= 1e-5 and rel_err(loaded_parallel, trained) <= 1e-5, got["losses"]


def test_state_dicts_see_through_compile_and_ddp(ranks):
    for r in ranks:
        got = r["wrappers"]
        assert got["same"] == {"compiled": True, "ddp": True, "compiled ddp": True}
        assert rel_err(*got["reloaded"]) <= 1e-6, got["reloaded"]
        assert "install_sp_grad_hooks" in got["errors"]["sync"]
        assert "parallelize first, then wrap" in got["errors"]["ddp_first"]
        assert got["inside"]


@pytest.mark.parametrize("name", list(BUILD))
def test_generation_with_sequence_parallelism_switched_off(ranks, name):
    for r in ranks:
        got = r["generate"][name]
        assert "sequence length 5" in got["err"] and "t=2" in got["err"], got["err"]
        assert "set_sequence_parallel(model, False)" in got["err"]
        on, off = got["reprs"]
        assert "sequence_parallel=True" in on and "seq_dim=1" in on and "sequence_parallel=False" in off
        tokens, ref_tokens = got["tokens"]
        assert tokens.shape[1] > 5 and torch.equal(tokens, ref_tokens)
        for sp, (loss_err, grad_err) in got["modes"].items():
            assert loss_err <= 1e-5 and grad_err <= 1e-5, f"sequence_parallel={sp}: {loss_err:.1e} {grad_err:.1e}"


@pytest.mark.parametrize("case", [(n, m) for n in BUILD for m in ("autocast", "bf16 parameters")])
def test_bf16_matches_unparallelized_bf16(ranks, case):
    for r in ranks:
        loss_err, grad_errs = r["bf16"][case]
        assert loss_err <= BF16_LOSS_TOL, f"{case}: loss {loss_err:.1e}"
        worst = max(grad_errs, key=grad_errs.get)
        assert grad_errs[worst] <= BF16_GRAD_TOL, f"{case}: {worst} {grad_errs[worst]:.1e}"


def test_frozen_weights_buffers_and_wrong_groups(ranks):
    for r in ranks:
        kept, (direct, via_parallelize) = r["frozen"]
        assert kept, "parallelize must keep requires_grad=False and the buffers"
        for e in (direct, via_parallelize):
            assert e and "1 (group of ranks [" in e and "mesh's TP group (ranks [0, 1])" in e, e


def test_no_graph_breaks_inside_seqpar_under_torch_compile(ranks):
    for r in ranks:
        for breaks, inside in r["compile"]:  # plain, then with checkpoint_attention
            assert inside == [], inside
            assert breaks == 0, breaks


def test_import_seqpar_parallelize_gives_the_function():
    """Every import form works, and through real modules: nothing in sys.modules is an alias or a function."""
    code = ("import seqpar.parallelize, seqpar, inspect, sys, types\n"
            "import seqpar.parallelize as p\n"
            "assert p is seqpar.parallelize and inspect.isfunction(p), p\n"
            "assert 'plan' in inspect.signature(seqpar.parallelize).parameters\n"
            "from seqpar.parallelize import Plan, Style, parallelize\n"
            "assert parallelize is p and Plan.__name__ == 'Plan' and Style.__name__ == 'Style'\n"
            "import seqpar.plans\n"
            "from seqpar.plans import gpt2, llama\n"
            "assert seqpar.plans.gpt2 is gpt2 and isinstance(gpt2(), Plan)\n"
            "bad = {k: v for k, v in sys.modules.items() if k.startswith('seqpar')\n"
            "       and not (isinstance(v, types.ModuleType) and v.__name__ == k)}\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_attention_with_disagreeing_sequence_lengths_raises():
    """q longer than k, or a mask for another length: the wrapper names the shapes and check_groups."""
    from seqpar.dropin.attention import _WRAPPERS

    module = gpt2().transformer.h[0].attn
    q, k = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 4, 8)
    with pytest.raises(ValueError, match=r"query \(2, 4, 8, 8\), key \(2, 4, 4, 8\).*check_groups"):
        _WRAPPERS["eager"](module, q, k, k, None)
    with pytest.raises(ValueError, match=r"mask \(2, 1, 16, 8\)"):
        _WRAPPERS["eager"](module, q, q, q, torch.zeros(2, 1, 16, 8))


def test_checkpoint_attention_leaves_the_callers_config_alone():
    transformers = pytest.importorskip("transformers")
    from seqpar.dropin import checkpoint_attention
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (2, 8))
    before = model(input_ids=ids, labels=ids).loss
    checkpoint_attention(model)
    assert config._attn_implementation == "eager", "the caller's config object was changed"
    assert model.config is not config and model.config._attn_implementation != "eager"
    assert all(m.config is model.config for m in model.modules() if hasattr(m, "config"))
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, before)
