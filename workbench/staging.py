"""Outputs written under a name of their writer's own beside their target, then renamed into place; and the
leftovers of writers that were killed before the rename (a merged model can be large)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .hardware.current import process_alive


def merge_staging_folder(parent: Path) -> Path:
    """A new folder in `parent` whose name is this process's own (.merging-PID-XXXXXXXX), after removing those of
    merges and exports whose process is gone."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(parent)
    return Path(tempfile.mkdtemp(prefix=f".merging-{os.getpid()}-", dir=parent))


def remove_leftovers(folder: Path) -> None:
    """Temporary merges and files of exports whose process is gone (killed): a merged model can be large."""
    for path in [*folder.glob(".merging-*"), *folder.glob(".*.gguf.*.tmp")]:
        pid = _writer_pid(path.name)
        if pid is not None and pid != os.getpid() and not process_alive(pid):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _writer_pid(name: str) -> int | None:
    parts = name.removeprefix(".merging-").split("-") if name.startswith(".merging-") else name.split(".")[-3:-2]
    return int(parts[0]) if parts and parts[0].isdigit() else None
