"""Real multi-process training on this CPU (gloo): launch routes, two nodes, bfloat16 QLoRA under FSDP2.
(tests/test_strategy_matrix.py holds every layout against one process, and resumes across layouts.)

Several launch routes fall back silently (one process, or FSDP/ZeRO quietly becoming DDP), so every
test judges from what the ranks recorded in run.json: world size, distributed type, parameter
elements and a checksum of the trainable weights per rank; never from the launch flags.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from workbench.rundir.runs import RunDir

pytestmark = pytest.mark.slow

RECIPE = "recipes/tiny.yaml"
STEPS = 6
# fp32, no dropout, one optimizer step per batch, a loss logged every step: runs are comparable
COMMON = [f"training.max_steps={STEPS}", "training.grad_accum=1", "output.log_every=1",
          "output.eval_every=null", "data.eval=null", "model.dtype=float32", "training.mixed_precision=no"]
TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(command: list[str], run_dir) -> subprocess.CompletedProcess:
    """Run a launch; a rank that hangs at shutdown after the run completed is killed, not failed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    try:
        out, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        status = RunDir(run_dir).read_json().get("summary", {}).get("status")
        assert status == "completed", f"launch timed out after {TIMEOUT_S} s (run status {status}):\n{out[-4000:]}"
    return subprocess.CompletedProcess(command, process.returncode, out)


def launch(run_dir, *overrides, nproc=2, resume=False) -> dict:
    command = [sys.executable, "-m", "workbench", "launch", RECIPE, "--nproc", str(nproc),
               "--master", f"127.0.0.1:{free_port()}", f"output.dir={run_dir}", *COMMON, *overrides,
               "--resume" if resume else "--overwrite"]
    done = run_command(command, run_dir)
    assert done.returncode in (0, None) or _completed(run_dir), done.stdout[-4000:]
    return summary_of(run_dir)


def summary_of(run_dir) -> dict:
    summary = RunDir(run_dir).read_json()["summary"]
    assert summary["status"] == "completed", summary
    return summary


def _completed(run_dir) -> bool:
    return RunDir(run_dir).read_json().get("summary", {}).get("status") == "completed"


def losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def adapter(run_dir) -> dict:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def assert_close_adapters(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=atol, rtol=0), (key, (a[key] - b[key]).abs().max())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each run once per module, on first use: the tests below share them."""
    root = tmp_path_factory.mktemp("distributed")
    cache: dict = {}

    def get(name: str, *overrides: str, nproc: int = 2):
        if name not in cache:
            cache[name] = (root / name, launch(root / name, *overrides, nproc=nproc))
        return cache[name]

    get.root = root
    return get


def test_fsdp_shards_4bit_qlora_weights(runs):
    qlora_dir, s = runs("fsdp-qlora", "adapter.method=qlora", "model.dtype=bfloat16", "training.mixed_precision=bf16",
                        "quantization.bits=4", "quantization.quant_storage=bfloat16", "distributed.strategy=fsdp",
                        "training.micro_batch_size=2")
    assert (s["world_size"], s["distributed_type"]) == (2, "FSDP")
    a, b = s["param_elements_per_rank"]
    assert a == b and a + b < s["params"]  # packed 4-bit storage, split over the ranks
    assert (qlora_dir / "adapter" / "adapter_model.safetensors").exists()
    assert s["final_loss"] < losses(qlora_dir)[0]


def launch_two_machines(run_dir, nproc: int, *overrides) -> tuple[dict, str]:
    """Two `workbench launch` commands on localhost, machine rank 0 and 1, as on two machines."""
    master = f"127.0.0.1:{free_port()}"

    def machine(rank):
        return [sys.executable, "-m", "workbench", "launch", RECIPE, "--nproc", str(nproc), "--nnodes", "2",
                "--node-rank", str(rank), "--master", master, f"output.dir={run_dir}", *COMMON, *overrides,
                "--overwrite"]

    second = subprocess.Popen(machine(1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        first = run_command(machine(0), run_dir)
        second.wait(timeout=120)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    return summary_of(run_dir), first.stdout


def test_two_nodes_on_localhost_form_one_run(tmp_path):
    s, out = launch_two_machines(tmp_path / "two-nodes", 1, "distributed.strategy=ddp", "training.micro_batch_size=2")
    assert (s["world_size"], s["distributed_type"]) == (2, "MULTI_CPU"), out[-3000:]
    a, b = s["trainable_checksum_per_rank"]
    assert a == b


def test_a_launch_that_silently_starts_one_process_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts ONE process: the run must say so, not train."""
    run_dir = tmp_path / "fallback"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
               "--main_process_port", str(free_port()), "-m", "workbench", "train", RECIPE,
               f"output.dir={run_dir}", *COMMON, "--no-progress"]
    done = run_command(command, run_dir)
    assert "asked for several processes but started one" in done.stdout
    assert not run_dir.exists()  # nothing was written


def test_plain_accelerate_launch_runs_the_recipe_unchanged(tmp_path):
    """The documented `accelerate launch --multi_gpu ... -m workbench train` route, without our wrapper."""
    run_dir = tmp_path / "plain"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--main_process_port", str(free_port()), "-m", "workbench", "train", RECIPE,
               f"output.dir={run_dir}", *COMMON, "distributed.strategy=fsdp", "training.micro_batch_size=2",
               "--no-progress"]
    run_command(command, run_dir)
    s = summary_of(run_dir)
    assert (s["world_size"], s["distributed_type"]) == (2, "FSDP")
    assert max(s["param_elements_per_rank"]) < 0.55 * s["params"]
