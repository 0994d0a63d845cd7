"""Run directories: the files a run writes, and the readers every comparison (CLI, API, UI) uses.

runs/<name>/recipe.yaml, run.json, metrics.jsonl, adapter/, checkpoints/step-N/ (RUN_ENTRIES: all of them)
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.base.errors import WorkbenchError, escaped
from workbench.base.metrics import finite_json, read_metrics
from workbench.hardware.current import gpu_names
from workbench.rundir.run_summary import HEADLINE, RunSummary
from workbench.spec.adapter_init import EVA_FILE
from workbench.spec.objectives import objective_of
from workbench.spec.recipe import Recipe

CHECKPOINT_PREFIX = "step-"
# What a training run writes into its directory besides run.json (its trackers' folders included), and the
# names of its writes in progress (staged adapters, replaced ones, temporary records, an interrupted
# replacement). An --overwrite removes these and nothing else: notes, `workbench merge` and `export`
# folders and any other file of the user's stay.
RUN_ENTRIES = ("checkpoints", "adapter", "model", "metrics.jsonl", "recipe.yaml", "tensorboard", "wandb", "mlruns",
               "STOP", EVA_FILE)
# The exact names of those writes in progress, so that a file of the user's that merely looks alike (.tmp-notes)
# is never taken for one: a staged or replaced adapter or model (train.save_adapter, replace_folder), an
# --overwrite's aside folder (.replaced-PID-XXXXXXXX, tempfile's 8 characters), a record or metrics file being
# written, the output check's probe (.workbench-write-test-XXXXXXXX).
LEFTOVERS = re.compile(r"\.(tmp|old)-(adapter|model)|\.replaced-\d+-[a-z0-9_]{8}|\.run\.json\.tmp|metrics\.tmp"
                       r"|\.workbench-write-test-[a-z0-9_]{8}")


def is_leftover(name: str) -> bool:
    """Whether `name` is one of a run's writes in progress (LEFTOVERS), which an --overwrite removes."""
    return LEFTOVERS.fullmatch(name) is not None


def is_run_record(data) -> bool:
    """Whether a run.json's content is a record this workbench wrote: a summary with its status and the
    environment (every run writes both as it starts), or the bare record an --overwrite puts in place first."""
    if not isinstance(data, dict) or not isinstance(data.get("summary"), dict):
        return False
    if data == {"summary": {"status": "running"}}:  # RunDir.clear's record of the new run, before it starts
        return True
    return isinstance(data["summary"].get("status"), str) and isinstance(data.get("env"), dict)


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(finite_json(data), indent=2, default=str, allow_nan=False) + "\n")
    os.replace(tmp, path)


def replace_folder(staging: Path, target: Path) -> None:
    """Put a completely written folder in place of `target` (renames only; the old one is removed last)."""
    old = target.with_name(f".old-{target.name}")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


