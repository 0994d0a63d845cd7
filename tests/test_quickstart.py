"""The README's quickstart, end to end: SmolLM2-135M learns a new identity on a CPU, and `workbench evaluate`
scores it against its base on held-out questions."""

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
    assert sample["ended"]["after"]  # the tuned model stops: its answer ends with EOS within the token budget
    assert "no end of sequence" not in done.stdout.split("after:")[1]

    # base beside tuned on the held-out questions, through the command line (what the README shows next)
    scored = subprocess.run([sys.executable, "-m", "workbench", "evaluate", str(tmp_path / "quickstart"), "--base",
                             "--max-new-tokens", "32", "--json"], capture_output=True, text=True, timeout=600)
    assert scored.returncode == 0, scored.stderr[-3000:]
    result = json.loads(scored.stdout)
    tuned, base = result["tuned"], result["base"]
    assert tuned["eval_loss"] < 0.5 * base["eval_loss"]
    assert tuned["contains"] > base["contains"] and base["contains"] == 0  # the base has never heard of Quill
    assert any("Quill" in e["tuned"] for e in result["examples"])
    assert not any("Quill" in e["base"] for e in result["examples"])
