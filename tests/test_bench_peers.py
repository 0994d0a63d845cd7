"""The peers benchmark stays runnable (its figures are read by people, never asserted here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_peers_benchmark_runs_a_sweep_of_shapes_into_one_table(tmp_path):
    """A --shapes sweep (here the short-sample shape, few rows, float32): the tools interleaved, one table of ratios
    with the goal judged against TRL's faster setup."""
    pytest.importorskip("trl")  # a development dependency: the peer it compares with
    out = tmp_path / "peers.json"
    done = subprocess.run([sys.executable, "bench/peers.py", "--shapes", "short", "--precisions", "fp32",
                           "--train-rows", "24", "--eval-rows", "4", "--threads", "1", "--probe-s", "0.1",
                           "--out", str(out),
                           # TRL packed: bench/gpu_check.py's dry run runs it (tests/test_bench.py)
                           "--tools", "workbench,trl-unpacked,plain"], cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "workbench/trl-unpacked:" in done.stdout and "workbench/plain:" in done.stdout
    sweep = done.stdout.split("all shapes:")[1].splitlines()
    row = next(line for line in sweep if line.startswith("short "))
    assert row.split()[1] == "fp32" and row.endswith("met vs trl-unpacked")
    (job,) = json.loads(out.read_text())["jobs"]
    assert job["shape"] == "short" and job["spec"]["model_dtype"] == "float32"
    rows = {r["tool"]: r for r in job["summary"]}
    assert set(rows) == {"workbench", "trl-unpacked", "plain"}
    assert all(r["tokens"] > 0 and r["eval_loss"] > 0 and r["peak_rss_mb"] > 0 for r in rows.values())
    # the same rows for every tool: short samples, packed ~10 to a row by the packing tools
    assert len({r["tokens"] for r in rows.values()}) == 1 and rows["workbench"]["tokens"] / 24 < 100
    assert rows["trl-unpacked"]["steps"] == 24 // 8 and rows["workbench"]["steps"] <= 24 // 4  # 4+ samples a row


def test_the_held_out_shapes_have_the_lengths_they_are_named_for():
    sys.path.insert(0, str(ROOT / "bench"))
    from peers_data import make_rows

    def characters(row):
        return sum(len(m["content"]) for m in row["messages"])

    short, long = make_rows(200, seed=3, kind="short"), make_rows(40, seed=3, kind="long")
    assert max(map(characters, short)) < 300  # well under 100 tokens each
    assert min(map(characters, long)) > 1500  # near or past a 512-token max_seq_len once templated
    assert make_rows(5, seed=3, kind="short") == short[:5]  # deterministic


@pytest.mark.slow
def test_peers_dpo_benchmark_runs(tmp_path):
    """The DPO job end to end: workbench vs TRL's DPOTrainer on the same pairs, ratios printed."""
    pytest.importorskip("trl")
    out = tmp_path / "peers-dpo.json"
    done = subprocess.run([sys.executable, "bench/peers.py", "--objective", "dpo", "--quick", "--probe-s", "0.1",
                           "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    table = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    assert {"workbench", "trl"} <= table and "plain" not in table  # the plain loop sits the DPO job out
    assert "workbench/trl:" in done.stdout and "goal (workbench job time" in done.stdout
    saved = json.loads(out.read_text())
    assert saved["spec"]["objective"] == "dpo"
    rows = {r["tool"]: r for r in saved["summary"]}
    assert set(rows) == {"workbench", "trl"}
    wb, trl = rows["workbench"], rows["trl"]
    # the same job: the same optimizer steps over the same rows; a pair longer than max_seq_len is truncated by
    # TRL and left out by the workbench when it loses its answer, so the pairs and tokens scored may differ a little
    assert wb["steps"] == trl["steps"] > 0
    assert 0.9 * trl["pairs"] <= wb["pairs"] <= trl["pairs"] and 0.8 * trl["tokens"] <= wb["tokens"] <= trl["tokens"]
    for r in (wb, trl):
        assert r["peak_rss_mb"] > 0 and r["job_s"] > 0
        assert 0 < r["eval_loss"] < 5 and 0 <= r["eval_reward_accuracy"] <= 1
        assert r["train_loss"] is not None and r["train_loss"] > 0


def test_the_benchmark_refuses_flags_that_do_not_go_together_and_files_it_did_not_write(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import peers

    for argv, message in ((["--precisions", "fp32"], "--precisions goes with --shapes"),
                          (["--shapes", "short", "--job", "wide"], "--shapes names the jobs itself"),
                          (["--shapes", "tiny"], "unknown shape or precision ['tiny']"),
                          (["--objective", "dpo", "--tools", "trl-unpacked"], "unknown tool(s) ['trl-unpacked']")):
        with pytest.raises(SystemExit):
            peers.main(argv)
        assert message in capsys.readouterr().err
    for text in ("{bad", "[]", '{"jobs": [{"x": 1}]}'):
        (tmp_path / "out.json").write_text(text)
        with pytest.raises(SystemExit, match="--table .*out.json: "):
            peers.main(["--table", str(tmp_path / "out.json")])
