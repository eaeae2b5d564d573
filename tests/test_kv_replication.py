"""Grouped-query attention with fewer key/value heads than TP ranks (g < t): each rank holds the
one key/value head its query heads use, replicated over the t/g ranks sharing it, its gradient
summed over exactly them. At t=4 with g=2 and g=1 the model equals t=1 (loss, dense gradients,
clip norm; SP and recompute), checkpoints move between t=4 and t=1, and Hugging Face Llama
models give the same logits and gradients through from_hf and through seqpar.parallelize."""
from pathlib import Path

import pytest
import torch

import seqpar
from distributed_harness import rel_err, run_ranks, tp_group_of
from gpt_helpers import batch, loss_and_dense_grads, mesh_for, tiny_config
from seqpar import checkpoint as ck
from seqpar.distributed.collectives import all_gather_dim
from seqpar.dropin import dense_state_dict
from seqpar.memory import ActivationLedger
from seqpar.memory.params import layer_params
from seqpar.memory.whole_model import layer_bytes
from seqpar.model import GPT, GPTConfig
from seqpar.parallel.grads import clip_grad_norm
from seqpar.sharding import ParamLayout, dense_shape, local_shape, shard, to_dense
from seqpar.train.optim import build_optimizer

V, HV = 61, 64  # an odd vocabulary (padded inside the GPT); parallelize needs one t divides
LAYOUTS = [(True, "none"), (True, "selective"), (True, "full"), (False, "selective")]  # (SP, recompute)


def llama_config(g: int, **kw) -> GPTConfig:
    base = dict(vocab_size=V, hidden=32, heads=4, kv_heads=g, ffn_hidden=40, layers=2, norm="rmsnorm",
                position="rope", mlp="swiglu", bias=True, tie_embeddings=False)
    return tiny_config(**{**base, **kw})


def _gpt_equivalence(group, t):
    out = {}
    for g in (2, 1):
        for sp, mode in LAYOUTS:
            model = GPT(llama_config(g, sequence_parallel=sp, recompute=mode), mesh_for(group), seed=3)
            tokens, labels = batch(model.config)
            loss, grads = loss_and_dense_grads(model, tokens, labels)
            norm_pp = clip_grad_norm(model, 0.0, tp_group=group) if t > 1 else None  # measures only
            norm = clip_grad_norm(model, 1e-3, tp_group=group)  # clips: the clipped grads must stay dense-equal
            clipped = model.to_dense({n: p.grad for n, p in model.named_parameters()})
            out[(t, g, sp, mode)] = (loss, grads, norm, norm_pp, clipped, model.dense_state_dict())
    return out


def _trained(group, g: int, seed: int):
    model = GPT(llama_config(g), mesh_for(group), seed=seed)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    tokens, labels = batch(model.config)
    model(tokens, labels).backward()
    seqpar.distributed.sync_sp_replicated_grads(model, group)
    opt.step()
    return model, opt


def _moments(model, opt):
    return model.to_dense({n: opt.state[p]["exp_avg_sq"] for n, p in model.named_parameters()})


def _checkpoints(group4, root):
    """t=4 -> t=1 -> t=4 with g=2: the dense parameters and moments survive both moves."""
    saved, opt = _trained(group4, 2, seed=1)
    folder = ck.save_checkpoint(root / "a", 1, saved, opt, {"tp": 4}, "train: {}\n", saved.rng)
    one, one_opt = _trained(None, 2, seed=2)
    ck.load_checkpoint(folder, one, one_opt, one.rng)
    back_folder = ck.save_checkpoint(root / "b", 2, one, one_opt, {"tp": 1}, "train: {}\n", one.rng)
    back, back_opt = _trained(group4, 2, seed=3)
    ck.load_checkpoint(back_folder, back, back_opt, back.rng)
    return {"saved": (saved.dense_state_dict(), _moments(saved, opt)),
            "t1": (one.dense_state_dict(), _moments(one, one_opt)),
            "back": (back.dense_state_dict(), _moments(back, back_opt))}


