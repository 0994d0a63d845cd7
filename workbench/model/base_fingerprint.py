"""Whether a local base model folder still holds the model a run trained on.

An adapter means something only on the weights it was trained against: a folder whose weights were rewritten in
place (a merge saved over it, another checkpoint copied in) would let a resumed run continue on another base, and a
completed run pass as done for it. A run records two fingerprints of the files from_pretrained reads (the folder's
own regular files): their names, sizes, times and inodes, and a digest of every byte. The bytes are read only when
the first moved: at a run's start the digest is taken from a cache kept by the first (so the many runs on one base
hash it once), and a check reads them only where the stat differs (a copy of the same files passes; a rewrite does
not). As git does with its index, times of files written in the last seconds are not trusted (a second write in
the same tick of the clock would keep them). Files are hashed on several threads (hashlib lets go of the
interpreter lock). The run takes the fingerprint before it loads the model and checks it after: a folder written
while the run loaded it is refused.

A builtin model is the folder it was built into under the cache (a file there can be rewritten like any other);
one not built yet has no fingerprint, and looking builds nothing (the run builds it before it fingerprints it).
Hub ids (pinned by model.revision and held by the hub's own cache) have none.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from workbench.base.builtin import built_folder, cache_dir, is_builtin

CHUNK = 8 * 1024 * 1024
RACY_SECONDS = 3.0


def local_folder(path: str) -> Path | None:
    """The folder model.path names, where it is one (a builtin model's, once built)."""
    if is_builtin(path):
        return built_folder(path)
    folder = Path(path).expanduser()
    return folder if folder.is_dir() else None


def fingerprint(path: str) -> dict | None:
    """{"files": digest of names, sizes and mtimes, "content": digest of the sampled bytes} of model.path's
    folder; None where model.path is no local folder."""
    folder = local_folder(path)
    if folder is None:
        return None
    files = _files(folder)
    stats = None if _racy(folder, files) else _stat_digest(folder, files)
    return {"files": stats, "content": _content_digest(folder, files, stats)}


def changed(recorded: dict | None, path: str) -> bool:
    """Whether model.path's folder holds other bytes than when `recorded` was taken (False where nothing was
    recorded, or model.path is no local folder now: the loading names that)."""
    folder = local_folder(path)
    if not isinstance(recorded, dict) or folder is None:
        return False
    files = _files(folder)
    stats = _stat_digest(folder, files)
    if recorded.get("files") == stats:
        return False
    return recorded.get("content") != _content_digest(folder, files, stats)


def _files(folder: Path) -> list[str]:
    """The regular files of `folder` itself (through links, as a hub cache's snapshot holds them): what
    from_pretrained reads. Subfolders (a checkpoints/ of the model's own training) it never reads; hidden files,
    FIFOs and devices are left out (a FIFO would block the read)."""
    found = []
    for entry in sorted(os.listdir(folder)):
        if entry.startswith("."):
            continue
        try:
            if stat.S_ISREG(os.stat(folder / entry).st_mode):
                found.append(entry)
        except OSError:
            found.append(entry)  # unreadable now: its digest says so
    # and the shards a weights index names, wherever in the folder they lie (the loader reads them from there)
    for index in [name for name in found if name.endswith(".index.json")]:
        try:
            weight_map = json.loads((folder / index).read_text()).get("weight_map", {})
            shards = {str(v) for v in weight_map.values()} if isinstance(weight_map, dict) else set()
        except (OSError, ValueError, AttributeError):
            continue  # an index that cannot be read: the loader names it
        found.extend(sorted(name for name in shards - set(found) if _inside(folder, name)))
    return found


def _inside(folder: Path, name: str) -> bool:
    try:
        return (folder / name).resolve().is_relative_to(folder.resolve()) and (folder / name).is_file()
    except (OSError, ValueError):
        return False


def stat_digest(path: str) -> str | None:
    """The names, sizes, times and inodes of model.path's files now (None: no local folder): a run compares the
    digest it took before loading the model with the one after, and refuses any difference."""
    folder = local_folder(path)
    return None if folder is None else _stat_digest(folder, _files(folder))


def _stat_digest(folder: Path, files: list[str]) -> str:
    """Names, sizes, times, inodes: a file rewritten with its old size and time set back still has another ctime
    (which no call sets), a file put in its place another inode."""
    stats = [str(folder.resolve())]
    for name in files:
        try:
            st = os.stat(folder / name)
            stats.append([name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
        except OSError:
            stats.append([name, None])
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def _content_digest(folder: Path, files: list[str], stat_digest: str | None = None) -> str:
    """sha256 over each file's name, size and sha256; cached under the stat digest it was taken with."""
    cached = _cache_path(stat_digest) if stat_digest and not _racy(folder, files) else None
    if cached is not None and cached.is_file():
        text = cached.read_text(errors="replace").strip()
        if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
            return text
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        digests = list(pool.map(lambda name: _file_digest(folder / name), files))
    digest = hashlib.sha256()
    for name, (size, file_digest) in zip(files, digests):
        digest.update(f"{name}\0{size}\0{file_digest}\0".encode("utf-8", "surrogateescape"))
    result = digest.hexdigest()
    if cached is not None:
        try:  # renamed into place: two runs starting together each write a whole file
            cached.parent.mkdir(parents=True, exist_ok=True)
            handle, staging = tempfile.mkstemp(dir=cached.parent, prefix=".fingerprint-")
            with os.fdopen(handle, "w") as out:
                out.write(result)
            os.replace(staging, cached)
        except OSError:  # a cache that cannot be written costs a rehash next time, nothing more
            pass
    return result


def _file_digest(path: Path) -> tuple[int | None, str]:
    try:
        with open(path, "rb", opener=_nonblocking) as handle:
            digest = hashlib.sha256()
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
            return os.fstat(handle.fileno()).st_size, digest.hexdigest()
    except OSError as err:
        return None, f"unreadable: {type(err).__name__}"


def _racy(folder: Path, files: list[str]) -> bool:
    """A file written in the last seconds may be written again within the same tick of the file system's clock,
    same size and time, other bytes: its times vouch for nothing yet, and its digest is taken from the bytes."""
    now = time.time()
    for name in files:
        try:
            if now - os.stat(folder / name).st_mtime < RACY_SECONDS:
                return True
        except OSError:
            return True
    return False


def _nonblocking(path: str, flags: int) -> int:
    """Opens a file that turned into a FIFO since it was listed without waiting for a writer."""
    return os.open(path, flags | os.O_NONBLOCK)


def _cache_path(stat_digest: str | None) -> Path | None:
    return cache_dir() / "fingerprints" / stat_digest if stat_digest else None
