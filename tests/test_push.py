"""`workbench push` and `merge --push-to-hub` against a hub that never answers: a bounded wait, one line."""

import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from workbench import WorkbenchError, train
from workbench.frontends.cli import main
from workbench.outputs.hub import check_hub_access
from workbench.outputs.publish import push


@pytest.fixture
def hanging_hub(monkeypatch):
    """HF_ENDPOINT at a local server that accepts and never answers, a token set, the hub's wait 1 s."""
    from huggingface_hub import constants
    from silent_server import SilentServer

    with SilentServer() as server:
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
        monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
        yield server


def test_the_token_check_waits_a_bounded_time_and_says_for_what(hanging_hub):
    started = time.monotonic()
    with pytest.raises(WorkbenchError) as failed:
        check_hub_access("me/tiny", flag="push")
    assert time.monotonic() - started < 10
    assert hanging_hub.holding.is_set()  # it did ask the endpoint
    assert str(failed.value) == (f"push me/tiny: the Hugging Face Hub at {hanging_hub.url} did not answer within "
                                 "1 s (checking the token; HF_HUB_ETAG_TIMEOUT sets the wait)")


def test_push_to_a_hub_that_never_answers_is_one_line_in_seconds(tiny_recipe, hanging_hub, capsys):
    run = train(tiny_recipe.override("training.max_steps=1"), progress_bar=False)
    started = time.monotonic()
    assert main(["push", str(run.run_dir), "me/tiny"]) == 1
    assert time.monotonic() - started < 15
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert re.match(rf"error: push me/tiny: the Hugging Face Hub at {re.escape(hanging_hub.url)} did not answer "
                    r"within 1 s", err)


def test_push_online_never_waits_on_the_hub_while_it_imports_the_libraries(tiny_recipe, tmp_path):
    """bitsandbytes asks the hub for a CPU kernel as peft imports it (on a CPU with AVX-512 BF16), with no deadline:
    a hub that never answers held `workbench push` there for minutes. In a fresh process, HF_HUB_OFFLINE unset."""
    from silent_server import SilentServer

    run = train(tiny_recipe.override("training.max_steps=1"), progress_bar=False)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with SilentServer(hold_s=300) as server:  # it holds each request longer than the test waits
        env.update(HF_ENDPOINT=server.url, HF_TOKEN="hf_not_a_real_token", HF_HUB_ETAG_TIMEOUT="1",
                   PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-m", "workbench", "push", str(run.run_dir), "me/tiny"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=240)
        asked = list(server.paths)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"error: push me/tiny: the Hugging Face Hub at {server.url} did not answer "
                                  "within 1 s (checking the token"), done.stderr
    assert done.stderr.count("\n") == 1
    assert not [path for path in asked if "kernels-community" in path], asked  # no request the import waited on


def test_the_offline_import_puts_the_hub_switch_back():
    from silent_server import SilentServer

    check = ("import os, sys\nfrom huggingface_hub import constants\nfrom workbench.base.quiet import "
             "import_bitsandbytes_offline\nimport_bitsandbytes_offline()\n"
             "print('bitsandbytes' in sys.modules, constants.HF_HUB_OFFLINE, os.environ.get('HF_HUB_OFFLINE'))")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with SilentServer(hold_s=300) as server:
        env.update(HF_ENDPOINT=server.url, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "False", "None"], done.stderr
