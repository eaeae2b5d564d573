"""GPT across TP sizes, sequence parallelism and recompute modes: the same model, the same math."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from distributed_harness import rel_err, tp_group_of
from gpt_helpers import batch, loss_and_dense_grads, mesh_for, tiny_config
from seqpar.model import GPT, GPTConfig

RECOMPUTE = [("none", "uniform", 1), ("selective", "uniform", 1), ("full", "uniform", 2), ("full", "block", 2)]


def _equivalence(rank, world):
    out = {}
    for t in (1, 2, 4):
        group = tp_group_of(t)
        for sp in (False, True):
            for mode, method, n in RECOMPUTE:
                cfg = tiny_config(sequence_parallel=sp, recompute=mode, recompute_method=method, recompute_num_layers=n)
                model = GPT(cfg, mesh_for(group), seed=3)
                tokens, labels = batch(cfg)
                loss, grads = loss_and_dense_grads(model, tokens, labels)
                out[(t, sp, mode, method)] = (loss, grads, model.dense_state_dict() if mode == "none" else None)
    return out


def test_loss_and_grads_match_single_rank_for_every_layout(spawn):
    res = spawn(_equivalence, 4)
    ref_loss, ref_grads, ref_weights = res[0][(1, False, "none", "uniform")]
    assert len(ref_grads) == 3 * 12 + 4
    for rank, r in enumerate(res):
        for key, (loss, grads, weights) in r.items():
            assert rel_err(loss, ref_loss) <= 1e-5, f"rank {rank} {key}: loss {loss} vs {ref_loss}"
            for name, g in grads.items():
                assert rel_err(g, ref_grads[name]) <= 1e-5, f"rank {rank} {key}: grad {name} err {rel_err(g, ref_grads[name]):.1e}"
            if weights is not None:  # same seed -> same dense model for every t
                for name, w in weights.items():
                    assert torch.equal(w, ref_weights[name]), f"rank {rank} {key}: init of {name} depends on t"


def _dropout_exact(rank, world):
    group = tp_group_of(world)
    out = {}
    for sp in (False, True):
        for mode, method, n in RECOMPUTE:
            cfg = tiny_config(sequence_parallel=sp, dropout=0.2, attention_dropout=0.3, recompute=mode,
                              recompute_method=method, recompute_num_layers=n)
            model = GPT(cfg, mesh_for(group), seed=5)
            tokens, labels = batch(cfg)
            torch.manual_seed(123)
            losses = []
            for _ in range(2):  # two steps: the streams advance identically too
                loss, grads = loss_and_dense_grads(model, tokens, labels)
                losses.append(loss)
            out[(sp, mode, method)] = (losses, grads)
    return out


def test_recompute_is_rng_exact_with_dropout(spawn):
    for rank, r in enumerate(spawn(_dropout_exact, 2)):
        for sp in (False, True):
            ref_losses, ref_grads = r[(sp, "none", "uniform")]
            assert not torch.equal(ref_losses[0], ref_losses[1]), "dropout should change the loss between steps"
            for (sp2, mode, method), (losses, grads) in r.items():
                if sp2 != sp:
                    continue
                for a, b in zip(losses, ref_losses):
                    assert torch.equal(a, b), f"rank {rank} sp={sp} {mode}/{method}: loss not bit-identical"
                for name, g in grads.items():
                    assert torch.equal(g, ref_grads[name]), f"rank {rank} sp={sp} {mode}/{method}: {name} differs"


def _flops(model, tokens, labels, backward=True):
    with FlopCounterMode(display=False) as fc:
        loss = model(tokens, labels)
        if backward:
            loss.backward()
    return fc.get_total_flops()


def test_recompute_flops_are_exactly_the_recomputed_forward():
    cfg = tiny_config(layers=3)
    tokens, labels = batch(cfg)
    b, s, h, L = tokens.shape[0], cfg.seq_len, cfg.hidden, cfg.layers
    base = _flops(GPT(cfg, seed=0), tokens, labels)
    selective = _flops(GPT(tiny_config(recompute="selective"), seed=0), tokens, labels)
    assert selective - base == L * 4 * b * s * s * h  # QK^T and attention-over-V, forward only
    full_model = GPT(tiny_config(recompute="full", recompute_num_layers=2), seed=0)
    full = _flops(full_model, tokens, labels)
    fwd = _flops(GPT(cfg, seed=0), tokens, labels, backward=False)
    logits = 2 * b * s * h * cfg.vocab_size
    assert full - base == fwd - logits  # one extra forward of every block, nothing else


def test_sdpa_matches_math():
    tokens, labels = batch(tiny_config())
    for sp in (False, True):
        ref = loss_and_dense_grads(GPT(tiny_config(sequence_parallel=sp), seed=2), tokens, labels)
        got = loss_and_dense_grads(GPT(tiny_config(sequence_parallel=sp, attention="sdpa"), seed=2), tokens, labels)
        assert rel_err(got[0], ref[0]) <= 1e-6
        for name, g in got[1].items():
            assert rel_err(g, ref[1][name]) <= 1e-5, name


def test_dense_state_dict_round_trip_and_errors():
    a, b = GPT(tiny_config(tie_embeddings=False), seed=1), GPT(tiny_config(tie_embeddings=False), seed=2)
    tokens, labels = batch(a.config)
    assert not torch.equal(a(tokens, labels), b(tokens, labels))
    b.load_dense_state_dict(a.dense_state_dict())
    assert torch.equal(a(tokens, labels), b(tokens, labels))
    sd = a.dense_state_dict()
    del sd["lm_head.weight"]
    sd["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\], unexpected \['extra'\]"):
        b.load_dense_state_dict(sd)


def test_config_errors_name_the_values():
    with pytest.raises(ValueError, match=r"heads \(6\).*hidden \(30\).*seq_len \(15") as err:
        GPTConfig(vocab_size=63, seq_len=15, hidden=30, heads=6, layers=1).check_parallel(4)
    assert "vocab_size" not in str(err.value)  # any vocabulary: padded to a multiple of t inside the model
    GPTConfig(hidden=32, heads=8, kv_heads=2, ffn_hidden=64).check_parallel(4)  # g < t: heads replicated
    with pytest.raises(ValueError, match=r"kv_heads \(3; heads=12\) and the tensor-parallel size t=4"):
        GPTConfig(hidden=48, heads=12, kv_heads=3, ffn_hidden=64).check_parallel(4)
    with pytest.raises(ValueError, match=r"kv_heads \(3\) must be a positive integer dividing heads \(8\)"):
        GPTConfig(hidden=32, heads=8, kv_heads=3).validate()
    with pytest.raises(ValueError, match=r"hidden \(30\) must be divisible by heads \(4\)"):
        GPTConfig(hidden=30, heads=4).validate()
    with pytest.raises(ValueError, match=r"recompute must be one of .* got 'some'"):
        GPTConfig(recompute="some").validate()
    model = GPT(tiny_config(), seed=0)
    with pytest.raises(ValueError, match=r"sequence length 32 exceeds config.seq_len=16"):
        model(torch.zeros(2, 32, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tokens \[batch, seq\]; got shape \(16,\)"):
        model(torch.zeros(16, dtype=torch.long))


def _bad_parallel_config(rank, world):
    try:
        GPT(tiny_config(heads=2, hidden=34, vocab_size=66), mesh_for(tp_group_of(4)))
        msg = None
    except ValueError as e:
        msg = str(e)
    torch.distributed.barrier()  # reached only if no rank entered a collective first
    return msg


def test_bad_parallel_config_raises_on_every_rank(spawn):
    for msg in spawn(_bad_parallel_config, 4):
        assert msg and "t=4" in msg and "heads (2)" in msg and "hidden (34)" in msg and "vocab_size" not in msg
