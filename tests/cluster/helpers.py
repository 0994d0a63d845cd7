"""What the engine tests share: start a command, wait for a logged step, read a run's files."""

import json
import os
import socket
import subprocess
import time

import torch
from safetensors.torch import load_file

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


def logged_step(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line).get("step", 0))
        except json.JSONDecodeError:
            pass
    return max(steps, default=0)


def wait_for(condition, process=None, timeout: float = 240, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{process.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def summary(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())["summary"]


def losses(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def adapter(run_dir) -> dict:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def assert_same_adapter(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=atol, rtol=0), (key, (a[key] - b[key]).abs().max())
