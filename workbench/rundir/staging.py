"""Outputs written under a name of their writer's own beside their target, then renamed into place; and the
leftovers of writers that were killed before the rename (a merged model can be large)."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from workbench.hardware.current import process_alive


def merge_staging_folder(parent: Path) -> Path:
    """A new folder in `parent` whose name is this process's own (.merging-PID-XXXXXXXX), after removing those of
    merges and exports whose process is gone."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(parent)
    # os.mkdir, not tempfile.mkdtemp: the folder is renamed into place as the user's output, and mkdtemp's 0700
    # would make it private where the rest of the user's files follow the umask
    while True:
        folder = parent / f".merging-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def give_default_modes(folder: Path) -> None:
    """The files under `folder` (made by os.mkdir, so its mode is 0777 less the umask) with the mode a plain
    open() gives (0666 less the umask): safetensors writes through a private temporary file, and its 0600 would
    keep a model that is shared by its folder's mode readable by its owner alone."""
    mode = folder.stat().st_mode & 0o666
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def remove_leftovers(folder: Path) -> None:
    """Temporary merges and files of exports whose process is gone (killed): a merged model can be large."""
    for path in [*folder.glob(".merging-*"), *folder.glob(".*.gguf.*.tmp")]:
        pid = _writer_pid(path.name)
        if pid is not None and pid != os.getpid() and not process_alive(pid):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _writer_pid(name: str) -> int | None:
    parts = name.removeprefix(".merging-").split("-") if name.startswith(".merging-") else name.split(".")[-3:-2]
    return int(parts[0]) if parts and parts[0].isascii() and parts[0].isdigit() else None
