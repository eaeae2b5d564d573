"""Precision modes: the paper's bf16 recipe keeps Table 2's bytes; fp32 masters, fp32 accumulation."""
import pytest
import torch

from seqpar.distributed.collectives import all_reduce_coalesced
from seqpar.memory.ledger import ActivationLedger
from seqpar.memory.whole_model import model_activation_bytes
from seqpar.model import GPT, GPTConfig
from seqpar.train.precision import Precision, resolve_precision

from distributed_harness import tp_group_of


def _cfg(**kw):
    base = dict(vocab_size=512, seq_len=64, hidden=64, heads=4, layers=3, dropout=0.1, attention_dropout=0.1,
                sequence_parallel=False)
    return GPTConfig(**{**base, **kw})


def _tokens(seed=0, b=4, s=64, v=512):
    return torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(seed))


def test_softmax_output_stays_bf16_under_autocast():
    model = GPT(_cfg(layers=1, dropout=0.0, attention_dropout=0.0, recompute="none"))
    seen = []
    model.blocks[0].attn.core.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with ActivationLedger(model) as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
        model(_tokens(), _tokens(1))
    probs = [r for r in ledger.records if r.term.startswith("softmax output")]
    assert probs and all(r.dtype == torch.bfloat16 for r in probs), [(r.term, r.dtype) for r in probs]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_whole_model_formula_matches_the_ledger(precision, recompute, dropout):
    cfg = _cfg(recompute=recompute, dropout=dropout, attention_dropout=dropout)
    model, prec = GPT(cfg), Precision(precision, torch.device("cpu"))
    weights = prec.compute_weights(model)
    with prec.weights_in(model, weights), ActivationLedger(model) as ledger:
        model(_tokens(), _tokens(1))
    formula = model_activation_bytes(cfg, t=1, micro_batch=4, activation_bytes=prec.activation_bytes)
    assert ledger.total() / formula["total"] == pytest.approx(1.0, abs=0.02)
    assert ledger.outside_layers() / formula["outside_layers"] == pytest.approx(1.0, abs=0.02)


def test_bf16_recipe_keeps_fp32_masters_and_accumulates_in_fp32():
    cfg = _cfg(recompute="full", dropout=0.0, attention_dropout=0.0)
    model, prec = GPT(cfg), Precision("bf16", torch.device("cpu"))
    ref = GPT(cfg)
    weights = prec.compute_weights(model)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    losses = []
    for seed in (0, 1):
        with prec.weights_in(model, weights):
            loss = model(_tokens(seed), _tokens(seed + 10))
            assert model.wte.weight.dtype == torch.bfloat16  # the step computes on the copies
            loss.backward()
        for n, w in weights.items():
            expected[n] += w.grad.float()
        prec.accumulate(model, weights)
        assert all(w.grad is None for w in weights.values())
        losses.append(float(loss.detach()))
        losses.append(float(ref(_tokens(seed), _tokens(seed + 10))))
    for n, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and p.dtype == torch.float32 and p.grad.dtype == torch.float32
        assert torch.equal(p.grad, expected[n]), n
    assert losses[0] == pytest.approx(losses[1], rel=1e-2) and losses[2] == pytest.approx(losses[3], rel=1e-2)


def test_weights_are_put_back_after_an_error():
    model, prec = GPT(_cfg(layers=1)), Precision("bf16", torch.device("cpu"))
    before = dict(model.named_parameters())
    with pytest.raises(RuntimeError, match="boom"), prec.weights_in(model, prec.compute_weights(model)):
        raise RuntimeError("boom")
    assert all(p is before[n] for n, p in model.named_parameters())


def test_precision_names_and_model_check():
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    with pytest.raises(ValueError, match="'fp16'"):
        resolve_precision("fp16", torch.device("cpu"))
    with pytest.raises(ValueError, match="bfloat16"):
        Precision("bf16", torch.device("cpu")).check_model(GPT(_cfg(layers=1, dtype="bfloat16")))


def _coalesced(rank, world):
    group = tp_group_of(world)
    xs = [torch.full((3,), float(rank + 1)), torch.full((2, 2), 10.0 * (rank + 1), dtype=torch.float64),
          torch.full((1,), float(rank))]
    all_reduce_coalesced(xs, group)
    ys = [torch.full((2,), float(rank + 1), dtype=torch.bfloat16)]
    all_reduce_coalesced(ys, group, mean=True)
    return [x.tolist() for x in xs], ys[0].float().tolist(), xs[1].dtype


def test_all_reduce_coalesced_sums_each_dtype(spawn):
    for xs, ys, dtype in spawn(_coalesced, 2):
        assert xs == [[3.0] * 3, [[30.0, 30.0], [30.0, 30.0]], [1.0]]
        assert ys == [1.5, 1.5] and dtype == torch.float64
