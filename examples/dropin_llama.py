"""A Hugging Face Llama (grouped-query attention) with tensor + sequence parallelism and selective
recomputation: train, save, reload unparallelized and parallelized, generate with a KV cache.

    torchrun --nproc-per-node 2 examples/dropin_llama.py [OUTPUT_DIR]

Every rank builds the same randomly initialised Llama (nothing is downloaded) and keeps an
untouched copy; both train for a few AdamW steps on the same batch. The parallelized model is
then saved as a plain Hugging Face checkpoint (``OUTPUT_DIR``, default ``dropin-llama-checkpoint``)
that loads unparallelized with ``from_pretrained`` and parallelized again with ``load_pretrained``,
and generates greedily with sequence parallelism switched off (one token per step).
"""
from __future__ import annotations

import copy
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import seqpar
from seqpar.dropin import checkpoint_attention, load_pretrained, save_pretrained, set_sequence_parallel

STEPS, BATCH, SEQ, NEW_TOKENS = 5, 4, 64, 8


def train(model: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # the model's own loss
        loss.backward()  # norm gradients are summed over the TP group inside backward: no extra call
        opt.step()
        losses.append(loss.item())
    return losses


def run(mesh: seqpar.ParallelMesh, out_dir: str) -> dict:
    torch.manual_seed(0)  # the same weights and batch on every rank
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager")
    reference = LlamaForCausalLM(config).to(mesh.device)
    ids = torch.randint(1, config.vocab_size, (BATCH, SEQ)).to(mesh.device)

    model = seqpar.parallelize(copy.deepcopy(reference), seqpar.plans.llama(), mesh, sequence_parallel=True)
    checkpoint_attention(model)  # backward recomputes only QK^T, softmax, dropout, attention over V
    losses, ref_losses = train(model, ids), train(reference, ids)

    save_pretrained(model, out_dir)  # a collective: every rank gathers, rank 0 writes weights + config
    plain = LlamaForCausalLM.from_pretrained(out_dir).to(mesh.device)  # unparallelized
    again = load_pretrained(LlamaForCausalLM, out_dir, seqpar.plans.llama(), mesh)  # parallelized again
    with torch.no_grad():
        final, reloaded, reparallelized = (m(input_ids=ids, labels=ids, use_cache=False).loss.item()
                                           for m in (model, plain, again))

    prompt = ids[:2, :5]  # 5 tokens, then one per step: not divisible by t, so SP goes off for generation
    set_sequence_parallel(model, False)
    tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    set_sequence_parallel(model, True)  # back to sequence-parallel training
    ref_tokens = plain.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    same_tokens = torch.equal(tokens, ref_tokens)
    if mesh.is_first:
        print(f"Llama (4 query heads, 2 key/value heads) on t={mesh.tp_size} ranks, sequence parallel, "
              f"selective recompute")
        print(model.model.layers[0].self_attn.k_proj)
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            print(f"step {step}: seqpar loss {a:.6f}   unparallelized loss {b:.6f}")
        print(f"max |loss difference| {max(abs(a - b) for a, b in zip(losses, ref_losses)):.2e}")
        print(f"saved to {out_dir}: seqpar loss {final:.6f}, reloaded unparallelized {reloaded:.6f}, "
              f"reloaded parallelized {reparallelized:.6f}")
        print(f"greedy generation, KV cache, sequence parallelism off: {tokens[0, 5:].tolist()} "
              f"(unparallelized: {'the same' if same_tokens else ref_tokens[0, 5:].tolist()})")
    return dict(losses=losses, ref_losses=ref_losses, final=final, reloaded=reloaded,
                reparallelized=reparallelized, same_tokens=same_tokens)


def main() -> None:
    mesh = seqpar.init_parallel(tp=int(os.environ.get("WORLD_SIZE", "1")))  # all ranks in one TP group
    run(mesh, sys.argv[1] if len(sys.argv) > 1 else "dropin-llama-checkpoint")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
