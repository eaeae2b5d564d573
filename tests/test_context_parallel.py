"""Context parallelism: the balanced layout, and attention over the whole sequence (fp64, exact)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from torch.utils.flop_counter import FlopCounterMode

from seqpar.distributed import count_comm
from seqpar.distributed.context import (
    ContextParallel, check_context_layout, context_chunks, context_positions, split_for_context,
)
from seqpar.model.context_attention import context_attention
from distributed_harness import run_ranks


def _reference(q, k, v):
    """Dense causal attention, GQA by repeating K/V heads: [s, b, a, d] -> [s, b, a*d]."""
    s, b, a, d = q.shape
    r = a // k.shape[2]
    kk, vv = (x.repeat_interleave(r, 2) for x in (k, v))
    scores = torch.einsum("ibhd,jbhd->bhij", q, kk) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhij,jbhd->ibhd", scores.softmax(-1), vv)
    return out.reshape(s, b, a * d)


def test_layout_balances_causal_work():
    for cp in (1, 2, 3, 4):
        seen = [sum(i + 1 for i in context_chunks(r, cp)) for r in range(cp)]  # key chunks per rank
        assert seen == [2 * cp + 1] * cp
        s = 8 * cp
        pos = torch.cat([context_positions(s, r, cp) for r in range(cp)])
        assert sorted(pos.tolist()) == list(range(s))  # every token on exactly one rank
    assert context_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert context_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    x = torch.arange(16).view(2, 8)
    assert split_for_context(x, 1, 2).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


def test_layout_errors_name_the_values():
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2 x cp = 8"):
        check_context_layout(12, 4)
    with pytest.raises(ValueError, match=r"12 / cp=2 = 6 tokens per CP rank is not divisible by t=4"):
        check_context_layout(12, 2, t=4, sequence_parallel=True)
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        check_context_layout(8, 0)


def _attention_worker(rank, world):
    torch.manual_seed(0)
    s, b, a, g, d = 8 * world, 2, 4, 2, 8
    q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64) for h in (a, g, g))
    dout = torch.randn(s, b, a * d, dtype=torch.float64)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = _reference(qr, kr, vr)
    ref.backward(dout)
    pos = context_positions(s, rank, world)
    errs, flops, calls = {}, {}, {}
    for comm in ("allgather", "ring"):
        for kernel in ("math", "sdpa"):  # sdpa: the CPU flash kernel, fp64 here
            cp = ContextParallel.of(dist.group.WORLD, comm, kernel)
            ql, kl, vl = (x[pos].clone().requires_grad_() for x in (q, k, v))
            with count_comm() as counter:
                with FlopCounterMode(display=False) as fc:
                    out = context_attention(ql, kl, vl, cp, 1 / math.sqrt(d))
                flops[comm, kernel] = fc.get_total_flops()
                out.backward(dout[pos])
            calls[comm, kernel] = counter.calls
            errs[comm, kernel] = max(float((out.detach() - ref[pos]).abs().max()),
                                     float((ql.grad - qr.grad[pos]).abs().max()),
                                     float((kl.grad - kr.grad[pos]).abs().max()),
                                     float((vl.grad - vr.grad[pos]).abs().max()))
    return errs, flops, calls


@pytest.mark.parametrize("world", [2, 4])
def test_attention_fp64_equals_unsplit(tmp_path, world):
    results = run_ranks(_attention_worker, world, tmp_path)
    for errs, _, calls in results:
        assert max(errs.values()) <= 1e-10, errs
        for kernel in ("math", "sdpa"):  # the kernel changes no exchange
            # forward one gather; backward one gather and one reduce-scatter of the K/V gradients
            assert calls["allgather", kernel] == {"all_gather": 2, "reduce_scatter": 1}
            # ring: cp-1 K/V steps forward, cp-1 again in backward plus cp gradient steps
            assert calls["ring", kernel] == {"send_recv": 3 * world - 2}
    for comm in ("allgather", "ring"):
        per_rank = [flops[comm, "math"] for _, flops, _ in results]
        c, b, a, d = 8 // 2, 2, 4, 8
        chunk_pair = 2 * 2 * b * a * c * c * d  # QK^T and PV of one (query chunk, key chunk) pair
        assert max(per_rank) - min(per_rank) <= chunk_pair, (comm, per_rank)
        assert min(per_rank) > 0


def test_model_attention_picks_the_block_kernel():
    from seqpar.model.context_kernels import Blocks
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kind = {(a, dev.type, dt): Blocks.of(a, 0.5, 2, dev, dt).kind
            for a in ("math", "sdpa") for dev in (cpu, cuda) for dt in (torch.float32, torch.float64)}
    assert kind == {("math", "cpu", torch.float32): "math", ("math", "cpu", torch.float64): "math",
                    ("math", "cuda", torch.float32): "math", ("math", "cuda", torch.float64): "math",
                    ("sdpa", "cpu", torch.float32): "cpu-flash", ("sdpa", "cpu", torch.float64): "cpu-flash",
                    ("sdpa", "cuda", torch.float32): "cuda-efficient", ("sdpa", "cuda", torch.float64): "math"}
    with pytest.raises(ValueError, match="model.attention must be 'math' or 'sdpa', got 'flash'"):
        ContextParallel.of(None, "ring", "flash")
