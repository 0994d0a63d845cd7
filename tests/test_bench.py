"""The benchmarks stay runnable (their figures are read by people, never asserted here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_methods_benchmark_runs(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "bench/methods.py", "--model", "builtin:tiny", "--steps", "2",
                           "--seq", "64", "--threads", "1", "--only", "lora,qlora-nf4,full", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"lora", "qlora-nf4", "full"}
    assert "x lora" in done.stdout and "1.00" in done.stdout
    assert rows["full"]["trainable_params"] > rows["lora"]["trainable_params"] > 0


@pytest.mark.slow
def test_gpu_check_dry_run_goes_through_every_part(tmp_path):
    """bench/gpu_check.py on a CPU with tiny shapes: the script that runs on a lent GPU never rots."""
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    measured = {r["name"]: r for r in report["rows"] if "tokens_per_s" in r}
    assert {"lora", "qlora-nf4", "lora+checkpointing", "lora, sdpa (dense mask)", "lora, unpacked (padded)"} <= set(
        measured)
    assert measured["lora, unpacked (padded)"]["packed_rows"] == "none"
    assert all(0.5 < r["estimate_ratio"] < 2 and r["tokens_per_s"] > 0 for r in measured.values())
    flash = next(r for r in report["rows"] if r["name"] == "lora, flash-attn varlen")
    assert "flash_attention_2 runs on CUDA GPUs only" in flash["skipped"]  # the workbench's own refusal
    assert set(report["peers"]["rows"]) == {"workbench", "trl"}  # the goal compares these two
    assert len(report["goals"]) == 3 and all(g["met"] is None for g in report["goals"])  # GPU goals, not judged here
    assert "| goal | measured | met |" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_step_floor_measures_each_part_and_says_where_half_of_trls_time_lies(tmp_path):
    done = subprocess.run([sys.executable, "bench/step_floor.py", "--jobs", "quick", "--precisions", "fp32",
                           "--micro-batches", "4", "--repeats", "2", "--import-repeats", "1", "--trl-s",
                           "quick/fp32=1000", "--workdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("quick"))
    step, no_dropout, base, adapter, floor = map(float, row[3:8])
    assert 0 < base < step and 0 < adapter and abs(floor - (base + adapter)) < 0.11
    assert row[-2:] == ["floor", "below"]  # half of 1000 s lies far above a few steps of a tiny model


@pytest.mark.slow
def test_profile_steps_runs_and_names_the_matmul_shapes(tmp_path):
    out = tmp_path / "profile.txt"
    done = subprocess.run([sys.executable, "bench/profile_steps.py", "--cpu", "--steps", "1", "--out", str(out),
                           "training.threads=1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert "by host time:" in text and "aten::mm:" in text and "% of all operators' self time" in text
    shapes = text.split("GFLOP/s alone):")[1].strip().splitlines()
    assert shapes and all(line.strip().startswith("[[") and float(line.split()[-1]) >= 0 for line in shapes)
    assert max(float(line.split()[-1]) for line in shapes) > 0  # a small matmul's share may round to 0
