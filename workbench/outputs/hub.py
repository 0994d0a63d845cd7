"""The Hugging Face Hub: check access, upload a folder, and `push` a run's adapter or merged model.

Imports nothing heavy at module level: `workbench push` offline (or with a bad repository id) answers in
about a second, before any model is loaded or merged.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from workbench.base.errors import RecipeError, WorkbenchError

MERGE_FLAG = "--push-to-hub"  # how `workbench merge` names the repository in its messages


def hub_offline() -> bool:
    from huggingface_hub import constants

    flag = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").strip().upper()
    return constants.HF_HUB_OFFLINE or flag in {"1", "ON", "YES", "TRUE"}


def check_repo_id(repo: str, flag: str = MERGE_FLAG) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as err:
        raise RecipeError(f"{flag}: {repo!r} is not a repository id like owner/name ({err})") from None


def check_hub_access(repo: str, flag: str = MERGE_FLAG,
                     offline_advice: str = "merge without --push-to-hub now and push when online") -> None:
    """Raise a WorkbenchError unless the hub is reachable and a token is set that it accepts."""
    from huggingface_hub import HfApi, get_token

    check_repo_id(repo, flag)
    if hub_offline():
        raise WorkbenchError(f"{flag} {repo}: the Hugging Face Hub is offline (HF_HUB_OFFLINE=1); {offline_advice}")
    seconds = None
    try:
        if get_token() is None:
            raise WorkbenchError(f"{flag} {repo}: not logged in to the Hugging Face Hub "
                                 "(run `hf auth login` or set HF_TOKEN)")
        with hub_wait() as seconds:
            HfApi().whoami()
    except WorkbenchError:
        raise
    except Exception as err:  # network and HTTP failures come in many types; all end the same way
        raise WorkbenchError(f"{flag} {repo}: {hub_problem(err, seconds, 'checking the token')}") from None


@contextmanager
def hub_wait():
    """The seconds a short request to the hub waits for an answer (HF_HUB_ETAG_TIMEOUT, the hub library's limit for
    its metadata requests), put on huggingface_hub's shared HTTP client for the requests made inside: that client
    waits without a limit. The client's own setting is put back afterwards."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    seconds = constants.HF_HUB_ETAG_TIMEOUT
    session = get_session()
    before = session.timeout
    session.timeout = seconds
    try:
        yield seconds
    finally:
        session.timeout = before


def push_folder(folder: Path, repo: str, private: bool = False, flag: str = MERGE_FLAG,
                what: str = "merged model", kept: bool = True) -> str:
    """Upload a folder to a (new or existing) model repository; returns the repository URL.
    `private` applies when the repository is created. `kept`: the folder outlives a failure (the message
    says where it is)."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model",
                          commit_message=f"Upload {what} (lora-workbench)")
    except Exception as err:
        where = f"; the {what} is saved in {folder}" if kept else ""
        raise WorkbenchError(f"{flag} {repo}: {hub_problem(err)}{where}") from None
    return str(url)


def hub_problem(err: Exception, seconds: float | None = None, waiting_for: str = "") -> str:
    """One line for a failed hub request; `seconds` and `waiting_for` say what a request that timed out waited for."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if isinstance(err, OfflineModeIsEnabled):
        return "the Hugging Face Hub is offline (HF_HUB_OFFLINE=1)"
    if seconds is not None and _timed_out(err):
        what = f"{waiting_for}; " if waiting_for else ""
        return (f"the Hugging Face Hub at {constants.ENDPOINT} did not answer within {seconds:g} s "
                f"({what}HF_HUB_ETAG_TIMEOUT sets the wait)")
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, HfHubHTTPError) and status in (401, 403):
        return f"the hub refused the token (HTTP {status}): check `hf auth login` or HF_TOKEN"
    if isinstance(err, HfHubHTTPError) and status is not None:
        return f"the hub answered HTTP {status}: {first}"
    return f"cannot reach the Hugging Face Hub (no network?): {first}"


def _timed_out(err: Exception) -> bool:
    """A request that waited its time out, whichever HTTP library the hub client uses (httpx, requests)."""
    return isinstance(err, TimeoutError) or any(kind.__name__ in ("TimeoutException", "Timeout")
                                                for kind in type(err).__mro__)
