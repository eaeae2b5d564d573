"""Tiny randomly initialised Hugging Face models and helpers shared by the drop-in tests."""
import torch
import transformers

from seqpar.dropin import dense_state_dict

B, S, V = 2, 16, 64


def gpt2(seed=0, **kw):
    cfg = dict(vocab_size=V, n_positions=S, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
               attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager")
    cfg.update(kw)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg))


def llama(seed=0, **kw):
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=S, attn_implementation="eager", bos_token_id=0,
               eos_token_id=0)
    cfg.update(kw)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))


def batch(seed=0, length=S):
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(seed))


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def grads_of(model, parallel: bool) -> dict:
    """Gradients by parameter name, in the dense layout (gathered over TP for a parallel model)."""
    params = dict(model.named_parameters())
    if not parallel:
        return {n: p.grad.clone() for n, p in params.items()}
    saved = {n: p.data for n, p in params.items()}
    for p in params.values():
        p.data = p.grad
    full = dense_state_dict(model)
    for n, p in params.items():
        p.data = saved[n]
    return {n: full[n] for n in params}
