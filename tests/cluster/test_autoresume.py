"""`--resume auto` and the signals clusters send, on real runs: the same command starts a run, continues it after a
SIGUSR1 (SLURM's time-limit warning) and finds it done; two ranks under `workbench launch` survive a SIGUSR1 sent to
the whole job (torchrun itself would die of it) and checkpoint together."""

import json
import os
import signal
import sys

import pytest

from workbench import train
from workbench.rundir.runs import RunDir, load_run

from .helpers import (COMMON, RECIPE, STEPS, adapter, assert_same_adapter, finish, free_port, logged_step, losses,
                      start, summary, wait_for)

pytestmark = pytest.mark.slow


def train_command(run_dir, *extra):
    return [sys.executable, "-m", "workbench", "train", RECIPE, "--no-progress", f"output.dir={run_dir}", *COMMON,
            *extra]


LAUNCH_STEPS = 8


def launch_command(run_dir, *extra):
    return [sys.executable, "-m", "workbench", "launch", RECIPE, "--nproc", "2", "--master",
            f"127.0.0.1:{free_port()}", f"output.dir={run_dir}", *COMMON, f"training.max_steps={LAUNCH_STEPS}",
            "distributed.strategy=ddp", *extra]


def test_resume_auto_starts_continues_after_sigusr1_and_then_has_nothing_to_do(tmp_path, reference):
    run_dir = tmp_path / "auto"
    command = train_command(run_dir, "output.save_every=null", "--resume", "auto")  # the same command every time
    process = start(command)
    wait_for(lambda: logged_step(run_dir) >= 3, process, what="step 3")
    os.killpg(process.pid, signal.SIGUSR1)  # SLURM's --signal=USR1@N: the time limit is near
    code, out = finish(process)
    assert code == 128 + signal.SIGUSR1, out
    assert "interrupted by SIGUSR1" in out and "run the same command to continue" in out, out[-2000:]
    run = RunDir(run_dir)
    assert summary(run_dir)["status"] == "interrupted"
    stopped_at = run.latest_checkpoint()[0]
    assert 3 <= stopped_at < STEPS and not (run_dir / "adapter").exists()

    code, out = finish(start(command))
    assert code == 0, out
    assert f"resumed from {run.checkpoint(stopped_at)}" in out
    assert summary(run_dir)["status"] == "completed"
    assert_same_adapter(adapter(run_dir), reference)  # bitwise, as an uninterrupted run
    assert [step for step, _ in losses(run_dir)] == list(range(1, STEPS + 1))  # no step lost or logged twice

    code, out = finish(start(command))  # a job restarted after its run completed
    assert code == 0, out
    assert "the run has completed; nothing to resume" in out
    assert_same_adapter(adapter(run_dir), reference)


def test_recipe_resume_auto_replaces_a_start_that_died_before_its_first_checkpoint(tiny_recipe):
    recipe = tiny_recipe.override("training.max_steps=2", "training.resume=auto")
    run = RunDir(recipe.run_dir)
    run.path.mkdir(parents=True)
    # what a start killed before its first checkpoint leaves: a record saying running, metrics, no checkpoint
    (run.path / "run.json").write_text(json.dumps({"summary": {"status": "running"}}))
    (run.path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    result = train(recipe, progress_bar=False)
    assert result.summary["status"] == "completed" and result.summary["steps"] == 2
    rows = [r for r in map(json.loads, run.metrics.read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["loss"] != 9.0  # the dead start's rows are gone
    again = train(recipe, progress_bar=False)  # completed: returned as it is, nothing trained
    assert again.summary["wall_s"] == result.summary["wall_s"]


def test_sigusr1_to_the_whole_job_checkpoints_every_rank(tmp_path):
    """torchrun dies of SIGUSR1; started by `workbench launch` it survives, and both ranks stop at one step.
    (Two processes resuming exactly: tests/test_crash.py; `--resume auto` on two ranks: test_kubernetes.py.)"""
    run_dir = tmp_path / "preempted"
    process = start(launch_command(run_dir, "output.save_every=null", "--resume", "auto"))
    wait_for(lambda: logged_step(run_dir) >= 3, process, what="step 3")
    os.killpg(process.pid, signal.SIGUSR1)  # launcher, torchrun and ranks alike, as SLURM signals a job step
    code, out = finish(process)
    assert code != 0
    assert "[rank 0/2] interrupted by SIGUSR1" in out and "[rank 1/2] interrupted by SIGUSR1" in out, out[-3000:]
    run = RunDir(run_dir)
    assert summary(run_dir)["status"] == "interrupted"
    assert load_run(run_dir).summary["status"] == "interrupted"
    step = run.latest_checkpoint()[0]
    assert 3 <= step < LAUNCH_STEPS
    meta = json.loads((run.checkpoint(step) / "workbench_checkpoint.json").read_text())
    assert meta["world_size"] == 2


def test_a_configured_stop_signal_sent_to_the_launcher_alone_reaches_the_run(tmp_path):
    run_dir = tmp_path / "usr2"
    command = [sys.executable, "-m", "workbench", "launch", RECIPE, f"output.dir={run_dir}", *COMMON,
               "output.save_every=null", "--stop-signal", "USR2", "--overwrite"]
    process = start(command)
    wait_for(lambda: logged_step(run_dir) >= 2, process, what="step 2")
    os.kill(process.pid, signal.SIGUSR2)  # the launcher alone: it passes the signal on
    code, out = finish(process)
    assert code == 128 + signal.SIGUSR2, out
    assert "interrupted by SIGUSR2" in out, out[-3000:]
    assert summary(run_dir)["status"] == "interrupted" and RunDir(run_dir).latest_checkpoint() is not None


def test_workbench_stop_ends_a_loop_running_in_a_thread_with_a_checkpoint(tiny_recipe, capsys):
    """No signal reaches a loop in a thread (Ray Train runs it in one): `workbench stop` asks through the run
    directory, and the loop checkpoints and ends as SIGTERM would; the next start clears the answered request."""
    import threading

    from workbench.frontends.cli import main

    recipe = tiny_recipe.override("training.max_steps=40", "output.save_every=null", "output.log_every=1")
    run_dir = RunDir(recipe.run_dir)
    outcome = {}

    def run():
        try:
            outcome["result"] = train(recipe, progress_bar=False)
        except BaseException as err:  # noqa: BLE001  what the thread ended with
            outcome["error"] = err

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(lambda: logged_step(run_dir.path) >= 2 or not worker.is_alive(), what="step 2")
    assert main(["stop", str(run_dir.path)]) == 0 and run_dir.stop_request.exists()
    assert "asked to stop at its next step" in capsys.readouterr().out
    worker.join(timeout=120)
    err = outcome.get("error")
    assert err is not None and getattr(err, "exit_code", None) == 128 + signal.SIGTERM, outcome
    step = run_dir.latest_checkpoint()[0]
    assert 2 <= step < 40 and summary(run_dir.path)["status"] == "interrupted"
    assert main(["stop", str(run_dir.path)]) == 1  # not running: nothing to stop
    assert "is not running (status interrupted)" in capsys.readouterr().err
    run_dir.stop_request.write_text("stale\n")  # left over: the next start of the run clears it, and goes on
    resumed = train(recipe, resume=True, progress_bar=False)
    assert resumed.summary["status"] == "completed" and not run_dir.stop_request.exists()
