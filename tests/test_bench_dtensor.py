"""The DTensor peer is seqpar's GPT: same dense weights give the same loss and gradients at t=2, for
every recompute mode; and its activation ledger shows what each recompute mode keeps."""
import re

import pytest
import torch

pytest.importorskip("torch.distributed.tensor.parallel")

from distributed_harness import rel_err, tp_group_of  # noqa: E402
from gpt_helpers import loss_and_dense_grads, mesh_for  # noqa: E402

SHAPE = dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)
MODES = ("none", "selective", "full")


def _dense_grads(model) -> dict[str, torch.Tensor]:
    """The peer's gradients under seqpar's dense names (q, k, v rows stacked into qkv). A collective."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        name = name.replace("_checkpoint_wrapped_module.", "")  # full recompute wraps each layer
        grads[re.sub(r"^layers\.", "blocks.", name)] = g
    for key in [k for k in grads if ".attn.q." in k]:
        grads[key.replace(".q.", ".qkv.")] = torch.cat([grads.pop(key.replace(".q.", f".{x}.")) for x in "qkv"])
    return grads


def _compare(rank, world):
    from seqpar.tools.bench.dtensor_peer import DTensorPeer
    from seqpar.tools.bench.peer import BenchShape
    from seqpar.model import GPT, GPTConfig

    group = tp_group_of(2)
    cfg = GPTConfig(**SHAPE, dropout=0.0, attention_dropout=0.0, sequence_parallel=True, recompute="none")
    ref = GPT(cfg, mesh_for(group), seed=0)
    dense = ref.dense_state_dict()
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["seq_len"]), generator=g) for _ in range(2))
    ref_loss, ref_grads = loss_and_dense_grads(ref, tokens, labels)

    out = {"ref_loss": float(ref_loss), "loss": {}, "saved": {}, "grad_err": {}}
    shape = BenchShape(**SHAPE, micro_batch=2)
    for mode in MODES:
        peer = DTensorPeer()
        peer.build(shape, dense, tp_group=group, tp_rank=rank, tp_size=2, recompute=mode)
        out["saved"][mode] = peer.saved_bytes_per_layer(tokens, labels)
        out["loss"][mode] = peer.step(tokens, labels)
        grads = _dense_grads(peer.model)
        out["grad_err"][mode] = max(rel_err(grads[k], ref_grads[k]) for k in ref_grads)
    peer = DTensorPeer()
    peer.build(shape, dense, tp_group=group, tp_rank=rank, tp_size=2, recompute="none", sequence_parallel=False)
    out["loss"]["no-sp"] = peer.step(tokens, labels)
    return out


def test_dtensor_peer_matches_seqpar_gpt(spawn):
    for out in spawn(_compare, 2):
        for mode, loss in out["loss"].items():
            assert abs(loss - out["ref_loss"]) <= 1e-5 * abs(out["ref_loss"]), (mode, loss, out["ref_loss"])
        for mode, err in out["grad_err"].items():
            assert err <= 1e-4, (mode, err)
        saved = out["saved"]
        assert all(v > 0 for v in saved.values()), saved
        assert saved["full"] < saved["selective"] < saved["none"], saved
