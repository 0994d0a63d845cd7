"""Reading a training run's files while its process runs: shared by the crash, resume and engine tests."""

import json
import time

import torch
from safetensors.torch import load_file


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


def wait_for(condition, process=None, timeout: float = 300, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{process.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def adapter(run_dir) -> dict:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def assert_same_adapter(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=atol, rtol=0), (key, (a[key] - b[key]).abs().max())


def resumed_from_its_checkpoint(done, recipe, last_step: int):
    """Train `recipe` again with --resume after taking away what a completed run wrote after its checkpoint
    before `last_step`, as if it had stopped there; (adapter of the whole run, adapter of the resumed one)."""
    import shutil

    from workbench import train
    from workbench.rundir.runs import RunDir

    whole = adapter(done.run_dir)
    run = RunDir(done.run_dir)
    shutil.rmtree(run.checkpoint(last_step))
    shutil.rmtree(run.adapter)
    run.update_json(summary={"status": "running"})
    return whole, adapter(train(recipe, resume=True, progress_bar=False).run_dir)
