"""Hugging Face reference runs for the interop tests: a batch in HF's label convention and HF's own
logits, loss and gradients converted to seqpar's dense layout."""
import copy

import torch


def shifted_batch(vocab: int, b: int, s: int, seed: int = 1):
    """Token ids and the next-token labels seqpar expects (HF models shift the labels inside)."""
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))
    return ids, torch.cat([ids[:, 1:], torch.full((b, 1), -100)], 1)


def hf_reference(hf, ids, from_hf):
    """HF logits, loss and gradients on ``ids``, the gradients in seqpar's dense layout (``from_hf``
    converts a model whose parameters hold the gradients)."""
    out = hf(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    as_grads = copy.deepcopy(hf)
    for p, q in zip(as_grads.parameters(), hf.parameters()):
        p.data = q.grad
    return out.logits.detach(), out.loss.detach(), from_hf(as_grads)[1]


def perturb(model, touched, scale: float) -> None:
    """Add noise to the parameters named ``touched(name)`` (norms and biases start at constants; the
    comparisons need every tensor to matter)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if touched(name):
                p.add_(scale * torch.randn_like(p))
