"""`workbench push` and `merge --push-to-hub` against a hub that never answers: a bounded wait, one line."""

import re
import time

import pytest

from workbench import WorkbenchError, train
from workbench.cli import main
from workbench.hub import check_hub_access
from workbench.publish import push


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
