"""The Trainer's activation probe under FSDP2: what it counts are activations, not weights.

FSDP2 gathers a unit's parameters before its forward and frees them after it; the ledger must not
take an activation that reuses a freed copy's address for a weight (it undercounted by a few
activations), and on CUDA the root's gathered parameters, which stay allocated from its forward to
its backward, must not be counted as activations."""
import torch

from seqpar.memory.params import root_params

CFG = dict(vocab_size=512, seq_len=64, hidden=64, heads=4, layers=2, dropout=0.0, attention_dropout=0.0,
           recompute="none", sequence_parallel=False)


def _probe(rank, world, mode):
    from seqpar.distributed import init_parallel
    from seqpar.memory.probe import ActivationProbe, new_weight_bytes, weight_storages
    from seqpar.model import GPT
    from seqpar.model.config import GPTConfig
    from seqpar.parallel.data_parallel import DataParallel

    mesh = init_parallel(tp=1, backend="gloo")
    model = GPT(GPTConfig(**CFG), mesh, seed=0)
    dp = DataParallel(model, mesh, mode)
    probe = ActivationProbe(model, mesh.device)
    tokens = torch.randint(0, CFG["vocab_size"], (2, CFG["seq_len"]), generator=torch.Generator().manual_seed(rank))
    before = weight_storages(model)
    with probe.measure():
        loss = dp.module(tokens, tokens)
    gathered = new_weight_bytes(model, before)  # what the CUDA path subtracts from the allocator's growth
    loss.backward()
    return probe.measured, gathered


def test_fsdp_activations_are_measured_as_under_ddp(spawn):
    from seqpar.model.config import GPTConfig
    ddp = spawn(_probe, 2, "ddp")
    fsdp = spawn(_probe, 2, "fsdp")
    for (a, gathered_ddp), (b, gathered_fsdp) in zip(ddp, fsdp):
        assert a == b > 0  # the same saved tensors whichever way dp shares the state
        assert gathered_ddp == 0
        assert gathered_fsdp == 4 * root_params(GPTConfig(**CFG), 1)  # the root, gathered (fp32)
