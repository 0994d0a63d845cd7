"""SLURM for real: a one-node cluster on this machine (.ci/slurm-up: Debian's slurm-wlm and munge, the node is
`localhost`). The script `workbench slurm --submit` writes runs; SLURM's time-limit warning (SIGUSR1) checkpoints it,
the job requeues itself, starts again with the same script, resumes and completes with the adapter of an
uninterrupted run. Skipped, saying why, where the cluster cannot be brought up (not root, no apt-get)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.rundir.runs import RunDir

from .helpers import COMMON, RECIPE, STEPS, adapter, assert_same_adapter, finish, logged_step, start, summary, wait_for

pytestmark = pytest.mark.slow

SLURM_UP = Path(__file__).resolve().parents[2] / ".ci" / "slurm-up"


@pytest.fixture(scope="module")
def slurm():
    done = subprocess.run([str(SLURM_UP)], capture_output=True, text=True, timeout=600)
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    if done.returncode or last != "ready":
        pytest.skip(f"no one-node SLURM here: {last} {done.stderr.strip()[-300:]}")


def job_field(job: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    for word in out.split():
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return ""


def test_submitted_job_is_warned_requeues_itself_resumes_and_completes(slurm, tmp_path, reference):
    overrides = [*COMMON, "output.save_every=null"]

    run_dir = tmp_path / "runs" / "tiny"
    code, out = finish(start([sys.executable, "-m", "workbench", "slurm", RECIPE, f"output.dir={run_dir}", *overrides,
                              "--nodes", "1", "--submit"]))
    assert code == 0, out
    job = out.split("submitted SLURM job ")[1].split()[0]
    try:
        wait_for(lambda: logged_step(run_dir) >= 3, timeout=180, what="step 3 of the SLURM job")
        subprocess.run(["scancel", "--signal=USR1", job], check=True)  # what --signal=USR1@N sends at the time limit
        wait_for(lambda: job_field(job, "Restarts") == "1", timeout=120, what="the job to requeue itself")
        stopped_at = RunDir(run_dir).latest_checkpoint()[0]
        assert summary(run_dir)["status"] == "interrupted" and 3 <= stopped_at < STEPS
        # SLURM holds a requeued job for about two minutes before it may start again: not what is tested here
        wait_for(lambda: job_field(job, "JobState") == "PENDING", timeout=60, what="the requeued job to be pending")
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
        wait_for(lambda: job_field(job, "JobState") in ("COMPLETED", "FAILED", "CANCELLED"), timeout=240,
                 what="the requeued job to finish")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    log = (tmp_path / "runs" / f"tiny-{job}.log").read_text()
    assert job_field(job, "JobState") == "COMPLETED", log[-3000:]
    # one log, appended across both starts (--open-mode=append), the same command both times
    assert f"job {job} start 0" in log and f"job {job} start 1" in log, log[-3000:]
    assert "interrupted by SIGUSR1" in log and f"requeued SLURM job {job}" in log
    assert f"resumed from {RunDir(run_dir).checkpoint(stopped_at)}" in log
    s = summary(run_dir)
    assert s["status"] == "completed" and s["steps"] == STEPS
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))
    assert_same_adapter(adapter(run_dir), reference)  # bitwise
