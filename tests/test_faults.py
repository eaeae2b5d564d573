"""Bad values are refused where they enter, naming the offending value."""
import pytest
import torch

from seqpar.layers import vocab_parallel_cross_entropy
from seqpar.model import GPT, GPTConfig


@pytest.mark.parametrize("bad", [300, 60000, -1, -7])
def test_cross_entropy_refuses_labels_outside_the_vocabulary(bad):
    logits = torch.randn(2, 3, 300)
    targets = torch.tensor([[1, 2, bad], [-100, 299, 0]])
    with pytest.raises(ValueError, match=rf"target id {bad} is outside the vocabulary \[0, 300\)"):
        vocab_parallel_cross_entropy(logits, targets, tp_group=None)
    targets[0, 2] = -100  # ignored positions and the edges of the vocabulary are fine
    loss = vocab_parallel_cross_entropy(logits, targets, tp_group=None)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), targets.reshape(-1))
    torch.testing.assert_close(loss, ref)


def test_gpt_loss_refuses_labels_outside_the_vocabulary():
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=1))
    tokens = torch.zeros(1, 8, dtype=torch.long)
    labels = torch.full((1, 8), 5)
    labels[0, 3] = 32
    with pytest.raises(ValueError, match=r"target id 32 .*\[0, 32\)"):
        model(tokens, labels)