def hf_llama(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    cfg = dict(vocab_size=HV, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-6, attn_implementation="eager",
               tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    with torch.no_grad():  # norms start at ones and biases at zeros: make every tensor matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _ids():
    return torch.randint(0, HV, (2, 16), generator=torch.Generator().manual_seed(1))


def _hf_reference():
    hf = hf_llama()
    out = hf(input_ids=_ids(), labels=_ids(), use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in hf.named_parameters()}


def _hf(group):
    from seqpar.interop.llama import from_hf, to_hf
    config, state = from_hf(hf_llama(), sequence_parallel=True, recompute="selective")
    model = GPT(config, mesh_for(group))
    model.load_dense_state_dict(state)
    model.eval()
    with torch.no_grad():
        ours = all_gather_dim(model(_ids()), group, -1)[..., :HV]  # [b, s, v_pad/t] -> [b, s, v]
    back = to_hf(config, model.dense_state_dict()).state_dict()
    round_trip = {k: torch.equal(v, back[k]) for k, v in hf_llama().state_dict().items()}

    hf = hf_llama()
    seqpar.parallelize(hf, seqpar.plans.llama(), mesh_for(group))
    out = hf(input_ids=_ids(), labels=_ids(), use_cache=False)
    out.loss.backward()
    grads = to_dense(hf, {n: p.grad for n, p in hf.named_parameters()}, group)
    dense = dense_state_dict(hf)  # gathered once (a collective per tensor), not once per key
    same_dense = {k: torch.equal(v, dense[k]) for k, v in hf_llama().state_dict().items()}
    return ours, round_trip, out.logits.detach(), grads, same_dense


def _memory(group, t):
    """Per rank: the saved-activation bytes of each layer (ledger) and one layer's parameters."""
    out = {}
    for g in (2, 1):
        for sp, mode in ((True, "selective"), (False, "none")):
            model = GPT(llama_config(g, sequence_parallel=sp, recompute=mode, dropout=0.1), mesh_for(group), seed=3)
            tokens, labels = batch(model.config)
            with ActivationLedger(model) as ledger:
                model(tokens, labels)
            out[(g, sp, mode)] = (ledger.per_layer(), sum(p.numel() for p in model.blocks[0].parameters()))
    return out


def _all(rank, world, root):
    group1, group4 = tp_group_of(1), tp_group_of(4)
    out = {"gpt1": _gpt_equivalence(group1, 1), "gpt4": _gpt_equivalence(group4, 4), "mem": _memory(group4, 4)}
    out["ckpt"] = _checkpoints(group4, root)
    out["hf"], out["hf_ref"] = _hf(group4), _hf_reference()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    (root / "ranks").mkdir()
    return run_ranks(_all, 4, root / "ranks", root)


def test_t4_with_fewer_kv_heads_equals_t1(ranks):
    for rank, r in enumerate(ranks):
        for (t, g, sp, mode), (loss, grads, norm, norm_pp, clipped, dense) in r["gpt4"].items():
            ref_loss, ref_grads, ref_norm, _, ref_clipped, ref_dense = r["gpt1"][(1, g, sp, mode)]
            key = f"rank {rank} g={g} sp={sp} {mode}"
            assert rel_err(loss, ref_loss) < 1e-5, key
            for name, ref in ref_dense.items():  # same initialisation, whatever the layout
                assert torch.equal(dense[name], ref), f"{key}: init of {name}"
            for name, ref in ref_grads.items():
                assert rel_err(grads[name], ref) < 1e-5, f"{key}: {name} {rel_err(grads[name], ref):.1e}"
                assert rel_err(clipped[name], ref_clipped[name]) < 1e-5, f"{key}: clipped {name}"
            assert rel_err(norm, ref_norm) < 1e-6 and rel_err(norm_pp, ref_norm) < 1e-6, f"{key}: {norm} {ref_norm}"


def test_memory_formulas_count_the_replicated_kv_heads(ranks):
    """At t=4 with g=2 or 1 each rank keeps one key/value head: the formulas count t heads, not g."""
    for rank, r in enumerate(ranks):
        for (g, sp, mode), (per_layer, params) in r["mem"].items():
            cfg = llama_config(g, sequence_parallel=sp, recompute=mode, dropout=0.1)
            assert params == layer_params(cfg, 4), (rank, g, sp, mode, params)
            want = layer_bytes(cfg, mode, s=cfg.seq_len, b=2, t=4, act=4, device="cpu")
            for layer, measured in per_layer.items():  # within 1%: the norms' per-token statistics
                assert abs(measured - want) <= 0.01 * want, (rank, g, sp, mode, layer, measured, float(want))


def test_checkpoints_move_between_t4_and_t1_with_replicated_kv_heads(ranks):
    for rank, r in enumerate(ranks):
        saved = r["ckpt"]["saved"]
        for where in ("t1", "back"):
            for part, ref in zip(r["ckpt"][where], saved):
                assert set(part) == set(ref)
                for name, v in ref.items():
                    assert torch.equal(part[name], v), f"rank {rank} {where}: {name}"


def test_hugging_face_llama_at_t4_with_two_kv_heads(ranks):
    for rank, r in enumerate(ranks):
        ours, round_trip, dropin_logits, dropin_grads, same_dense = r["hf"]
        ref_logits, ref_grads = r["hf_ref"]
        assert rel_err(ours, ref_logits) < 1e-5, f"rank {rank}: from_hf"
        assert all(round_trip.values()), [k for k, v in round_trip.items() if not v]
        assert rel_err(dropin_logits, ref_logits) < 1e-5, f"rank {rank}: parallelize"
        assert all(same_dense.values()), [k for k, v in same_dense.items() if not v]
        for name, ref in ref_grads.items():
            assert rel_err(dropin_grads[name], ref) < 1e-5, f"rank {rank}: {name}"


def test_layout_of_replicated_heads():
    """[q; k; v] with 4 query heads and 2 key/value heads of 1 row each over 4 ranks."""
    lay = ParamLayout(split_dim=0, chunks=(4, 2, 2), groups=(4, 2, 2))
    full = torch.arange(8.0).unsqueeze(1)  # q rows 0-3, k rows 4-5, v rows 6-7
    assert [shard(full, lay, r, 4).flatten().tolist() for r in range(4)] == \
        [[0, 4, 6], [1, 4, 6], [2, 5, 7], [3, 5, 7]]
    assert lay.replicas(4) == (1, 2, 2) and lay.counted(1, 4) == (True, False, False)
    assert local_shape((8, 3), lay, 4) == (3, 3) and dense_shape((3, 3), lay, 4) == (8, 3)
    assert not lay.is_replicated(2) and shard(full, lay, 1, 2).flatten().tolist() == [2, 3, 5, 7]


def test_kv_heads_fewer_than_t_are_accepted_and_non_multiples_refused():
    llama_config(2).check_parallel(4)  # was refused: each rank needs whole key/value heads
    llama_config(1).check_parallel(4)
    bad = tiny_config(hidden=48, heads=12, kv_heads=3, vocab_size=V)
    with pytest.raises(ValueError, match=r"kv_heads \(3; heads=12\).*t=4"):
        bad.check_parallel(4)
    with pytest.raises(ValueError, match="groups"):
        ParamLayout(split_dim=0, chunks=(12, 3, 3), groups=(12, 3, 3)).parts(4)


def test_parallelize_refuses_kv_heads_that_t_neither_divides_nor_multiplies():
    transformers = pytest.importorskip("transformers")
    from seqpar.dropin.kv_heads import check_kv, kv_groups
    cfg = transformers.LlamaConfig(vocab_size=HV, hidden_size=48, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=12, num_key_value_heads=3)
    model, plan = transformers.LlamaForCausalLM(cfg), seqpar.plans.llama()
    (error,) = check_kv(model, plan, 4)
    assert "num_key_value_heads = 3" in error and "t=4" in error
    assert check_kv(model, plan, 6) == [] and kv_groups(model, plan, 6) == (3,)  # t = 2g: replicated
    assert check_kv(model, plan, 3) == [] and kv_groups(model, plan, 3) is None  # t = g: plainly split


def _trainer_curves(rank, world, tmp, layouts):
    from test_fsdp import _curve, _trainer
    return {(tp, g): _curve(_trainer(Path(tmp) / f"t{tp}g{g}", tp, model__kv_heads=g), 4) for tp, g in layouts}


def test_trainer_with_fsdp_and_replicated_kv_heads_trains_like_one_rank(spawn, tmp_path):
    """FSDP2 (t=2, dp=2, g=1) and t=4 (g=2): the replicas' gradient sum in backward composes with
    FSDP's reduce-scatter and the Trainer's clip; loss and grad norm curves equal one rank's."""
    for tp, g in ((1, 1), (1, 2), (2, 1), (4, 2)):
        (tmp_path / f"t{tp}g{g}").mkdir()
    ref = spawn(_trainer_curves, 1, str(tmp_path), [(1, 1), (1, 2)])[0]
    for rank, r in enumerate(spawn(_trainer_curves, 4, str(tmp_path), [(2, 1), (4, 2)])):
        for (tp, g), curve in r.items():
            for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(curve, ref[(1, g)])):
                assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss), f"rank {rank} t={tp} g={g} step {step}"
                assert abs(norm - ref_norm) < 1e-5 * abs(ref_norm), f"rank {rank} t={tp} g={g} step {step}"
