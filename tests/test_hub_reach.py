"""`train`, `estimate`, `generate` and `data` online against a hub that accepts and never answers: one line naming
what was being loaded and the endpoint, within the hub library's wait, never a silent hang. Each in a fresh process
with HF_HUB_OFFLINE unset."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.parametrize("command, field, name, kind", [
    (["train", "recipes/tiny.yaml", "model.path=org/some-model", "training.max_steps=1", "output.dir={tmp}/{{name}}"],
     "model.path",
     "org/some-model", "model"),
    (["estimate", "recipes/tiny.yaml", "model.path=org/some-model"], "model.path", "org/some-model", "model"),
    (["generate", "org/some-model", "--prompt", "hi"], "model.path", "org/some-model", "model"),
    (["data", "recipes/tiny.yaml", "data.train=org/some-dataset"], "org/some-dataset", "org/some-dataset", "data set"),
    (["data", "recipes/tiny.yaml", "data.train=org/some-dataset", "data.eval=null", "data.streaming=true",
      "training.max_steps=2"],
     "org/some-dataset", "org/some-dataset", "data set"),
])
def test_a_hub_that_never_answers_is_one_line_naming_what_was_loaded(command, field, name, kind, tmp_path):
    from silent_server import SilentServer

    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with SilentServer(hold_s=300) as server:  # it holds each request longer than the test waits
        env.update(HF_ENDPOINT=server.url, HF_HUB_ETAG_TIMEOUT="1", PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-m", "workbench", *(arg.format(tmp=tmp_path) for arg in command)],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert server.holding.is_set()  # it did ask the endpoint
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == (f"error: {field}: the Hugging Face Hub at {server.url} did not answer within 1 s (loading "
                         f"the {kind} '{name}'; HF_HUB_ETAG_TIMEOUT sets the wait, HF_HUB_OFFLINE=1 uses the local "
                         "cache)"), done.stderr
    assert [line for line in lines if line.startswith("error:")] == lines[-1:]


def test_offline_the_hub_is_not_asked(monkeypatch):
    from silent_server import SilentServer
    from workbench.base.hub_reach import check_hub_answers

    with SilentServer(hold_s=5) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        check_hub_answers("org/some-model", "model", "model.path")
        assert server.paths == []
