"""The peers benchmark stays runnable (its figures are read by people, never asserted here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_peers_benchmark_runs(tmp_path):
    pytest.importorskip("trl")  # a development dependency: the peer it compares with
    out = tmp_path / "peers.json"
    done = subprocess.run([sys.executable, "bench/peers.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    table = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    assert {"workbench", "trl", "plain"} <= table
    assert "workbench/trl:" in done.stdout and "workbench/plain:" in done.stdout
    rows = {r["tool"]: r for r in json.loads(out.read_text())["summary"]}
    assert set(rows) == {"workbench", "trl", "plain"}
    assert all(r["tokens"] > 0 and r["eval_loss"] > 0 and r["peak_rss_mb"] > 0 for r in rows.values())
