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
