"""Megatron-LM core as a benchmark peer: loaded from seqpar's dense weights it computes the same
losses as seqpar's GPT (step 0, and after one AdamW step) under every recompute mode, and
selective recomputation keeps less for backward than none. Its CPU patches hold only inside its
own calls: afterwards torch and Megatron are their original selves."""
import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from distributed_harness import tp_group_of  # noqa: E402
from gpt_helpers import batch, mesh_for  # noqa: E402
from seqpar.tools.bench.peer import BenchShape  # noqa: E402
from seqpar.model import GPT, GPTConfig  # noqa: E402

SHAPE = BenchShape(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2, micro_batch=2)
MODES = ("none", "selective", "full")


def _seqpar_two_steps(model, tokens, labels):
    """Losses before and after one AdamW step (the peer's optimizer) on seqpar's GPT."""
    from seqpar.distributed import sync_sp_replicated_grads

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    first = model(tokens, labels)
    first.backward()
    sync_sp_replicated_grads(model, model.tp_group)
    opt.step()
    with torch.no_grad():
        return first.detach(), model(tokens, labels)


def _patchable() -> dict[str, tuple[object, str]]:
    """Every attribute the Megatron adapter patches: the known ones and whatever it lists."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from seqpar.tools.bench.megatron_peer import patch_targets

    known = [(torch.cuda, "current_device"), (mrandom, "_get_cuda_rng_state"), (mrandom, "_set_cuda_rng_state"),
             (mrandom.CudaRNGStatesTracker, "add"), (WrappedTorchNorm, "__new__")]
    listed = [(owner, name) for owner, name, _ in patch_targets(cpu=True)]
    return {f"{getattr(o, '__name__', o)}.{n}": (o, n) for o, n in known + listed}


def _originals() -> dict[str, object]:
    return {key: vars(owner).get(name) for key, (owner, name) in _patchable().items()}


def _changed(before: dict[str, object]) -> list[str]:
    """The attributes that are no longer the very objects recorded in ``before``."""
    now = _originals()
    return sorted(k for k in before if now[k] is not before[k])


def _compare(rank, world_size):
    import warnings

    warnings.filterwarnings("ignore")
    from seqpar.tools.bench.megatron_peer import MegatronPeer

    originals = _originals()
    group = tp_group_of(world_size)
    cfg = GPTConfig(vocab_size=SHAPE.vocab_size, seq_len=SHAPE.seq_len, hidden=SHAPE.hidden, heads=SHAPE.heads,
                    layers=SHAPE.layers, dropout=0.0, attention_dropout=0.0, sequence_parallel=True,
                    recompute="none")
    model = GPT(cfg, mesh_for(group), seed=3)
    tokens, labels = batch(cfg, b=SHAPE.micro_batch, seed=1)
    dense = model.dense_state_dict()
    out = {"seqpar": [float(l) for l in _seqpar_two_steps(model, tokens, labels)]}
    for mode in MODES:
        peer = MegatronPeer()
        peer.build(SHAPE, dense, tp_group=group, tp_rank=rank, tp_size=world_size, recompute=mode)
        saved = peer.saved_bytes_per_layer(tokens, labels)
        first = peer.step(tokens, labels)
        second = peer.step(tokens, labels)
        out[mode] = (first, second, saved)
    out["changed"] = _changed(originals)  # after build, probe and steps: nothing left patched
    # seqpar bench --moe: Megatron-core's MoELayer with seqpar's MoE weights computes the same (t = 1)
    from seqpar.tools.bench.moe_bench import bench_rank
    moe = bench_rank(rank, world_size, dict(seq=8, batch=2, hidden=16, ffn=16, experts=4, top_k=2), 1, 0)
    out["moe"] = moe["output_diff"] < 1e-5 and moe["input_grad_diff"] < 1e-5
    return out


def test_megatron_matches_seqpar_losses_and_saves_less_with_selective(spawn):
    results = spawn(_compare, 2)
    for r in results:
        ref0, ref1 = r["seqpar"]
        for mode in MODES:
            first, second, _ = r[mode]
            assert abs(first - ref0) <= 1e-5 * abs(ref0), f"{mode}: step-0 loss megatron {first} vs seqpar {ref0}"
            # after one AdamW step: fails if the SP-partial grads (norms, row-parallel biases) are not summed
            assert abs(second - ref1) <= 1e-5 * abs(ref1), f"{mode}: step-1 loss megatron {second} vs seqpar {ref1}"
        saved = {m: r[m][2] for m in MODES}
        assert all(v > 0 for v in saved.values()), saved
        assert saved["selective"] < saved["none"], saved
    assert results[0]["changed"] == [], f"left patched after a Megatron run: {results[0]['changed']}"
    assert results[0]["moe"], "Megatron-core's MoELayer disagrees with seqpar's MoE on the same weights"
    assert results[0] == results[1]  # losses and ledger identical on both TP ranks


def test_patches_hold_only_inside_their_block_even_on_error():
    from seqpar.tools.bench.megatron_peer import megatron_patches

    before = _originals()
    with pytest.raises(RuntimeError, match="inside"):
        with megatron_patches(cpu=True):
            assert torch.cuda.current_device() == torch.device("cpu")
            assert _changed(before) == sorted(before)  # every attribute is replaced inside
            with megatron_patches(cpu=True):
                pass
            assert _changed(before) == sorted(before)  # a nested block restores the outer patches
            raise RuntimeError("inside")
    assert _changed(before) == []
