"""The README's quickstart, end to end: SmolLM2-135M learns a new identity on a CPU."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_quickstart_teaches_smollm2_its_new_name(tmp_path):
    command = [sys.executable, "-m", "workbench", "train", "recipes/quickstart.yaml", "--no-progress",
               f"output.dir={tmp_path}/{{name}}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eval loss" in done.stdout and "after:" in done.stdout
    summary = json.loads((tmp_path / "quickstart" / "run.json").read_text())["summary"]
    assert summary["eval_loss_final"] < 0.25 * summary["eval_loss_first"]
    sample = summary["samples"][0]
    assert "Quill" in sample["after"] and "Quill" not in sample["before"]

    base = subprocess.run([sys.executable, "-m", "workbench", "generate", str(tmp_path / "quickstart"), "--base",
                           "--prompt", "What is your name?", "--max-new-tokens", "24"],
                          capture_output=True, text=True, timeout=300)
    tuned = subprocess.run([sys.executable, "-m", "workbench", "generate", str(tmp_path / "quickstart"),
                            "--prompt", "What is your name?", "--max-new-tokens", "24"],
                           capture_output=True, text=True, timeout=300)
    assert base.returncode == tuned.returncode == 0
    assert "Quill" in tuned.stdout and "Quill" not in base.stdout
