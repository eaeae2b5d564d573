"""The MoE layer's saved bytes against its formula, for the MoE tests."""
import torch

from seqpar.memory import ActivationLedger
from seqpar.memory.moe import moe_ffn_terms
from seqpar.memory.whole_model import layer_terms


def layer_gaps(model, tokens: torch.Tensor, *, t: int = 1, ep: int = 1, act: int = 4) -> list[int]:
    """Per layer: the bytes the ledger measures for one forward minus the formula's (the norms'
    small statistics, which the paper leaves out, not measured). Under ep the formula takes the
    rows that in fact reached this rank's experts."""
    cfg, (b, s) = model.config, tokens.shape
    with ActivationLedger(model) as ledger:
        model(tokens, tokens)
    gaps = []
    for i, block in enumerate(model.blocks):
        moe = type(block.mlp).__name__ == "MoE"
        dims = dict(s=s, b=b, t=t, act=act, device=tokens.device.type)
        predicted = sum(layer_terms(cfg, selective=True, moe=moe, **dims).values())
        if moe and ep > 1:  # the rows this rank's experts got, not the even share
            predicted += sum(moe_ffn_terms(cfg, ep=ep, received=block.mlp.received_rows, **dims).values())
            predicted -= sum(moe_ffn_terms(cfg, **dims).values())
        measured = sum(n for term, n in ledger.by_term(f"blocks.{i}").items() if "(small" not in term)
        gaps.append(measured - round(predicted))
    return gaps
