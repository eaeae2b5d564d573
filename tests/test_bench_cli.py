"""`seqpar bench` runs end to end with seqpar alone (the peers have their own tests)."""
import json


def test_bench_prints_tables_and_writes_results(tmp_path, capsys):
    from seqpar.tools.bench.cli import main
    out = tmp_path / "bench"
    rc = main(["--systems", "seqpar", "--recompute", "none,selective", "--seq", "32", "--hidden", "32",
               "--heads", "4", "--vocab", "64", "--layers", "2", "--repeats", "2", "--warmup", "0",
               "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "| seqpar | none |" in text and "| seqpar | selective |" in text
    data = json.loads((out / "results.json").read_text())
    res = {r["recompute"]: r for r in data["results"]}
    assert res["none"]["step0_loss"] == res["selective"]["step0_loss"]  # same weights, same math
    assert res["selective"]["saved_bytes_per_layer"] < res["none"]["saved_bytes_per_layer"]
    assert len(res["none"]["times"]) == 2
    sp, tp = data["comm"]["sp"], data["comm"]["tp"]
    assert sp["bytes"]["all_gather"] > 0 and tp["bytes"]["all_reduce"] > 0
    assert (out / "results.png").stat().st_size > 0


def test_bench_rejects_unknown_systems(capsys):
    from seqpar.tools.bench.cli import main
    try:
        main(["--systems", "seqpar,deepspeed"])
    except SystemExit as e:
        assert e.code == 2
    assert "deepspeed" in capsys.readouterr().err


def test_bench_runs_the_plain_peer_at_t1_with_seqpars_step0_loss(tmp_path, capsys):
    from seqpar.tools.bench.cli import main
    out = tmp_path / "bench"
    rc = main(["--systems", "seqpar,plain", "--tp", "1", "--recompute", "none,full", "--seq", "16", "--hidden", "32",
               "--heads", "4", "--vocab", "64", "--layers", "2", "--repeats", "1", "--warmup", "0", "--out", str(out)])
    assert rc == 0 and "| plain | full |" in capsys.readouterr().out
    res = {(r["system"], r["recompute"]): r for r in json.loads((out / "results.json").read_text())["results"]}
    assert abs(res["plain", "none"]["step0_loss"] - res["seqpar", "none"]["step0_loss"]) < 1e-5
    assert res["plain", "full"]["saved_bytes_per_layer"] < res["plain", "none"]["saved_bytes_per_layer"]


def test_bench_refuses_the_plain_peer_on_two_ranks(capsys):
    from seqpar.tools.bench.cli import main
    try:
        main(["--systems", "seqpar,plain"])
    except SystemExit as e:
        assert e.code == 2
    assert "the plain peer runs on one device" in capsys.readouterr().err
