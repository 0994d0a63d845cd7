"""Never lose a run: kill -9 mid-step and mid-checkpoint, SIGINT, SIGTERM of a 2-process run, NaN guards.

Every interrupted run is resumed and must end with the adapter of an uninterrupted run: bitwise in one
process (fp32, one thread), within 1e-6 across two processes.
"""

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from run_files import adapter, assert_same_adapter, logged_step, wait_for
from workbench import train
from workbench.base.errors import NonFiniteError
from workbench.rundir.runs import RunDir

pytestmark = pytest.mark.slow

RECIPE = "recipes/tiny.yaml"
STEPS = 10
# dropout on: a resume must restore the RNG too; one thread: bitwise-reproducible matmuls
COMMON = [f"training.max_steps={STEPS}", "training.grad_accum=1", "training.micro_batch_size=2", "training.threads=1",
          "adapter.dropout=0.1", "output.log_every=1", "output.eval_every=null", "data.eval=null",
          "model.dtype=float32", "training.mixed_precision=no"]


def start(run_dir, *overrides, env=None, launch_nproc=None, resume=False):
    if launch_nproc:
        command = [sys.executable, "-m", "workbench", "launch", RECIPE, "--nproc", str(launch_nproc),
                   "--master", f"127.0.0.1:{free_port()}"]
    else:
        command = [sys.executable, "-m", "workbench", "train", RECIPE, "--no-progress"]
    command += [f"output.dir={run_dir}", *COMMON, *overrides, "--resume" if resume else "--overwrite"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def finish(process, timeout=400) -> tuple[int, str]:
    out, _ = process.communicate(timeout=timeout)
    return process.returncode, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every interrupted one must reproduce."""
    run_dir = tmp_path_factory.mktemp("crash") / "reference"
    code, out = finish(start(run_dir, "output.save_every=null"))
    assert code == 0, out
    return adapter(run_dir)


def test_kill_9_at_a_random_step_then_resume(tmp_path, reference):
    seed = random.randrange(10**6)
    kill_at = random.Random(seed).randint(3, STEPS - 2)
    run_dir = tmp_path / "killed"
    process = start(run_dir, "output.save_every=2", "output.keep_last=2")
    wait_for(lambda: logged_step(run_dir) >= kill_at, process, what=f"step {kill_at}")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    run = RunDir(run_dir)
    assert not (run_dir / "adapter").exists(), f"seed {seed}: the run finished before the kill"
    saved = [step for step, _ in run.complete_checkpoints()]
    assert saved and saved[-1] <= logged_step(run_dir) and len(saved) <= 2, f"seed {seed}: {saved}"

    code, out = finish(start(run_dir, "output.save_every=2", "output.keep_last=2", resume=True))
    assert code == 0, out
    assert f"resumed from {run.checkpoint(saved[-1])}" in out
    assert_same_adapter(adapter(run_dir), reference)
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, STEPS + 1))  # no step logged twice or lost


def test_kill_9_inside_a_checkpoint_write_keeps_the_last_complete_one(tmp_path, reference):
    run_dir = tmp_path / "torn"
    process = start(run_dir, "output.save_every=2", "output.keep_last=2",
                    env={"LORA_WORKBENCH_CHECKPOINT_PAUSE": "6:120"})  # step 6's write waits, half done
    staging = RunDir(run_dir).staging_checkpoint(6)
    wait_for(lambda: staging.exists() and any(staging.iterdir()), process, what="the half-written checkpoint")
    time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    run = RunDir(run_dir)
    assert [step for step, _ in run.complete_checkpoints()] == [2, 4]  # 6 is not taken for a complete one
    assert run.latest_checkpoint()[0] == 4

    code, out = finish(start(run_dir, "output.save_every=2", "output.keep_last=2", resume=True))
    assert code == 0, out
    assert_same_adapter(adapter(run_dir), reference)
    assert [step for step, _ in run.complete_checkpoints()] == [8, 10]  # rotation kept the newest two
    assert not list(run.checkpoints.glob(".tmp-*"))


def test_sigint_saves_a_checkpoint_and_exits_130(tmp_path, reference):
    run_dir = tmp_path / "ctrl-c"
    process = start(run_dir, "output.save_every=null")
    wait_for(lambda: logged_step(run_dir) >= 4, process, what="step 4")
    os.killpg(process.pid, signal.SIGINT)
    code, out = finish(process)
    assert code == 130, out
    assert "interrupted by SIGINT" in out and "--resume" in out
    run = RunDir(run_dir)
    summary = run.read_json()["summary"]
    assert summary["status"] == "interrupted"
    stopped_at = run.latest_checkpoint()[0]
    assert stopped_at >= 4 and not (run_dir / "adapter").exists()

    code, out = finish(start(run_dir, "output.save_every=null", resume=True))
    assert code == 0, out
    assert_same_adapter(adapter(run_dir), reference)


def test_ctrl_c_held_down_while_loading_still_exits_130(tmp_path):
    """SIGINT after SIGINT while the libraries load (a held Ctrl-C, a launcher forwarding the UI's Stop): the first
    stops the run, the rest must not turn its exit code 130 into death by the signal while Python shuts down."""
    run_dir = tmp_path / "held"
    process = start(run_dir)
    time.sleep(1.0)  # past the interpreter's start-up, into the imports
    while process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        time.sleep(0.01)
    code, out = finish(process)
    assert code == 130, out
    assert not (run_dir / "adapter").exists()


def test_sigterm_stops_every_rank_of_a_two_process_run_together(tmp_path):
    two = ["distributed.strategy=ddp", "output.save_every=null"]
    reference_dir = tmp_path / "reference-2"
    # the uninterrupted run trains beside the interrupted one (one thread a process: the same numbers either way)
    reference = start(reference_dir, *two, launch_nproc=2)
    try:
        run_dir = tmp_path / "preempted"
        process = start(run_dir, *two, launch_nproc=2)
        wait_for(lambda: logged_step(run_dir) >= 3, process, what="step 3")
        os.killpg(process.pid, signal.SIGTERM)  # a scheduler signals the whole job
        code, out = finish(process)
        assert code != 0
        assert "[rank 0/2] interrupted by SIGTERM" in out and "[rank 1/2] interrupted by SIGTERM" in out, out[-3000:]
        run = RunDir(run_dir)
        assert run.read_json()["summary"]["status"] == "interrupted"
        stopped_at = run.latest_checkpoint()[0]
        assert 3 <= stopped_at < STEPS

        code, out = finish(start(run_dir, *two, launch_nproc=2, resume=True))
        assert code == 0, out
        s = run.read_json()["summary"]
        assert s["status"] == "completed" and s["world_size"] == 2 and s["steps"] == STEPS
        code, out = finish(reference)
        assert code == 0, out
        assert_same_adapter(adapter(run_dir), adapter(reference_dir), atol=1e-6)
    finally:
        if reference.poll() is None:  # a failure above: the reference does not outlive the test
            os.killpg(reference.pid, signal.SIGKILL)


def test_a_nan_stops_the_run_naming_the_step_and_keeps_the_good_checkpoint(tiny_recipe):
    recipe = tiny_recipe.override("training.lr=1e30", "training.max_steps=6", "output.save_every=1")
    with pytest.raises(NonFiniteError, match="training.step 2: the loss or gradients are not finite") as err:
        train(recipe, progress_bar=False)
    assert "step-1, is kept" in str(err.value)
    run = RunDir(recipe.run_dir)
    assert [step for step, _ in run.complete_checkpoints()] == [1]
    assert run.read_json()["summary"]["status"] == "failed"


def test_a_nan_step_can_be_skipped_instead_but_not_step_after_step(tiny_recipe):
    recipe = tiny_recipe.override("training.lr=1e30", "training.max_steps=20", "training.on_nonfinite=skip")
    with pytest.raises(NonFiniteError, match=r"skip dropped 4 of \d+ steps: the run is not training"):
        train(recipe, progress_bar=False)
    run = RunDir(recipe.run_dir)
    assert run.read_json()["summary"]["status"] == "failed"
    rows = [json.loads(line) for line in (recipe.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "skipped" in r]) == 3  # the fourth stops the run
    assert all(r.get("loss") is None or math.isfinite(r["loss"]) for r in rows)  # null, never NaN
