"""Dropout in Hugging Face models parallelized by the ready plans: per-TP-rank masks on sequence
shards and per-rank heads, the same mask on every rank for full tensors (DESIGN, "Rules").

Each draw is recorded with :class:`seqpar.tools.verify.masks.DropoutRecorder` (digests of the
input and the mask, and the module it ran in); one 2-rank spawn records every case."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from distributed_harness import run_ranks, tp_group_of  # noqa: E402
from dropin_helpers import batch, gpt2, llama, loss_of  # noqa: E402
from gpt_helpers import mesh_for  # noqa: E402
from seqpar import parallelize, plans  # noqa: E402
from seqpar.dropin import Plan, set_sequence_parallel  # noqa: E402
from seqpar.errors import UserError  # noqa: E402
from seqpar.tools.verify.masks import DropoutRecorder  # noqa: E402

GPT2_DROPOUT = dict(attn_pdrop=0.3, resid_pdrop=0.1, embd_pdrop=0.1)
LLAMA_DROPOUT = dict(attention_dropout=0.3)
RESIDUAL = (".attn.resid_dropout", ".mlp.dropout")  # GPT-2's dropouts after c_proj, inside the region


def draws(model) -> list[tuple[str, str]]:
    """``(module, mask digest)`` of each dropout drawn in one forward + backward of ``model``."""
    with DropoutRecorder(model) as rec:
        loss_of(model, batch()).backward()
    return [(d.where, d.mask) for d in rec.draws if not d.backward]


def _switched_off(mesh):
    model = parallelize(gpt2(**GPT2_DROPOUT), plans.gpt2(), mesh)
    return set_sequence_parallel(model, False)


def _ranks(rank, world):
    mesh = mesh_for(tp_group_of(world))
    return {"sp": draws(parallelize(gpt2(**GPT2_DROPOUT), plans.gpt2(), mesh)),
            "nosp": draws(parallelize(gpt2(**GPT2_DROPOUT), plans.gpt2(), mesh, sequence_parallel=False)),
            "switched": draws(_switched_off(mesh)),
            "llama": draws(parallelize(llama(**LLAMA_DROPOUT), plans.llama(), mesh))}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_ranks, 2, tmp_path_factory.mktemp("dropout"))


def _by_place(case: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for where, mask in case:
        out.setdefault(where, []).append(mask)
    return out


def _kind(where: str) -> str:
    if where == "transformer.drop":
        return "embedding"
    return "residual" if where.endswith(RESIDUAL) else "attention"


def test_sequence_parallel_region_draws_per_rank_masks_outside_it_one_mask(ranks):
    r0, r1 = (_by_place(r["sp"]) for r in ranks)
    assert sorted(r0) == sorted(r1) and sorted({_kind(w) for w in r0}) == ["attention", "embedding", "residual"]
    assert len(r0["transformer.h.1.attn"]) == 1 and len(r0) == 7  # embedding, then 3 per layer
    for where in r0:
        same = r0[where] == r1[where]
        assert same == (_kind(where) == "embedding"), f"{where}: ranks drew {'the same' if same else 'other'} masks"
    plain = _by_place(draws(gpt2(**GPT2_DROPOUT)))  # unparallelized, torch seeded alike
    assert r0["transformer.drop"] == plain["transformer.drop"], "the embedding dropout is the single process's"


def test_plain_tp_residual_dropout_is_replicated_and_the_single_process_ones(ranks):
    r0, r1 = (_by_place(r["nosp"]) for r in ranks)
    single = _by_place(draws(parallelize(gpt2(**GPT2_DROPOUT), plans.gpt2(), None)))  # same seed, t=1
    for where in r0:
        if _kind(where) == "attention":  # each rank's heads
            assert r0[where] != r1[where], where
        else:  # full tensors after the all-reduce: one mask, the one a single process draws
            assert r0[where] == r1[where] == single[where], where
    for r in ranks:  # set_sequence_parallel(False) draws what parallelize(sequence_parallel=False) does
        assert r["switched"] == r["nosp"]


def test_llama_attention_dropout_draws_per_rank(ranks):
    r0, r1 = (_by_place(r["llama"]) for r in ranks)
    assert sorted(r0) == ["model.layers.0.self_attn", "model.layers.1.self_attn"] == sorted(r1)
    assert all(r0[w] != r1[w] for w in r0)


def test_seed_chooses_the_masks_and_bad_seeds_or_dropouts_raise():
    def first_loss(seed):  # the same weights and torch generator (gpt2() seeds it): only the streams differ
        return loss_of(parallelize(gpt2(**GPT2_DROPOUT), plans.gpt2(), None, seed=seed), batch())

    assert torch.equal(first_loss(1), first_loss(1)) and not torch.equal(first_loss(1), first_loss(2))
    with pytest.raises(UserError, match=r"seed must be an int in \[0, 2\*\*63\), got -1"):
        parallelize(gpt2(), plans.gpt2(), None, seed=-1)
    model = gpt2()
    model.transformer.h[0].mlp.dropout = torch.nn.Dropout1d(0.1)
    plan = Plan(layers={"transformer.h.*.mlp.dropout": "sequence"})
    with pytest.raises(ValueError, match=r"transformer.h.0.mlp.dropout \(sequence\) is a Dropout1d"):
        parallelize(model, plan, None)


def test_compiled_attention_dropout_draws_the_eager_masks_with_and_without_recompute():
    """Under torch.compile the attention core drawing from the streams runs outside the graph:
    the same loss and gradients as eager, recomputed or not (dynamo only, to keep it quick)."""
    from dropin_helpers import grads_of
    from seqpar.dropin import checkpoint_attention

    def run(compiled: bool, recompute: bool):
        model = parallelize(gpt2(n_layer=1, **GPT2_DROPOUT), plans.gpt2(), None)
        if recompute:
            checkpoint_attention(model)
        torch._dynamo.reset()
        loss = loss_of(torch.compile(model, backend="eager") if compiled else model, batch())
        loss.backward()
        return loss.detach(), grads_of(model, True)

    (ref, ref_grads), (got, grads) = run(False, False), run(True, True)
    assert torch.equal(got, ref) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_hugging_face_gradient_checkpointing_replays_the_streams_with_replay_streams():
    """torch.utils.checkpoint replays torch's generators only; with ``context_fn=replay_streams(model)``
    the recomputed layers draw the forward's masks: gradients bit-identical to keeping activations."""
    from dropin_helpers import grads_of
    from seqpar.dropin import replay_streams

    def run(recompute: bool):
        model = parallelize(gpt2(**GPT2_DROPOUT), plans.gpt2(), None)
        if recompute:
            model.activation_checkpointing_enable({"use_reentrant": False, "context_fn": replay_streams(model)})
        loss = loss_of(model, batch())
        loss.backward()
        return loss.detach(), grads_of(model, True)

    (ref, ref_grads), (got, grads) = run(False), run(True)
    assert torch.equal(got, ref) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    with pytest.raises(ValueError, match="replay_streams: GPT2LMHeadModel was not parallelized"):
        replay_streams(gpt2())


