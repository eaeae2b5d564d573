"""``seqpar.plans``: ready :class:`~seqpar.dropin.Plan` s for Hugging Face ``transformers`` causal
LMs, for :func:`seqpar.parallelize` (``seqpar.plans.gpt2()``, ``seqpar.plans.llama()``).

Both follow the paper's layout per block: norm (sequence shard) -> column-parallel projections
(all-gather of the sequence fused in) -> attention on this rank's heads -> row-parallel output
projection (reduce-scatter back to the shard) -> residual add on the shard; the MLP likewise.
The embedding and the LM head are split by vocabulary; the head's logits are gathered so the
model's own loss runs unchanged. The sequence-sharded region runs from the first block's input
to the final norm's output, so position ids, causal masks and rotary tables are built for the
full sequence as usual (and q / k leave their column layers with the full sequence too).
"""
from __future__ import annotations

from .dropin.spec import KVHeads, Plan, Style


def gpt2() -> Plan:
    """For ``GPT2LMHeadModel``: ``c_attn`` is a fused ``[q; k; v]`` Conv1D, split per rank into
    ``[q_r; k_r; v_r]``; each attention module's ``num_heads`` and ``split_size`` become per-rank.
    Needs ``n_head``, ``n_embd``, ``n_inner`` and the vocabulary divisible by t (pad the
    vocabulary, e.g. ``resize_token_embeddings(50304)`` for the released 50257). The residual
    dropouts (``resid_pdrop``) run on sequence shards and the attention dropout (``attn_pdrop``)
    on this rank's heads, both drawn per TP rank; the embedding dropout (``embd_pdrop``) runs
    before the region on full tensors, from torch's default generator."""
    block = "transformer.h.*"
    return Plan(
        layers={
            "transformer.wte": "vocab",
            f"{block}.ln_1": "sequence",
            f"{block}.attn.c_attn": Style("column", chunks=3),
            f"{block}.attn.c_proj": "row",
            f"{block}.attn.resid_dropout": "sequence",  # on the shard c_proj reduce-scatters to
            f"{block}.ln_2": "sequence",
            f"{block}.mlp.c_fc": "column",
            f"{block}.mlp.c_proj": "row",
            f"{block}.mlp.dropout": "sequence",
            "transformer.ln_f": "sequence",
            "lm_head": "vocab",
        },
        heads={f"{block}.attn": ("num_heads", "split_size")},
        divisible=("n_head",),
        sp_start="transformer.h.0",
        sp_end="transformer.ln_f",
        seq_dim=1,  # hidden states [b, s, h]
    )


def llama() -> Plan:
    """For ``LlamaForCausalLM``: q / k / v / gate / up column-parallel, o / down row-parallel,
    RMSNorms on sequence shards. The attention module reshapes by its input's shape, so it is
    entered with the full sequence (``enter_tp``: one all-gather shared by q, k and v, one
    reduce-scatter of their summed input gradients). Grouped-query attention splits the key/value
    heads too: ``num_attention_heads`` must be divisible by t, and t must divide
    ``num_key_value_heads`` or be a multiple of it (then each key/value head is held by the
    ``t/g`` ranks whose query heads use it, and ``num_key_value_groups`` becomes ``a/t``; its
    gradient is summed over those ranks in backward). The rotary embedding stays replicated:
    it is computed once per step for the full sequence and applied after the column layers'
    all-gather. Per-rank head attributes that some ``transformers`` releases keep on the module
    (``num_heads``, ``num_key_value_heads``, ``hidden_size``) are divided where present. The
    attention dropout (``attention_dropout``) runs on this rank's heads and draws per TP rank."""
    block = "model.layers.*"
    return Plan(
        layers={
            "model.embed_tokens": "vocab",
            f"{block}.input_layernorm": "sequence",
            f"{block}.self_attn": "enter_tp",
            f"{block}.self_attn.q_proj": "column",
            f"{block}.self_attn.k_proj": "column",
            f"{block}.self_attn.v_proj": "column",
            f"{block}.self_attn.o_proj": "row",
            f"{block}.post_attention_layernorm": "sequence",
            f"{block}.mlp.gate_proj": "column",
            f"{block}.mlp.up_proj": "column",
            f"{block}.mlp.down_proj": "row",
            "model.norm": "sequence",
            "lm_head": "vocab",
        },
        heads={f"{block}.self_attn": ("num_heads", "hidden_size")},
        divisible=("num_attention_heads",),
        kv=KVHeads("num_key_value_heads", (f"{block}.self_attn.k_proj", f"{block}.self_attn.v_proj"),
                   heads={f"{block}.self_attn": ("num_key_value_heads",)},
                   groups={f"{block}.self_attn": ("num_key_value_groups",)}),
        sp_start="model.layers.0",
        sp_end="model.norm",
        seq_dim=1,  # hidden states [b, s, h]
    )


__all__ = ["gpt2", "llama"]
