"""The vocabulary-parallel cross-entropy (online log-sum-exp): exact against F.cross_entropy at fp64
for t = 1 and 2 (padded vocabulary, label smoothing, ignored targets, passes cut into chunks);
bf16 logits keep bf16 gradients; what it saves for backward equals the memory formula, with no
fp32 [tokens, v/t] copy among it; two all-reduces of [tokens]-shaped tensors per call."""
import pytest
import torch
import torch.nn.functional as F

from distributed_harness import rel_err, tp_group_of
from seqpar.distributed import count_comm
from seqpar.distributed.collectives import group_rank
from seqpar.layers import cross_entropy
from seqpar.layers import vocab_parallel_cross_entropy
from seqpar.memory import ActivationLedger, cross_entropy_terms

S, B, PADDED = 5, 3, 16  # tokens [S, B]; the output layer's rows (the vocabulary padded to 16)


class _Loss(torch.nn.Module):
    """Just the loss, so that the ledger sees what the cross-entropy alone keeps."""

    def __init__(self, group, **kw):
        super().__init__()
        self.group, self.kw = group, kw

    def forward(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, tp_group=self.group, **self.kw)


def _inputs(vocab: int):
    """Logits ``[S, B, PADDED]`` fp64 whose padded columns are huge (they must be masked) and targets
    with an ignored position and the last real id."""
    torch.manual_seed(0)
    full = 3 * torch.randn(S, B, PADDED, dtype=torch.float64)
    full[..., vocab:] = 1e4
    targets = torch.randint(0, vocab, (S, B))
    targets[0, 0], targets[1, 1] = -100, vocab - 1
    return full, targets


def _case(group, t: int, dtype: torch.dtype, vocab: int, smoothing: float, reduction: str) -> dict:
    """This rank's loss and logit gradient against F.cross_entropy in fp64 on the same (rounded) logits,
    the saved bytes against the formula, and the collectives of one call."""
    full, targets = _inputs(vocab)
    k, r = PADDED // t, group_rank(group)
    local = full[..., r * k:(r + 1) * k].to(dtype).contiguous().requires_grad_()
    dense = full[..., :vocab].to(dtype).double().requires_grad_()
    weights = torch.rand(S, B, dtype=torch.float64)  # a per-token upstream gradient for "none"
    ref = F.cross_entropy(dense.reshape(-1, vocab), targets.reshape(-1), label_smoothing=smoothing,
                          reduction=reduction)
    (ref if reduction != "none" else (ref.view(S, B) * weights).sum()).backward()
    module = _Loss(group, vocab_size=vocab, label_smoothing=smoothing, reduction=reduction)
    with count_comm() as comm, ActivationLedger(module) as ledger:
        loss = module(local, targets)
    (loss if reduction != "none" else (loss * weights.to(loss.dtype)).sum()).backward()
    ref_grad = F.pad(dense.grad, (0, PADDED - vocab))[..., r * k:(r + 1) * k]
    return {"loss": rel_err(loss, ref.view(loss.shape)), "grad": rel_err(local.grad, ref_grad),
            "grad_dtype": local.grad.dtype, "loss_dtype": loss.dtype, "comm": dict(comm.calls),
            "saved": ledger.total(), "records": [(r.shape, r.dtype) for r in ledger.records]}


def _all_cases(rank, world):
    out = {}
    cross_entropy.CHUNK_ELEMENTS = 8  # one or two tokens per chunk: the chunked passes are exercised
    for t in (1, 2):
        group = tp_group_of(t)
        for vocab in (PADDED, 11):  # 11: rank 1's shard at t=2 is mostly padding
            for smoothing in (0.0, 0.1):
                for reduction in ("mean", "sum", "none"):
                    out[(t, vocab, smoothing, reduction)] = _case(group, t, torch.float64, vocab, smoothing, reduction)
        for dtype in (torch.float32, torch.bfloat16):
            out[(t, dtype)] = _case(group, t, dtype, 11, 0.1, "sum")
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from distributed_harness import run_ranks
    return run_ranks(_all_cases, 2, tmp_path_factory.mktemp("ce"))


def test_exact_against_dense_cross_entropy_at_fp64(ranks):
    for rank, res in enumerate(ranks):
        for key, r in res.items():
            if len(key) == 4:
                assert r["loss"] <= 1e-13 and r["grad"] <= 1e-13, (rank, key, r["loss"], r["grad"])
                assert r["grad_dtype"] == torch.float64 and r["loss_dtype"] == torch.float64, (rank, key)


def test_low_precision_logits_keep_their_dtype_and_accuracy(ranks):
    for rank, res in enumerate(ranks):
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            for t in (1, 2):
                r = res[(t, dtype)]
                assert r["grad_dtype"] == dtype and r["loss_dtype"] == torch.float32, (rank, t, dtype)
                assert r["loss"] <= 1e-6 and r["grad"] <= tol, (rank, t, dtype, r["loss"], r["grad"])


def test_saved_bytes_equal_the_formula_and_hold_no_fp32_logits(ranks):
    """The logits in their own dtype plus 8 bytes a token (fp32 log-sum-exp, int32 target code);
    the mean's token count is one more 8-byte scalar."""
    for rank, res in enumerate(ranks):
        for t in (1, 2):
            for dtype in (torch.float32, torch.bfloat16):
                r = res[(t, dtype)]
                formula = sum(cross_entropy_terms(s=S, b=B, v=PADDED, t=t, act=dtype.itemsize).values())
                assert r["saved"] == formula, (rank, t, dtype, r["saved"], formula)
                wide = [(shape, dt) for shape, dt in r["records"] if shape[-1:] == (PADDED // t,)]
                assert wide == [((S, B, PADDED // t), dtype)], (rank, t, r["records"])  # the logits themselves
            r = res[(t, PADDED, 0.0, "mean")]  # fp64: an fp64 log-sum-exp, and the mean's count
            assert r["saved"] == 8 * S * B * PADDED // t + (8 + 4) * S * B + 8, (rank, t, r["saved"])


def test_two_all_reduces_per_call(ranks):
    for rank, res in enumerate(ranks):
        for key, r in res.items():
            assert r["comm"] == ({"all_reduce": 2} if key[0] == 2 else {}), (rank, key, r["comm"])


def test_a_gpt_size_loss_runs_in_about_a_hundred_chunks_not_hundreds():
    """Each chunk is a few kernels and views: at a 1.3B GPT's step (8192 tokens, v = 50304, bf16)
    the loss's forward and backward take about 100 chunks per pass (1M-element chunks made about
    410). Counted on fake tensors: no memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        logits = torch.empty(2048, 4, 50304, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.zeros(2048, 4, dtype=torch.long)
        with Count():  # the autograd function itself: the wrapper's CPU target check reads a value
            cross_entropy._VocabParallelCrossEntropy.apply(logits, targets, None, -100, 0.0, 50304).sum().backward()
    assert 0 < Count.ops <= 8000, Count.ops  # 103 chunks per pass: 6,630 ops, views included (27,156 before)