class RunDir:
    """Paths inside one run directory, and the small amount of logic about them."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    recipe = property(lambda self: self.path / "recipe.yaml")
    run_json = property(lambda self: self.path / "run.json")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    adapter = property(lambda self: self.path / "adapter")
    model = property(lambda self: self.path / "model")  # a full fine-tune's whole model, instead of adapter/
    merged = property(lambda self: self.path / "merged")  # `workbench merge`'s default output
    stop_request = property(lambda self: self.path / "STOP")  # `workbench stop`: checkpoint and end at the next step
    checkpoints = property(lambda self: self.path / "checkpoints")

    def request_stop(self) -> None:
        """Write the stop request (`workbench stop`), never through a link planted in its place."""
        fd = os.open(self.stop_request, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"requested by pid {os.getpid()}\n")

    def claim(self, resume: bool, overwrite: bool) -> None:
        """Take the run directory for this process (a lock held until it exits) and refuse what would clobber
        a run by mistake: a folder that holds one is taken only to continue it (`resume`) or replace it
        (`overwrite`). Deletes nothing: an --overwrite clears the folder later (`clear`), once the new recipe,
        data and model have been checked. Whether a resume can continue the run is resume.claim's answer."""
        exists = self.holds_files()
        if exists and not (resume or overwrite):
            raise WorkbenchError(
                f"{escaped(self.path)} already holds a run: pass --resume to continue it or --overwrite to replace it")
        self._created = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # a dangling symbolic link, a name too long, no permission
            raise WorkbenchError(f"{escaped(self.path)}: cannot create the run directory "
                                 f"({err.strerror or err})") from None
        self._lock = RunLock(self.path)
        self._lock.acquire()
        if exists and (overwrite or self.run_json.exists()):
            self.check_record()

    def holds_files(self) -> bool:
        """Whether the run directory exists with anything in it."""
        try:
            return self.path.exists() and any(self.path.iterdir())
        except OSError as err:
            raise WorkbenchError(f"{escaped(self.path)}: {err.strerror or err}") from None

    def completed(self) -> bool:
        """Whether run.json records the run as completed."""
        return self.read_json().get("summary", {}).get("status") == "completed"

    def drop_cut_short_checkpoints(self) -> None:
        """Remove the checkpoint writes a crash cut short (never published, so never resumed from)."""
        for stale in self.checkpoints.glob(f".tmp-{CHECKPOINT_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)

    def check_record(self) -> None:
        """Refuse a folder whose run.json another tool wrote: its files are not a run's to continue or replace."""
        try:
            data = json.loads(self.run_json.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            self.release()
            if not isinstance(err, FileNotFoundError):
                raise WorkbenchError(f"{escaped(self.run_json)}: unreadable ({escaped(err)})") from None
            raise WorkbenchError(f"{escaped(self.run_json)}: not a workbench run record (missing); only a run the workbench "
                                 "wrote is continued or replaced: move the folder's files or choose another "
                                 "output.dir") from None
        if not is_run_record(data):
            self.release()
            raise WorkbenchError(f"{escaped(self.run_json)}: not a workbench run record (no summary with a status and env); "
                                 "only a run the workbench wrote is continued or replaced: move the folder's files "
                                 "or choose another output.dir")

    def clear(self) -> list[str]:
        """Make the (claimed) folder ready for a new run: remove what the earlier run wrote (RUN_ENTRIES, the
        record, and what writes cut short left) and keep everything else (notes, exports), naming it in a
        warning. Returns the kept names. The folder itself stays: it carries the lock.

        Safe against a kill at any point: the earlier run's entries go aside into a folder inside this one by
        renames, in an order where the folder is always either the earlier run (less its checkpoints) or the
        record of a new run that died starting (status running, no checkpoint to resume):
          1. the checkpoints and leftovers go aside;
          2. run.json is replaced in one rename by the new run's record (a copy of the old one goes aside);
          3. the rest of the earlier run goes aside; then the aside folder is deleted.
        A rename that fails puts everything back and says so."""
        ours, kept = self.entries()
        first = [p for p in ours if p.name == "checkpoints" or p.name not in (*RUN_ENTRIES, self.run_json.name)]
        rest = [p for p in ours if p.name in RUN_ENTRIES and p.name != "checkpoints"]
        aside: Path | None = None
        moved: list[Path] = []
        committed = False
        try:
            if ours:
                aside = Path(tempfile.mkdtemp(prefix=f".replaced-{os.getpid()}-", dir=self.path))
            for child in first:
                os.rename(child, aside / child.name)
                moved.append(child)
            if self.run_json.exists():
                shutil.copy2(self.run_json, aside / self.run_json.name)
            write_json_atomic(self.run_json, {"summary": {"status": "running"}})  # the new run, from here on
            committed = True
            for child in rest:
                os.rename(child, aside / child.name)
                moved.append(child)
        except OSError as err:
            self.run_json.with_name(f".{self.run_json.name}.tmp").unlink(missing_ok=True)
            if committed and aside is not None and (aside / self.run_json.name).exists():
                os.replace(aside / self.run_json.name, self.run_json)
            elif committed:
                self.run_json.unlink(missing_ok=True)
            for child in reversed(moved):
                os.rename(aside / child.name, child)
            if aside is not None:
                (aside / self.run_json.name).unlink(missing_ok=True)  # the copy, when the original stayed
                aside.rmdir()  # empty now; never deleted with anything in it
            raise WorkbenchError(f"{escaped(self.path)}: cannot replace the earlier run ({err.strerror or err}: "
                                 f"{err.filename}); it is left as it was") from None
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)  # what cannot be deleted stays aside, out of the new run's way
        names = [f"{p.name}/" if p.is_dir() else p.name for p in kept]
        if names:
            import warnings

            warnings.warn(f"{escaped(self.path)}: --overwrite replaced the earlier run and kept what it did not write: "
                          f"{', '.join(names)}", stacklevel=2)
        return names

    def entries(self) -> tuple[list[Path], list[Path]]:
        """(what a run wrote here, everything else), each sorted by name."""
        ours, others = [], []
        for child in sorted(self.path.iterdir()):
            name = child.name
            is_ours = name in RUN_ENTRIES or name == self.run_json.name or is_leftover(name)
            (ours if is_ours else others).append(child)
        return ours, others

    def release(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            if getattr(self, "_created", False):  # refused before writing anything (bad data, say): no empty folder
                with contextlib.suppress(OSError):
                    self.path.rmdir()  # only ever an empty folder, and while the lock keeps other runs out
            lock.release()
            self._lock = None

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{CHECKPOINT_PREFIX}{step}"

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """Checkpoints that finished writing (a half-written one still has its temporary name)."""
        if not self.checkpoints.exists():
            return []
        found = []
        for child in self.checkpoints.iterdir():
            number = child.name.removeprefix(CHECKPOINT_PREFIX)
            if child.is_dir() and child.name.startswith(CHECKPOINT_PREFIX) and number.isascii() and number.isdigit():
                found.append((int(number), child))
        return sorted(found)

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def staging_checkpoint(self, step: int) -> Path:
        return self.checkpoints / f".tmp-{CHECKPOINT_PREFIX}{step}"

    def publish_checkpoint(self, step: int, keep_last: int) -> None:
        """Rename the staged checkpoint into place (atomic), then drop the oldest beyond keep_last."""
        final = self.checkpoint(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(self.staging_checkpoint(step), final)
        for _, old in self.complete_checkpoints()[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def read_json(self) -> dict:
        if not self.run_json.exists():
            return {}
        try:
            data = json.loads(self.run_json.read_text())
        except (OSError, ValueError) as err:
            raise WorkbenchError(f"{escaped(self.run_json)}: unreadable ({escaped(err)})") from None
        if not isinstance(data, dict) or not isinstance(data.get("summary", {}), dict):
            raise WorkbenchError(f"{escaped(self.run_json)}: not a run record (expected a mapping with a summary mapping)")
        return data

    def update_json(self, **sections: Any) -> None:
        data = self.read_json()
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key].update(value)
            else:
                data[key] = value
        write_json_atomic(self.run_json, data)


class RunLock:
    """One process at a time per run directory: an exclusive flock on the folder itself. The kernel drops it
    when the holder exits, however it exits (kill -9 leaves no stale lock to clean up)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WorkbenchError(f"{escaped(self.path)} is in use by another running process (a run is training into "
                                 "it); wait for it to finish or stop it first") from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def in_use(path: str | Path) -> bool:
    """Whether a live process holds the run directory (its lock)."""
    lock = RunLock(Path(path))
    try:
        lock.acquire()
    except (WorkbenchError, OSError):
        return Path(path).is_dir()
    lock.release()
    return False


def process_owner() -> dict:
    """This process as run.json records its writer: host, pid and the pid's start time (a pid is reused)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_started(os.getpid())}


def _process_started(pid: int) -> float | None:
    try:
        import psutil

        return round(psutil.Process(pid).create_time(), 2)
    except Exception:  # noqa: BLE001  gone, or no psutil: the pid alone decides
        return None


def owner_gone(summary: dict) -> bool:
    """Whether the process a run.json names as its writer is gone: only decidable on the writer's own host
    (elsewhere the run directory's lock tells, where the storage shares locks)."""
    owner = summary.get("owner")
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    started = _process_started(owner["pid"])
    if started is None:
        try:
            os.kill(owner["pid"], 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    return owner.get("started") is not None and abs(started - owner["started"]) > 1.0  # the pid is another's now


def environment(accelerator) -> dict:
    import accelerate
    import datasets
    import peft
    import torch
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "peft": peft.__version__,
                "accelerate": accelerate.__version__, "datasets": datasets.__version__}
    try:
        import bitsandbytes

        versions["bitsandbytes"] = bitsandbytes.__version__
    except Exception:  # optional on some machines; importing it can fail on odd CUDA setups
        pass
    device = accelerator.device
    devices = gpu_names() if device.type == "cuda" else [platform.processor() or platform.machine()]
    return {"versions": versions, "device": str(device), "device_type": device.type, "devices": devices,
            "hostname": socket.gethostname(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "world_size": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type)}


@dataclass
class Run:
    """A finished or running run, read back from its directory."""

    path: Path
    recipe: dict
    summary: dict
    env: dict
    metrics: list[dict] = field(repr=False, default_factory=list)
    evaluation: dict = field(repr=False, default_factory=dict)  # from `workbench evaluate`

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def figures(self) -> RunSummary:
        """The summary read by attribute (`run.figures.peak_memory_mb`)."""
        return RunSummary.read(self.summary)

    @property
    def dir(self) -> RunDir:
        """Every path inside the run directory."""
        return RunDir(self.path)

    @property
    def adapter_dir(self) -> Path:
        return self.dir.adapter

    @property
    def history(self):
        """metrics.jsonl as a pandas DataFrame: one row per logged step (eval rows have eval_loss)."""
        return metrics_frame(self.metrics)

    def plot(self):
        """Loss (with eval points) and tokens/s over the steps: a matplotlib Figure."""
        from workbench.base.charts import run_figure

        return run_figure(self.name, self.metrics)

    def _repr_html_(self) -> str:
        return summary_html(self.name, self.summary)

    def checked_recipe(self):
        """The run's recipe.yaml read through the schema (`Recipe.from_dict`): what every loader of the run's model
        reads (in the raw mapping, the text "no" for trust_remote_code is a true value to bool())."""
        if not self.recipe:
            raise WorkbenchError(f"{escaped(self.path)}: the run has no readable recipe.yaml (it names the model to "
                                 f"load)")
        return Recipe.from_dict(self.recipe, source=str(self.path / "recipe.yaml"))


@dataclass
class TrainResult:
    """What `workbench.train` / `workbench.launch` return: the run directory, its summary and metrics."""

    run_dir: Path
    summary: dict
    metrics: Any = field(repr=False, default=None)  # pandas DataFrame, one row per logged step

    @property
    def run(self) -> Run:
        return load_run(self.run_dir)

    def plot(self):
        """Loss (with eval points) and tokens/s over the steps: a matplotlib Figure."""
        from workbench.base.charts import run_figure

        return run_figure(Path(self.run_dir).name, self.metrics.to_dict("records") if self.metrics is not None else [])

    def _repr_html_(self) -> str:
        return summary_html(Path(self.run_dir).name, self.summary)


def read_result(path: str | Path, summary: dict | None = None) -> TrainResult:
    """A run's result read back from its files (`summary`: instead of run.json's, e.g. a rank other than 0's)."""
    run = RunDir(path)
    return TrainResult(run.path, run.read_json()["summary"] if summary is None else summary,
                       metrics_frame(read_metrics(run.metrics)))


def metrics_frame(rows: list[dict]):
    import pandas as pd

    frame = pd.DataFrame(rows)
    return frame if "step" not in frame else frame.reset_index(drop=True)


def summary_html(name: str, summary: dict) -> str:
    """A run's headline figures as a small HTML table, for notebooks."""
    import html

    figures = RunSummary.read(summary)
    shown = [(label, getattr(figures, name)) for name, label in HEADLINE]
    cells = "".join(f"<tr><th style='text-align:left'>{label}</th><td>{html.escape(_shown(value))}</td></tr>"
                    for label, value in shown if value is not None)
    return f"<div><b>run {html.escape(name)}</b><table>{cells}</table></div>"


def _shown(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def load_run(path: str | Path) -> Run:
    """Read a run directory back (recipe, summary, environment, metrics, evaluation)."""
    run_dir = RunDir(path)
    try:
        if not run_dir.run_json.exists():
            raise WorkbenchError(f"{escaped(run_dir.path)}: not a run directory (no run.json)")
    except OSError as err:  # a name too long
        raise WorkbenchError(f"{escaped(run_dir.path)}: {err.strerror or err}") from None
    import yaml

    try:
        data = run_dir.read_json()
        recipe = (yaml.safe_load(run_dir.recipe.read_text()) if run_dir.recipe.exists() else {}) or {}
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise WorkbenchError(f"{escaped(run_dir.path)}: unreadable run files ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict) or not isinstance(recipe, dict):
        raise WorkbenchError(f"{escaped(run_dir.path)}: unreadable run files (run.json or recipe.yaml is not a "
                             f"mapping)")
    summary = data.get("summary") if isinstance(data.get("summary"), dict) else {}
    if summary.get("status") == "running" and (owner_gone(summary) or not in_use(run_dir.path)):
        summary = {**summary, "status": "died"}  # its process is gone without a word (kill -9, power loss)
    env, evaluation = data.get("env"), data.get("evaluation")
    return Run(run_dir.path, recipe, summary, env if isinstance(env, dict) else {}, read_metrics(run_dir.metrics),
               evaluation if isinstance(evaluation, dict) else {})


def list_runs(root: str | Path = "runs") -> list[Run]:
    """Every run directory directly under `root`, sorted by name."""
    import warnings

    root = Path(root)
    if not root.exists():
        return []
    if not root.is_dir():
        raise WorkbenchError(f"{escaped(root)}: not a folder of runs")
    runs = []
    for child in sorted(root.iterdir()):
        if (child / "run.json").exists():
            try:
                runs.append(load_run(child))
            except WorkbenchError as err:  # one damaged run must not hide the others
                warnings.warn(f"skipped {err}", stacklevel=2)
    return runs


COMPARE_COLUMNS = ["run", "status", "method", "objective", "r", "lr", "precision", "strategy", "world_size", "steps",
                   "tokens_per_s", "peak_memory_mb", "predicted_peak_memory_mb", "mfu", "wall_s", "final_loss",
                   "eval_loss_first", "eval_loss_final", "reward_margin_final", "reward_accuracy_final",
                   "eval_reward_margin_final", "eval_reward_accuracy_final", "reward_final", "generation_share_final",
                   "base_eval_loss", "tuned_eval_loss",
                   "base_contains", "tuned_contains", "tuned_exact_match"]


def compare_rows(runs: list[Run]) -> list[dict]:
    rows = []
    for run in runs:
        s = run.figures
        rows.append({
            "run": run.name, "status": s.status,
            "method": _section(run.recipe, "adapter").get("method"), "r": _section(run.recipe, "adapter").get("r"),
            "objective": objective_of(s.objective or _section(run.recipe, "training").get("objective")).name,
            "lr": _section(run.recipe, "training").get("lr"),
            "precision": _section(run.recipe, "training").get("mixed_precision"), "strategy": s.strategy,
            "world_size": s.world_size, "steps": s.steps, "tokens_per_s": s.tokens_per_s,
            "peak_memory_mb": s.peak_memory_mb, "predicted_peak_memory_mb": s.predicted_peak_memory_mb,
            "mfu": s.mfu, "wall_s": s.wall_s, "final_loss": s.final_loss,
            "eval_loss_first": s.eval_loss_first, "eval_loss_final": s.eval_loss_final,
            # preference runs (training.objective dpo/orpo): the last logged and the final held-out figures
            **{key: s.preference_final.get(key) for key in ("reward_margin_final", "reward_accuracy_final")},
            # GRPO runs: the last logged reward, and the share of a step spent sampling answers
            **{key: s.preference_final.get(key) for key in ("reward_final", "generation_share_final")},
            **{key: s.eval_final.get(key) for key in ("eval_reward_margin_final", "eval_reward_accuracy_final")},
            **_evaluation_cells(run.evaluation),
        })
    return rows


def _section(data: dict, name: str) -> dict:
    """A section of a hand-edited file, {} when it is missing or not a mapping."""
    value = data.get(name) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}


def _evaluation_cells(evaluation: dict) -> dict:
    """The scores of `workbench evaluate`, base beside tuned (None where not evaluated)."""
    base, tuned = _section(evaluation, "base"), _section(evaluation, "tuned")
    return {"base_eval_loss": base.get("eval_loss"), "tuned_eval_loss": tuned.get("eval_loss"),
            "base_contains": base.get("contains"), "tuned_contains": tuned.get("contains"),
            "tuned_exact_match": tuned.get("exact_match")}