def test_hugging_face_gradient_checkpointing_without_replay_streams_is_refused():
    """Before: checkpointing without ``context_fn=replay_streams(model)`` recomputed each layer with
    new masks from the streams, and the gradients were silently wrong. Now the first training
    forward refuses it in one line naming the fix; evaluation, no-grad and dropout-free models run."""
    from seqpar.dropin import replay_streams

    model = parallelize(gpt2(**GPT2_DROPOUT), plans.gpt2(), None)
    model.activation_checkpointing_enable({"use_reentrant": False})
    with pytest.raises(UserError, match=r"GPT2LMHeadModel: gradient checkpointing is on.*replay_streams\(model\)"):
        loss_of(model, batch())
    other = parallelize(gpt2(**GPT2_DROPOUT), plans.gpt2(), None)  # another model's streams do not replay these
    model.activation_checkpointing_enable({"use_reentrant": False, "context_fn": replay_streams(other)})
    with pytest.raises(UserError, match="gradient checkpointing is on"):
        loss_of(model, batch())
    with torch.no_grad():
        loss_of(model, batch())
    model.eval()
    loss_of(model, batch())
    model.train()
    model.activation_checkpointing_enable({"use_reentrant": False, "context_fn": replay_streams(model)})
    loss_of(model, batch()).backward()
    plain = parallelize(gpt2(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0), plans.gpt2(), None)
    plain.activation_checkpointing_enable({"use_reentrant": False})
    loss_of(plain, batch()).backward()  # nothing to replay: no dropout draws
