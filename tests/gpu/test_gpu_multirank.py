"""Every multi-rank path on two ranks of one device: t=2 SP, dp=2 DDP and FSDP2, pp=2, cp=2
(all-gather and ring), t=2 SP with tp_overlap and, on CUDA, t=2 SP and FSDP2 with compiled blocks,
each within 1e-4 of t=1 on the same device; SP dropout streams per TP rank under recompute; on
CUDA the pipeline step with chunk timing off no slower than on. The ranks: multirank_ranks.py."""
import torch
import torch.distributed as dist

from seqpar.distributed import ParallelMesh
from seqpar.distributed.local import run_local

from .helpers import max_rel
from .multirank_ranks import CASES, STEPS, multirank_rank
from .staging import Staged, host_staged_p2p
from .trainer_runs import run_config, train_losses


def _record_cases(record_row, results: dict, reference: list[float], where: str) -> None:
    for name, (*layout, _) in CASES.items():
        if name not in results:  # a CUDA-only case of the CPU smoke
            continue
        r, what = results[name], f"2 ranks ({where}): {name} vs t=1, {STEPS} steps fp32"
        if "error" in r:
            record_row(what, r["error"], "< 1e-04", False)
            continue
        err = max_rel(r["losses"], reference)
        record_row(what, f"max loss rel diff {err:.2e} (tp, dp, pp, cp = {r['layout']} on {r['device']})", "< 1e-04",
                   err < 1e-4 and r["layout"] == list(layout))


def _record_sp_dropout(record_row, sp: dict, where: str) -> None:
    if "error" in sp:
        record_row(f"2 ranks ({where}): t=2 SP dropout streams", sp["error"], "no error", False)
        return
    for mode, same in sp["same"].items():
        record_row(f"2 ranks ({where}): t=2 SP dropout 0.1, recompute {mode} vs none",
                   "bit-identical" if same else "differ", "bit-identical", same)
    record_row(f"2 ranks ({where}): SP dropout streams per TP rank",
               f"tp streams differ {sp['tp_differ']}, replicated equal {sp['replicated_equal']}", "differ, equal",
               sp["tp_differ"] and sp["replicated_equal"])


def test_multirank(device, shapes, record_row, tmp_path):
    """One run_local of two ranks (on CUDA both on cuda:0 over gloo), compared with this process's t=1."""
    reference = train_losses(run_config(tmp_path, shapes, "t1", []), ParallelMesh.single(device), STEPS)
    results = run_local(multirank_rank, 2, device, str(tmp_path), timeout=2 * shapes.timeout_s,
                        collective_timeout=180, tmp_dir=tmp_path, gpus=device == "cuda")[0]
    where = "both on cuda:0, gloo" if device == "cuda" else "gloo"
    _record_cases(record_row, results, reference, where)
    _record_sp_dropout(record_row, results["sp dropout"], where)
    timing = results["pp timing"]
    if timing is None:  # the CPU smoke: no CUDA timing
        return
    if "error" in timing:
        record_row("pp=2 step time, chunk timing off / on", timing["error"], "<= 1.05", False)
    else:
        ratio = timing["off"] / timing["on"]
        record_row("pp=2 step time, chunk timing off / on",
                   f"{timing['off'] * 1e3:.1f} / {timing['on'] * 1e3:.1f} ms = {ratio:.3f}", "<= 1.05", ratio <= 1.05)


def test_host_staged_p2p_passes_cpu_tensors_through_and_restores_torch():
    """The pipeline's send/recv staging (gloo has no CUDA send/recv) is a no-op for CPU tensors and
    leaves torch.distributed as it found it."""
    before = (dist.isend, dist.irecv, dist.distributed_c10d.isend, dist.distributed_c10d.irecv)
    with host_staged_p2p():
        assert dist.isend is dist.distributed_c10d.isend is not before[0]
    assert (dist.isend, dist.irecv, dist.distributed_c10d.isend, dist.distributed_c10d.irecv) == before
    host, target = torch.arange(4.0), torch.zeros(4)
    staged = Staged(None, host, target)  # a received buffer lands in its tensor on wait()
    assert staged.wait() and torch.equal(target, host)
