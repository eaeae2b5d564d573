"""The side-by-side benchmark (scripts/bench/side_by_side.py): its plain-PyTorch peer is seqpar's GPT
(same parameters, FLOPs and loss), and its CPU smoke run writes a JSON line per cell and the table."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from gpt_helpers import batch
from seqpar import flops
from seqpar.distributed import ParallelMesh
from seqpar.errors import UserError
from seqpar.model import GPT
from seqpar.tools.bench import sbs_table
from seqpar.tools.bench.peer import BenchShape
from seqpar.tools.bench.plain_peer import UserGPT
from seqpar.tools.bench.sbs_systems import model_config
from seqpar.tools.bench.side_by_side import SHAPES, Cell, Options, grid, read_rows, run, select

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "side_by_side.py"
SHAPE = BenchShape(vocab_size=96, seq_len=16, hidden=32, heads=4, layers=2, micro_batch=2)


def _script():
    spec = importlib.util.spec_from_file_location("side_by_side_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plain_peer_equals_seqpars_gpt_in_loss_parameters_and_flops():
    cfg = model_config(SHAPE)  # fp32, dropout 0, t = 1
    seqpar_gpt = GPT(cfg, ParallelMesh.single(), seed=0)
    plain = UserGPT(SHAPE)
    plain.load_dense(seqpar_gpt.dense_state_dict())
    tokens, labels = batch(cfg)
    assert abs(plain(tokens, labels).item() - seqpar_gpt(tokens, labels).item()) < 1e-5
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in seqpar_gpt.parameters())
    # the FLOPs the table charges both: every matmul of the plain model, counted as it runs (SDPA's
    # math kernel, whose matmuls the counter sees: the full s x s scores, as the paper counts them)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        plain(tokens, labels).backward()
    counted = counter.get_total_flops()
    assert counted == flops.step_model_flops(cfg, sequences=tokens.shape[0])


def test_plain_peer_refuses_what_a_user_does_not_write():
    with pytest.raises(ValueError, match="recomputes"):
        UserGPT(SHAPE, recompute="selective")


def test_cells_select_by_pattern_and_by_full_name():
    cells = grid()
    names = [c.name for c in cells]
    assert len(names) == len(set(names)) and "seqpar/compiled/sdpa/selective" in names
    assert {c.system for c in select(cells, ["plain/*"])} == {"plain"}
    assert [c.name for c in select(cells, ["plain/eager/math/none"])] == ["plain/eager/math/none"]  # not in the grid
    with pytest.raises(UserError, match="matches no cell"):
        select(cells, ["deepspeed/*"])
    with pytest.raises(UserError, match="system/eager"):
        Cell.parse("seqpar/fast/sdpa/none")


def test_cells_not_started_after_the_time_budget_are_rows_that_say_so(tmp_path):
    out = tmp_path / "rows.jsonl"
    rows = run(select(grid(), ["plain/eager/sdpa/none", "plain/eager/sdpa/full"]), "tiny", out, torch.device("cpu"),
               Options(steps=1, warmup=1, profile_steps=0, time_budget_s=0.0), log=lambda line: None)
    assert [r["status"] for r in rows] == ["ok", "budget"]  # the first starts at 0 s
    assert read_rows(out) == rows
    text = sbs_table.markdown(rows)
    assert "The time budget was spent: 1 cells were not started" in text
    assert "| plain/eager/sdpa/full | budget: not started" in text


def test_a_torn_last_line_of_a_stopped_run_is_dropped(tmp_path):
    out = tmp_path / "rows.jsonl"
    out.write_text(json.dumps({"cell": "a", "status": "ok"}) + "\n" + '{"cell": "b", "sta')
    assert read_rows(out) == [{"cell": "a", "status": "ok"}]


def test_megatron_cells_are_skipped_with_the_reason_when_it_does_not_import(monkeypatch, tmp_path):
    import builtins
    real_import = builtins.__import__

    def no_megatron(name, *args, **kwargs):
        if name.startswith("megatron"):
            raise ImportError("No module named 'megatron'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_megatron)
    rows = run([Cell("megatron-core", False, "math", "none")], "tiny", tmp_path / "m.jsonl", torch.device("cpu"),
               Options(steps=1, warmup=1, profile_steps=0), log=lambda line: None)
    assert rows[0]["status"] == "skipped" and "megatron.core does not import" in rows[0]["reason"]


def test_cpu_smoke_writes_a_row_per_cell_and_the_table(tmp_path, capsys):
    out = tmp_path / "sbs.jsonl"
    cells = ["seqpar/eager/math/selective", "plain/eager/sdpa/none", "plain/compiled/sdpa/none",
             "trainer/eager/sdpa/selective", "plain/eager/math/none"]
    rc = _script().main(["--shape", "tiny", "--out", str(out), "--steps", "2", "--warmup", "1",
                         "--compile-backend", "eager", "--cells", ",".join(cells)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {r["cell"]: r for r in rows}
    assert sorted(by) == sorted(cells)
    assert by["plain/eager/math/none"]["status"] == "error"  # the plain peer's attention is SDPA
    assert "scaled_dot_product_attention" in by["plain/eager/math/none"]["error"]
    shape, _ = SHAPES["tiny"]
    for name in cells[:4]:
        r = by[name]
        assert r["status"] == "ok", r
        assert len(r["step_s_all"]) == 2 and r["tokens_per_s"] == pytest.approx(
            shape.micro_batch * shape.seq_len / r["step_s"])
        assert r["model_flops"] == flops.step_model_flops(model_config(shape), sequences=shape.micro_batch)
        assert len(r["top_ops"]) == 5 and all(o["ms_per_step"] > 0 for o in r["top_ops"])
    assert by["seqpar/eager/math/selective"]["hardware_flops"] > by["plain/eager/sdpa/none"]["hardware_flops"]
    assert by["plain/compiled/sdpa/none"]["compile_s"] > 0 and by["plain/eager/sdpa/none"]["compile_s"] is None
    table = (tmp_path / "sbs.md").read_text()
    assert table in capsys.readouterr().out
    assert "| plain/eager/sdpa/none | " in table and " | 1.00x | " in table  # the baseline's own ratio
    line = next(x for x in table.splitlines() if x.startswith("| seqpar/eager/math/selective |"))
    ratio = by["seqpar/eager/math/selective"]["tokens_per_s"] / by["plain/eager/sdpa/none"]["tokens_per_s"]
    assert f" | {ratio:.2f}x | " in line
    assert "| plain/eager/math/none | error: ValueError" in table
    assert "not halved for the causal mask" in table
    again = tmp_path / "again.md"
    assert _script().main(["--table-only", "--out", str(out), "--table", str(again)]) == 0
    assert again.read_text().split("| cell (")[1] == table.split("| cell (")[1]


def test_a_megatron_cell_runs_on_a_one_rank_world_and_leaves_none(tmp_path):
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    rows = run([Cell("megatron-core", False, "math", "selective")], "tiny", tmp_path / "m.jsonl",
               torch.device("cpu"), Options(steps=1, warmup=1, profile_steps=0), log=lambda line: None)
    assert rows[0]["status"] == "ok", rows[0]
    assert rows[0]["hardware_flops"] > rows[0]["model_flops"]  # selective re-runs the attention core
    assert not dist.is_initialized()


def test_top_ops_on_cuda_counts_kernels_not_the_host_operators_that_launch_them():
    from types import SimpleNamespace as Event

    from torch.autograd import DeviceType

    from seqpar.tools.bench.side_by_side import top_ops
    events = [Event(key="aten::mm", device_type=DeviceType.CPU, self_device_time_total=900, self_cpu_time_total=50),
              Event(key="sm90_gemm", device_type=DeviceType.CUDA, self_device_time_total=900, self_cpu_time_total=0),
              Event(key="flash_fwd", device_type=DeviceType.CUDA, self_device_time_total=300, self_cpu_time_total=0)]
    cuda = top_ops(events, 2, torch.device("cuda"))
    assert [(o["name"], o["ms_per_step"], o["share"]) for o in cuda] == [("sm90_gemm", 0.45, 0.75),
                                                                          ("flash_fwd", 0.15, 0.25)]
    assert [o["name"] for o in top_ops(events, 1, torch.device("cpu"))] == ["aten::mm"]


def test_an_interrupted_run_keeps_its_rows_and_marks_the_rest_stopped(tmp_path, monkeypatch):
    from seqpar.tools.bench import side_by_side
    measured = []

    def fake_cell(cell, shape_name, device, opts):
        if measured:
            raise KeyboardInterrupt
        measured.append(cell)
        return side_by_side._cell_fields(cell, shape_name) | {"status": "ok", "step_s": 1.0, "tokens_per_s": 128.0}

    monkeypatch.setattr(side_by_side, "run_cell", fake_cell)
    out = tmp_path / "rows.jsonl"
    rows = run(grid()[:3], "tiny", out, torch.device("cpu"), Options(), log=lambda line: None)
    assert [r["status"] for r in rows] == ["ok", "stopped", "stopped"] and read_rows(out) == rows
    assert "The run was interrupted: 2 cells were not measured" in sbs_table.markdown(rows)


def test_the_trainer_cell_leaves_the_thread_count_as_it_found_it(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rows = run([Cell("trainer", False, "math", "none")], "tiny", tmp_path / "t.jsonl", torch.device("cpu"),
                   Options(steps=1, warmup=1, profile_steps=0), log=lambda line: None)
        assert rows[0]["status"] == "ok", rows[0]
        assert torch.get_num_threads() == 2  # the Trainer set train.threads_per_rank=1 while it ran
    finally:
        torch.set_num_threads(before)
