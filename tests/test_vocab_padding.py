"""Any vocabulary at any TP size: the table is padded to a multiple of t (or vocab_multiple x t),
the padded logits are -inf, and loss, gradients, samples and dense state dicts are the unpadded model's."""
import pytest
import torch
import torch.nn.functional as F

from distributed_harness import rel_err, run_ranks, tp_group_of
from gpt_helpers import batch, loss_and_dense_grads, mesh_for, tiny_config
from seqpar.distributed.collectives import all_gather_dim
from seqpar.layers import vocab_parallel_cross_entropy
from seqpar.model import GPT, GPTConfig
from seqpar.train.generate import sample

GPT2_VOCAB = 50257


def _cross_entropy():
    """Padded columns hold huge logits: masked, they change nothing; at t=4 ranks 2 and 3 hold only padding."""
    torch.manual_seed(0)
    out = {}
    for t, vocab, smoothing in ((2, 7, 0.0), (2, 7, 0.1), (4, 5, 0.1), (4, 5, 0.0)):
        group, padded = tp_group_of(t), 4 * t
        full = torch.randn(6, 3, padded, dtype=torch.float64)
        full[..., vocab:] = 1e4
        targets = torch.randint(0, vocab, (6, 3))
        targets[0, 0] = -100
        local = full.chunk(t, -1)[torch.distributed.get_rank() % t].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, tp_group=group, vocab_size=vocab, label_smoothing=smoothing)
        loss.backward()
        out[(t, vocab, smoothing)] = (full, targets, loss.detach(), all_gather_dim(local.grad, group, -1))
        with pytest.raises(ValueError, match=rf"target id {vocab} is outside the vocabulary \[0, {vocab}\)"):
            vocab_parallel_cross_entropy(local, targets.clone().fill_(vocab), tp_group=group, vocab_size=vocab)
    return out


def _gpt2_vocab():
    """GPT-2's 50257 at t = 1, 2, 4, 8 (tiny hidden): same loss, grads, samples and dense weights."""
    out, ref_state = {}, None
    for t in (1, 2, 4, 8):
        group = tp_group_of(t)
        cfg = tiny_config(vocab_size=GPT2_VOCAB, hidden=16, heads=8, layers=1, seq_len=8, ffn_hidden=16, init_std=1.0)
        model = GPT(cfg, mesh_for(group), seed=4)
        ref_state = ref_state or model.dense_state_dict()  # t = 1's, loaded everywhere: "loads at any t"
        model.load_dense_state_dict(ref_state)
        tokens, labels = batch(cfg, b=2, seed=1)
        tokens[0, :2], labels[0, :2] = GPT2_VOCAB - 1, GPT2_VOCAB - 1  # the last real id
        local = model(tokens)
        logits = all_gather_dim(local.detach(), group, -1)
        loss, grads = loss_and_dense_grads(model, tokens, labels)
        ids = sample(model, [1, 2, 3], 4, seed=7), sample(model, [1, 2, 3], 4, temperature=0.0)
        out[t] = (logits, loss, grads, model.dense_state_dict(), ids, local.shape[-1])
    return out


def _all_checks(rank, world):
    return {"cross_entropy": _cross_entropy(), "gpt2": _gpt2_vocab()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_all_checks, 8, tmp_path_factory.mktemp("vocab"))


def test_cross_entropy_ignores_the_padded_columns(ranks):
    for r in (r["cross_entropy"] for r in ranks):
        for (t, vocab, smoothing), (full, targets, loss, grad) in r.items():
            logits = full[..., :vocab].clone().requires_grad_()
            ref = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), label_smoothing=smoothing)
            ref.backward()
            assert rel_err(loss, ref) <= 1e-12, (t, vocab, smoothing)
            assert rel_err(grad[..., :vocab], logits.grad) <= 1e-12 and not grad[..., vocab:].any()


def test_gpt2_vocabulary_trains_and_loads_at_t_1_2_4_8(ranks):
    res = [r["gpt2"] for r in ranks]
    ref_logits, ref_loss, ref_grads, ref_state, ref_ids, _ = res[0][1]
    assert ref_state["wte.weight"].shape[0] == GPT2_VOCAB and ref_logits.shape[-1] == GPT2_VOCAB
    for rank, r in enumerate(res):
        for t, (logits, loss, grads, state, ids, local_v) in r.items():
            padded = -(-GPT2_VOCAB // t) * t
            assert local_v == padded // t and logits.shape[-1] == padded
            assert torch.isneginf(logits[..., GPT2_VOCAB:]).all(), (rank, t)
            assert rel_err(logits[..., :GPT2_VOCAB], ref_logits) <= 1e-5, (rank, t)
            assert rel_err(loss, ref_loss) <= 1e-5, (rank, t)
            assert grads["wte.weight"].shape[0] == GPT2_VOCAB
            for name, g in grads.items():
                assert rel_err(g, ref_grads[name]) <= 1e-5, (rank, t, name)
            assert all(torch.equal(state[n], w) for n, w in ref_state.items()), (rank, t)
            # greedy samples are the unpadded model's; a multinomial draw consumes the generator once per
            # column (padded ones too), so stochastic samples only match where no column is padded
            assert ids[1] == ref_ids[1] and max(ids[0]) < GPT2_VOCAB, (rank, t)
            assert ids[0] == ref_ids[0] or padded != GPT2_VOCAB, (rank, t)


def test_vocab_multiple_pads_without_changing_the_model():
    cfg = tiny_config(vocab_size=61, tie_embeddings=False)
    padded = tiny_config(vocab_size=61, tie_embeddings=False, vocab_multiple=128)
    assert (cfg.padded_vocab(), padded.padded_vocab(), padded.padded_vocab(2)) == (61, 128, 256)
    a, b = GPT(cfg, seed=1), GPT(padded, seed=1)
    assert b.wte.weight.shape == (128, 32) and not b.wte.weight[61:].any() and not b.lm_head.weight[61:].any()
    tokens, labels = batch(cfg)
    (la, ga), (lb, gb) = loss_and_dense_grads(a, tokens, labels), loss_and_dense_grads(b, tokens, labels)
    assert rel_err(lb, la) <= 1e-6 and all(rel_err(gb[n], g) <= 1e-5 for n, g in ga.items())
    assert not b.wte.weight.grad[61:].any() and not b.lm_head.weight.grad[61:].any()
    assert all(torch.equal(w, b.dense_state_dict()[n]) for n, w in a.dense_state_dict().items())
    b.load_dense_state_dict(a.dense_state_dict())
    assert b.to_local({"wte.weight": torch.ones(61, 32)})["wte.weight"][61:].abs().sum() == 0
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 61\)"):
        b(torch.full((1, 4), 61))


def test_sampling_from_a_padded_vocabulary_draws_the_unpadded_models_tokens():
    base = dict(vocab_size=50, seq_len=16, hidden=16, heads=2, layers=1, dropout=0.0, attention_dropout=0.0)
    plain, padded = GPT(GPTConfig(**base), seed=1), GPT(GPTConfig(**base, vocab_multiple=64), seed=1)
    assert padded.padded_vocab == 64 and plain.padded_vocab == 50
    for name, w in plain.dense_state_dict().items():
        assert torch.equal(w, padded.dense_state_dict()[name]), name
    for seed in range(3):
        a = sample(plain, [1, 2, 3], 10, temperature=1.0, top_k=0, seed=seed)
        b = sample(padded, [1, 2, 3], 10, temperature=1.0, top_k=0, seed=seed)
        assert a == b and max(a) < 50
