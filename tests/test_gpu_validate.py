"""scripts/gpu_validate.py: its CPU smoke mode passes every check it can run, and its reference
model is independent of seqpar (a perturbed dense weight makes the correctness check fail)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_validate.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> dict[str, str]:
    """Run the script; return its table as {check: result}, after asserting it exited 0."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + "\n" + proc.stderr[-4000:]
    cells = [line.strip("|").split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ")]
    return {c[0].strip(): c[-1].strip() for c in cells[1:] if len(c) == 4}


def _results(table: dict[str, str], prefix: str) -> list[str]:
    return [result for check, result in table.items() if check.startswith(prefix)]


def test_cpu_smoke_run_lists_every_check_with_pass():
    table = _run()
    asserted = [f"correctness t=1 {dtype} {attention}: {what}" for dtype, what in
                (("float32", "loss rel err"), ("float32", "grad max rel err"), ("bfloat16", "loss rel err"),
                 ("bfloat16", "min grad cosine")) for attention in ("math", "sdpa")]
    asserted += ["rng: dropout active", "rng: none repeated", "rng: selective vs none", "rng: full vs none"]
    asserted += [f"memory {mode}: ledger per layer" for mode in ("none", "selective", "full")]
    asserted += ["throughput activation bytes (ledger) none > selective > full",
                 "launcher (gloo): 10 steps", "launcher (gloo): resume to 12 steps"]
    asserted += [f"sdpa attention dropout {p} under selective recompute" for p in (0.1, 0.125)]
    asserted += ["resume at 10 (dropout 0.1): steps 11-12 vs uninterrupted", "bf16-autocast vs fp32",
                 "trainer prints its activation and state lines"]
    asserted += [f"2 ranks (gloo): {case} vs t=1" for case in ("t=2 SP", "dp=2 DDP", "dp=2 FSDP2", "pp=2",
                                                               "cp=2 all-gather", "cp=2 ring", "t=2 SP tp_overlap")]
    asserted += [f"2 ranks (gloo): t=2 SP dropout 0.1, recompute {m} vs none" for m in ("selective", "full")]
    asserted += ["2 ranks (gloo): SP dropout streams per TP rank"]
    for prefix in asserted:
        assert _results(table, prefix) == ["PASS"], (prefix, table)
    # what only a GPU measures is listed, and said to be skipped or shown unasserted
    for mode in ("none", "selective", "full"):
        assert _results(table, f"memory {mode}: memory_allocated") == ["SKIP"], table
        assert table[f"throughput {mode}"] == "INFO", table
    assert _results(table, "throughput selective / none (tiny CPU run") == ["INFO"], table
    for gpu_only in ("resume a CUDA checkpoint on the CPU", "host syncs in a non-logging step",
                     "trainer memory line per logging step", "pp=2 step time, chunk timing off / on",
                     "2 ranks (gloo): t=2 SP compiled vs t=1, 4 steps fp32",
                     "2 ranks (gloo): dp=2 FSDP2 compiled vs t=1, 4 steps fp32"):
        assert table[gpu_only] == "SKIP", (gpu_only, table)
    assert _results(table, "async save() returns / sync save (tiny CPU model") == ["INFO"], table
    assert "FAIL" not in table.values()


def test_host_staged_p2p_passes_cpu_tensors_through_and_restores_torch():
    """The pipeline's send/recv staging (gloo has no CUDA send/recv) is a no-op for CPU tensors and
    leaves torch.distributed as it found it."""
    import torch.distributed as dist
    _script()
    import gpu_multirank
    before = (dist.isend, dist.irecv, dist.distributed_c10d.isend, dist.distributed_c10d.irecv)
    with gpu_multirank.host_staged_p2p():
        assert dist.isend is dist.distributed_c10d.isend is not before[0]
    assert (dist.isend, dist.irecv, dist.distributed_c10d.isend, dist.distributed_c10d.irecv) == before
    import torch
    host, target = torch.arange(4.0), torch.zeros(4)
    staged = gpu_multirank._Staged(None, host, target)  # a received buffer lands in its tensor on wait()
    assert staged.wait() and torch.equal(target, host)


def test_tp_check_runs_on_two_gloo_ranks():
    table = _run("--tp", "2", "--checks", "tp")
    assert len(table) == 8 and set(table.values()) == {"PASS"}, table
    assert all(check.startswith("correctness t=2 SP") for check in table), table


def test_reference_is_independent_a_perturbed_weight_fails():
    gv = _script()
    shapes = gv.Shapes.for_device("cpu")

    def perturb(dense):
        dense["blocks.0.attn.qkv.weight"][0, 0] += 0.1  # one entry of one query row

    rows = gv.check_correctness("cpu", shapes, perturb=perturb)
    fp32 = {r.check: r.result for r in rows if "float32" in r.check}
    assert fp32 and all(result == "FAIL" for check, result in fp32.items() if "grad" in check), fp32
    # the same call without the perturbation passes: the failure is the perturbation's
    assert {r.result for r in gv.check_correctness("cpu", shapes)} == {"PASS"}


def test_host_sync_count_ignores_the_debug_modes_own_notice():
    """Under set_sync_debug_mode("warn") torch first warns that the mode is a prototype; that notice
    mentions synchronization but is no sync (the H200 run counted it: 2 where one step has 1)."""
    sys.path.insert(0, str(SCRIPT.parent))
    from gpu_common import host_syncs
    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    sync = "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:163.)"
    assert host_syncs([notice, sync]) == [sync[:80]]
    assert host_syncs([notice]) == []


def test_selective_bound_is_the_extra_time_over_the_attention_core_replays():
    sys.path.insert(0, str(SCRIPT.parent))
    from gpu_throughput import selective_bound
    res = {"none": {"step_s": 0.2}, "selective": {"step_s": 0.25}}
    ratio, replay = selective_bound(res, core_s=0.002, layers=24)
    assert abs(replay - 0.048) < 1e-12 and abs(ratio - 0.05 / 0.048) < 1e-9
