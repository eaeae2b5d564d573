"""The planner's memory traffic of the cross-entropy (``CROSS_ENTROPY_BYTES_PER_LOGIT``) is what the
vocabulary-parallel cross-entropy reads of the logits and writes of their gradient, counted op by op."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqpar.layers import cross_entropy, vocab_parallel_cross_entropy
from seqpar.plan.timing import CROSS_ENTROPY_BYTES_PER_LOGIT

TOKENS, V = 64, 512
SPARSE = {"aten.gather.default"}       # reads one logit per token, not a pass
ALLOCATE = {"aten.empty_like.default", "aten.new_empty.default"}  # allocate, read nothing


class _LogitReads(TorchDispatchMode):
    """Bytes that aten ops read from one storage (the logits'), views and allocations excluded."""

    def __init__(self, storage: torch.UntypedStorage):
        super().__init__()
        self.ptr, self.bytes = storage.data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if not func.is_view and name not in ALLOCATE:
            index = kwargs.get("index", args[2] if name in SPARSE else None)
            for a in [*args, *kwargs.values()]:
                if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr:
                    self.bytes += (index.numel() if name in SPARSE else a.numel()) * a.element_size()
        return func(*args, **kwargs)


def _traffic_per_logit(dtype: torch.dtype) -> float:
    """Bytes per logit element: the logits read (by every op, forward and backward) plus the gradient
    written once, for ``[TOKENS, V]`` logits at t = 1, the passes cut into chunks of 4 tokens."""
    torch.manual_seed(0)
    logits = torch.randn(TOKENS, V, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, V, (TOKENS,))
    with _LogitReads(logits.untyped_storage()) as mode:
        vocab_parallel_cross_entropy(logits, targets, tp_group=None).backward()
    assert logits.grad.dtype == dtype
    return (mode.bytes + logits.grad.numel() * logits.grad.element_size()) / logits.numel()


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_cross_entropy_bytes_per_logit_are_the_kernels_passes(monkeypatch, precision, dtype):
    """Three reads of the logits (max, shift-exp-sum, the backward's softmax) and one gradient write,
    in the logits' dtype; the fp32 chunk buffer is not counted (it stays in cache). The gather of
    the target logits reads one element per token: 1/V of a pass."""
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", 4 * V)
    per_logit = _traffic_per_logit(dtype)
    assert per_logit == pytest.approx(CROSS_ENTROPY_BYTES_PER_LOGIT[precision] + dtype.itemsize / V, rel=1e-12)
