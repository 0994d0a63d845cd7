"""What the engine tests share: start a command, wait for a logged step, read a run's files."""

import json
import os
import socket
import subprocess

from run_files import adapter, assert_same_adapter, logged_step, wait_for  # noqa: F401  (the engine tests import them from here)

RECIPE = "recipes/tiny.yaml"
STEPS = 16  # enough that a signal sent at step 3 lands mid-run, even on a busy machine
# fp32, one thread, no dropout randomness left to chance, a loss every step: runs are comparable bitwise (one
# process) or to 1e-6 (two)
COMMON = [f"training.max_steps={STEPS}", "training.grad_accum=1", "training.micro_batch_size=2",
          "training.threads=1", "adapter.dropout=0.1", "output.log_every=1", "output.eval_every=null",
          "data.eval=null", "model.dtype=float32", "training.mixed_precision=no"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], env: dict | None = None, replace_env: bool = False) -> subprocess.Popen:
    full = dict(env or {}) if replace_env else {**os.environ, **(env or {})}
    full["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full,
                            start_new_session=True)


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        out, _ = process.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{out[-3000:]}") from None
    return process.returncode, out


def summary(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())["summary"]


def losses(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


