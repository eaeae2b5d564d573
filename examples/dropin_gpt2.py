"""Tensor + sequence parallelism and selective recomputation for a Hugging Face GPT-2, unchanged.

    torchrun --nproc-per-node 2 examples/dropin_gpt2.py

Every rank builds the same randomly initialised GPT-2 (nothing is downloaded), keeps an
untouched copy as the reference, parallelizes the other over all ranks, and trains both for a
few AdamW steps on the same batch. Rank 0 prints both loss curves; they agree to float rounding.
"""
import copy
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import seqpar
from seqpar.dropin import checkpoint_attention, dense_state_dict

STEPS, BATCH, SEQ = 5, 4, 64


def train(model: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # the model's own loss
        loss.backward()  # norm gradients are summed over the TP group inside backward
        opt.step()
        losses.append(loss.item())
    return losses


def run(mesh: seqpar.ParallelMesh) -> dict:
    torch.manual_seed(0)  # the same weights and batch on every rank
    config = GPT2Config(vocab_size=512, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                        eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager")
    reference = GPT2LMHeadModel(config).to(mesh.device)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ)).to(mesh.device)

    model = seqpar.parallelize(copy.deepcopy(reference), seqpar.plans.gpt2(), mesh, sequence_parallel=True)
    checkpoint_attention(model)  # backward recomputes only QK^T, softmax, dropout, attention over V

    losses, ref_losses = train(model, ids), train(reference, ids)
    with torch.no_grad():
        final = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
        saved = GPT2LMHeadModel(config).to(mesh.device)  # a plain, unparallelized model from the gathered weights
        saved.load_state_dict(dense_state_dict(model))  # dense_state_dict is a collective: every rank calls it
        reloaded = saved(input_ids=ids, labels=ids, use_cache=False).loss.item()
    if mesh.is_first:
        print(f"GPT-2 on t={mesh.tp_size} ranks, sequence parallel, selective recompute")
        print(model.transformer.h[0].attn.c_attn)
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            print(f"step {step}: seqpar loss {a:.6f}   unparallelized loss {b:.6f}")
        print(f"max |loss difference| {max(abs(a - b) for a, b in zip(losses, ref_losses)):.2e}")
        print(f"after training: seqpar loss {final:.6f}, same weights reloaded unparallelized {reloaded:.6f}")
    return dict(losses=losses, ref_losses=ref_losses, final=final, reloaded=reloaded)


def main() -> None:
    mesh = seqpar.init_parallel(tp=int(os.environ.get("WORLD_SIZE", "1")))  # all ranks in one TP group
    run(mesh)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
