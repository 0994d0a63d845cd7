"""`workbench push`: a run's adapter, whole model or merged model, with its model card, to a hub repository."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

from workbench.base.errors import WorkbenchError
from workbench.base.quiet import import_bitsandbytes_offline
from workbench.model.inference import check_adapter
from workbench.outputs.hub import check_hub_access, push_folder
from workbench.outputs.merging import merge
from workbench.rundir.model_card import write_model_card
from workbench.rundir.runs import load_run


# -- workbench push ---------------------------------------------------------------------------


def push(run_dir: str | Path, repo: str, merged: bool = False, private: bool = False) -> str:
    """Upload a run to a hub model repository (created if missing, private with private=True): its adapter
    folder with a fresh model card, or with merged=True the merged model (an up-to-date RUN/merged folder,
    else a merge made for the upload). Access is checked before anything is loaded or merged. Returns the
    repository URL."""
    import_bitsandbytes_offline()  # peft's import (checking the adapter) must not wait on the hub it asks
    run = load_run(run_dir)  # what is pushed exists, before the hub is asked anything
    whole_model = run.dir.model  # full fine-tuning saved the whole model: nothing to merge
    if not whole_model.is_dir():
        check_adapter(run.path, run.adapter_dir)
    check_hub_access(repo, flag="push", offline_advice="push again when online")
    if whole_model.is_dir():
        return _push_with_card(whole_model, run.path, repo, private, "merged", "model")
    if not merged:
        return _push_with_card(run.adapter_dir, run.path, repo, private, "adapter", "adapter")
    existing = run.dir.merged
    if _merged_is_current(existing, run.adapter_dir):
        return _push_with_card(existing, run.path, repo, private, "merged", "merged model")
    return _merge_and_push(run.path, repo, private)


def _merge_and_push(run_path: Path, repo: str, private: bool) -> str:
    # beside the run, not in /tmp: a merged model can be many gigabytes
    with tempfile.TemporaryDirectory(prefix=".push-", dir=run_path) as scratch:
        folder = merge(run_path, out=Path(scratch) / "merged")
        return _push_with_card(folder, run_path, repo, private, "merged", "merged model", kept=False)


def _push_with_card(folder: Path, run_path: Path, repo: str, private: bool, kind: str, what: str,
                    kept: bool = True) -> str:
    """Write the card again (the latest figures and evaluation, the repository in its snippet), then upload."""
    try:
        write_model_card(folder, run_path, kind, repo_id=repo)
    except (OSError, WorkbenchError) as err:  # a read-only run directory: push what is there
        warnings.warn(f"{folder / 'README.md'}: model card not updated ({err})", stacklevel=2)
    return push_folder(folder, repo, private=private, flag="push", what=what, kept=kept)


def _merged_is_current(folder: Path, adapter_dir: Path) -> bool:
    """A merged folder made from the adapter as it is now (not from an earlier adapter of the same run)."""
    try:
        return (folder / "config.json").stat().st_mtime >= (adapter_dir / "adapter_model.safetensors").stat().st_mtime
    except OSError:
        return False
