"""Context parallelism on CPU: per-rank saved activations and step time at a long sequence.

    python scripts/bench_context.py [--seq 8192] [--hidden 256] [--layers 2] [--steps 3]

Runs one GPT (fp32, selective recompute, SP when t > 1) on gloo ranks of this machine for each
layout: cp=1 x t=2 (the baseline), cp=2 x t=1 and cp=2 x t=2 (4 ranks), both K/V exchanges, and
prints a table: the bytes the forward keeps for backward on one rank (the activation ledger),
against the formula, and the median forward+backward time, each with its ratio to the baseline.
Timings on shared CPU cores are indicative only; the memory columns are exact.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

LAYOUTS = [(1, 2, "allgather"), (2, 1, "allgather"), (2, 1, "ring"), (2, 2, "allgather"), (2, 2, "ring")]


def _rank(rank: int, world: int, cp: int, tp: int, comm: str, args: dict) -> dict:
    import torch

    from seqpar.distributed.mesh import init_parallel
    from seqpar.memory.ledger import ActivationLedger
    from seqpar.memory.whole_model import model_activation_bytes
    from seqpar.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, seq_len=args["seq"], hidden=args["hidden"], heads=4, layers=args["layers"],
                    dropout=0.0, attention_dropout=0.0, recompute="selective", sequence_parallel=tp > 1)
    mesh = init_parallel(tp=tp, cp=cp, dp=1)
    model = GPT(cfg, mesh, seed=0, cp_comm=comm)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, cfg.seq_len), generator=g)
    labels = torch.randint(0, 256, (1, cfg.seq_len), generator=g)
    with ActivationLedger(model) as ledger:  # what the forward keeps for backward
        loss = model(tokens, labels)
    loss.backward()
    times = []
    for _ in range(args["steps"]):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        model(tokens, labels).backward()
        times.append(time.perf_counter() - t0)
    formula = model_activation_bytes(cfg, t=tp, micro_batch=1, activation_bytes=4, device="cpu", cp=cp)["total"]
    return {"saved": ledger.total(), "formula": formula, "seconds": statistics.median(times)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed forward+backward passes per layout (median)")
    args = vars(p.parse_args(argv))
    from seqpar.distributed.local import run_local

    rows = []
    for cp, tp, comm in LAYOUTS:
        print(f"running cp={cp} x t={tp} ({comm if cp > 1 else 'no exchange'}) ...", file=sys.stderr, flush=True)
        results = run_local(_rank, cp * tp, cp, tp, comm, args, timeout=3600)
        rows.append((cp, tp, comm, max(r["saved"] for r in results), results[0]["formula"],
                     max(r["seconds"] for r in results)))
    base_saved, base_time = rows[0][3], rows[0][5]
    print(f"s={args['seq']}, h={args['hidden']}, {args['layers']} layers, b=1, fp32, selective recompute\n")
    print("| layout | ranks | exchange | saved per rank | formula | vs cp=1 x t=2 | step (s) | vs cp=1 x t=2 |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for cp, tp, comm, saved, formula, seconds in rows:
        print(f"| cp={cp} x t={tp} | {cp * tp} | {comm if cp > 1 else '-'} | {saved / 2**20:.1f} MiB | "
              f"{formula / 2**20:.1f} MiB | {saved / base_saved:.2f} | {seconds:.2f} | {seconds / base_time:.2f} |")
    return 0


if __name__ == "__main__":  # guard needed: the ranks start from a fresh interpreter
    sys.exit(main(sys.argv[1:]))
