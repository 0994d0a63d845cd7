"""Training jobs launched from the UI: the CLI in a subprocess, tracked on disk so a reopened page finds them.

A job is `python -P -m workbench train RECIPE --no-progress` (or `launch RECIPE --nproc N`), with
`--overwrite` only when the user confirmed replacing an existing run. It is started with an argument list
(never a shell) in its own process group, with the workspace root as its working directory but never on
the import path (-P, PYTHONSAFEPATH): the installed workbench runs, not a `workbench/` planted in the
workspace. Its record lives in <root>/.workbench-ui/jobs/<name>/ (job.json, recipe.yaml, train.log),
beside the run directory, not in it. Stop sends SIGINT to the process group (the run checkpoints and
exits), a second Stop SIGTERM, a third SIGKILL once the grace period has passed. Resume starts
`train <run>/recipe.yaml --resume`, after the same path checks as a launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import workbench
from workbench.base.metrics import read_metrics
from workbench.spec.objectives import DEFAULT_OBJECTIVE, OBJECTIVES
from workbench.rundir.runs import write_json_atomic

from workbench.base.errors import WorkbenchError, printable

from .workspace import PathError, Workspace



class JobError(WorkbenchError):
    """A job cannot be started, resumed or found."""


_REGISTRIES: dict[Path, "JobRegistry"] = {}
_LOCK = threading.Lock()


@dataclass
class Job:
    name: str
    run_dir: str  # relative to the root
    command: list[str]
    pid: int
    started: float
    log: str  # relative to the root
    returncode: int | None = None
    stop_requested: float | None = None
    stops: int = 0  # Stop presses since the last start: SIGINT, then SIGTERM, then SIGKILL
    history: list[str] = field(default_factory=list)  # earlier commands of this job (start, resumes)


@dataclass
class JobStatus:
    name: str
    state: str  # running | stopping | completed | interrupted | failed | exited
    steps: int
    total_steps: int | None
    pid: int | None
    returncode: int | None
    summary: dict
    metrics: list[dict]
    run_dir: Path
    command: list[str]
    objective: str = DEFAULT_OBJECTIVE  # training.objective (workbench/spec/objectives.py)


STOP_GRACE_S = 30.0  # what a run gets to checkpoint after Stop before a third Stop may SIGKILL it


def registry_for(root: str | Path, allow_remote_code: bool = False) -> "JobRegistry":
    """One registry per workspace per server process, shared by every page and every rebuilt app."""
    workspace = Workspace(root)
    with _LOCK:
        if workspace.root not in _REGISTRIES:
            _REGISTRIES[workspace.root] = JobRegistry(workspace)
        registry = _REGISTRIES[workspace.root]
        registry.allow_remote_code = allow_remote_code
        return registry


class JobRegistry:
    def __init__(self, workspace: Workspace):
        self.ws = workspace
        self.dir = workspace.ui_dir / "jobs"
        self._procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self.allow_remote_code = False

    # -- starting -------------------------------------------------------------------------------

    def start(self, recipe, nproc: int = 1, replace: bool = False) -> Job:
        """Save the recipe beside the job record and run it through the CLI. An existing run of that name is
        replaced only with `replace` (the UI asks first); otherwise the CLI refuses to touch it."""
        run_path = self.ws.check_recipe_paths(recipe, self.allow_remote_code)
        if nproc < 1:
            raise JobError("processes: must be at least 1")
        with self._lock:
            self._refuse_if_running(recipe.name)
            folder = self.ws.ui_folder("jobs", self._folder(recipe.name).name)  # no link on the way is followed
            recipe_file = _own_file(folder, "recipe.yaml")
            recipe.save(recipe_file)
            rel = self.ws.relative(recipe_file)
            command = _command(rel, int(nproc), "--overwrite" if replace else None)
            return self._spawn(recipe.name, self.ws.relative(run_path), command, fresh_log=True)

    def resume(self, name: str) -> Job:
        """Continue a stopped run from its last complete checkpoint (`train <run>/recipe.yaml --resume`)."""
        with self._lock:
            self._refuse_if_running(name)
            job = self._read(name)
            if job is None:
                raise JobError(f"job {name}: unknown (start it first)")
            recipe = self.ws.resolve(f"{job.run_dir}/recipe.yaml", what="run recipe")
            if not recipe.is_file():
                recipe = self._folder(name) / "recipe.yaml"
            self._check_resumable(recipe, job)
            nproc = int(job.command[job.command.index("--nproc") + 1]) if "--nproc" in job.command else 1
            command = _command(self.ws.relative(recipe), nproc, "--resume")
            return self._spawn(name, job.run_dir, command, fresh_log=False, earlier=job)

    def _check_resumable(self, recipe_file: Path, job: Job) -> None:
        """The recipe a resume runs (the run's own file, which anyone with the workspace can edit) passes the
        launch's checks, and still names the job's run directory."""
        from workbench.spec.recipe import Recipe

        recipe = Recipe.load(recipe_file)
        run_path = self.ws.check_recipe_paths(recipe, self.allow_remote_code)
        if run_path != self.ws.resolve(job.run_dir, what="run directory"):
            raise JobError(f"job {job.name}: its recipe now names another run directory ({recipe.output.dir}); "
                           "launch it as a new run instead")

    def _spawn(self, name: str, run_dir: str, command: list[str], fresh_log: bool, earlier: Job | None = None) -> Job:
        folder = self._folder(name)
        log_path = _own_file(folder, "train.log")
        log_rel = self.ws.relative(log_path)  # checked before anything is written or started
        argv, env = workbench_command(command)
        with open(log_path, "w" if fresh_log else "a") as log:
            log.write(f"$ workbench {' '.join(command)}\n")
            log.flush()
            proc = subprocess.Popen(argv, cwd=self.ws.root, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self._procs[name] = proc
        history = [*earlier.history, " ".join(earlier.command)] if earlier else []
        job = Job(name, run_dir, command, proc.pid, time.time(), log_rel, history=history)
        self._write(job)
        return job

    def _refuse_if_running(self, name: str) -> None:
        job = self._read(name)
        if job is not None and self._alive(job):
            raise JobError(f"job {name} is still running: stop it first")

    # -- stopping ---------------------------------------------------------------------------------

    def stop(self, name: str) -> str:
        """Stop: SIGINT to the job's process group (the trainer finishes its step, checkpoints and exits; one
        still loading exits at once). Again: SIGTERM. A third time, once STOP_GRACE_S have passed: SIGKILL."""
        job = self._read(name)
        if job is None or not self._alive(job):
            return f"{name} is not running"
        waited = time.time() - (job.stop_requested or time.time())
        if job.stops >= 2 and waited < STOP_GRACE_S:
            return (f"{name} got SIGINT and SIGTERM {waited:.0f} s ago and is saving its checkpoint; Stop again after "
                    f"{STOP_GRACE_S:.0f} s to kill it (SIGKILL: the step in progress is lost)")
        sig = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)[min(job.stops, 2)]
        try:
            os.killpg(job.pid, sig)  # started with start_new_session: the group id is the pid
        except ProcessLookupError:
            return f"{name} has already exited"
        job.stop_requested = job.stop_requested or time.time()
        job.stops += 1
        self._write(job)
        then = {signal.SIGINT: "it saves a checkpoint and stops (Stop again: SIGTERM)",
                signal.SIGTERM: "it saves a checkpoint and stops", signal.SIGKILL: "killed"}[sig]
        return f"sent {sig.name} to {name} (process group {job.pid}); {then}"

    def wait(self, name: str, timeout: float) -> int | None:
        """Wait for a job this process started; its return code, or None on timeout."""
        proc = self._procs.get(name)
        if proc is None:
            return None
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self.status(name)  # records the return code
        return code

    # -- reading ----------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Known jobs, most recently started first."""
        if not self.dir.is_dir():
            return []
        jobs = [j for j in (self._read(p.name) for p in self.dir.iterdir() if p.is_dir()) if j is not None]
        return [j.name for j in sorted(jobs, key=lambda j: j.started, reverse=True)]

    def status(self, name: str) -> JobStatus | None:
        job = self._read(name)
        if job is None:
            return None
        alive = self._alive(job)
        run_dir = self.ws.resolve(job.run_dir, what="run directory")
        summary = _read_summary(run_dir)
        metrics = [r for r in read_metrics(run_dir / "metrics.jsonl") if isinstance(r, dict)]  # not a torn row
        steps = max((r["step"] for r in metrics if "loss" in r and _is_int(r.get("step"))), default=0)
        if alive:
            state = "stopping" if job.stop_requested else "running"
        else:
            proc = self._procs.get(name)
            if proc is not None and job.returncode is None:
                job.returncode = proc.returncode
                self._write(job)
            recorded = summary.get("status")
            state = recorded if recorded in ("completed", "interrupted", "failed") else "exited"
        recipe = _read_recipe(run_dir / "recipe.yaml") or _read_recipe(self._folder(name) / "recipe.yaml")
        total = summary.get("total_steps") or _section(recipe, "training").get("max_steps")
        return JobStatus(name, state, summary.get("steps") or steps, total, job.pid if alive else None,
                         job.returncode, summary, metrics, run_dir, job.command,
                         objective_of(summary, recipe))

    def log_tail(self, name: str, lines: int = 60) -> str:
        job = self._read(name)
        if job is None:
            return ""
        path = self.ws.resolve(job.log, what="log")
        if not path.is_file():
            return ""
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64_000))
            text = f.read().decode("utf-8", "replace")
        # a training log echoes recipe values and paths: control characters shown escaped, lines kept
        return "\n".join(printable(line) for line in text.splitlines()[-lines:])

    # -- records ----------------------------------------------------------------------------------

    def _folder(self, name: str) -> Path:
        folder = self.ws.resolve(f"{self.dir.relative_to(self.ws.root)}/{name}", what="job")
        if folder.parent != self.dir.resolve():
            raise PathError(f"job: {name} is not a job name")
        return folder

    def _read(self, name: str) -> Job | None:
        try:
            path = self._folder(name) / "job.json"
        except PathError:
            return None
        if not path.is_file():
            return None
        try:
            return Job(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            return None

    def _write(self, job: Job) -> None:
        write_json_atomic(_own_file(self._folder(job.name), "job.json"), asdict(job))

    def _alive(self, job: Job) -> bool:
        proc = self._procs.get(job.name)
        if proc is not None and proc.pid == job.pid:
            return proc.poll() is None  # our own child: poll() also reaps it
        return _pid_runs_job(job)  # started by an earlier server process


def workbench_command(command: list[str]) -> tuple[list[str], dict]:
    """(argv, environment) of `workbench COMMAND` run by the server, in the workspace as its working folder."""
    # -P: the working directory (the workspace) is not put on the import path
    argv = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "workbench", *command]
    env = dict(os.environ, PYTHONUNBUFFERED="1", GRADIO_ANALYTICS_ENABLED="False", PYTHONSAFEPATH="1")
    env.pop("WORKBENCH_UI_AUTH", None)  # the server's login is none of a job's business
    package_root = str(Path(workbench.__file__).resolve().parents[1])  # the same workbench as this server
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return argv, env


def _command(recipe: str, nproc: int, mode: str | None) -> list[str]:
    """The CLI arguments: `train RECIPE [MODE] --no-progress`, or `launch RECIPE --nproc N [MODE]` for several."""
    flags = [mode] if mode else []
    if nproc == 1:
        return ["train", recipe, *flags, "--no-progress"]
    return ["launch", recipe, "--nproc", str(nproc), *flags]


def _own_file(folder: Path, name: str) -> Path:
    """A file of the UI's own job records. A symbolic link planted there (a cloned workspace can ship one)
    is removed, never written through."""
    path = folder / name
    if path.is_symlink():
        path.unlink()
    return path


def _pid_runs_job(job: Job) -> bool:
    """Whether the recorded pid is still this job: a group leader of its own (never this server's group)
    whose command line ends with the job's workbench command. A job.json that names pid 0, this server
    or any other process is not signalled."""
    pid = job.pid
    if not isinstance(pid, int) or pid <= 1:
        return False
    try:
        if os.getpgid(pid) != pid or pid == os.getpgid(0):
            return False
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, ProcessLookupError):
        return False
    argv = [a for a in argv if a]
    command = [str(c) for c in job.command]
    return len(argv) > len(command) and argv[-len(command):] == command and "workbench" in argv[:-len(command)]


def _read_summary(run_dir: Path) -> dict:
    try:
        data = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return _section(data, "summary")


def _read_recipe(path: Path) -> dict:
    """A recipe file as a mapping; {} when it is missing, unreadable or not a mapping."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _section(data, name: str) -> dict:
    value = data.get(name) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def objective_of(summary: dict, recipe: dict) -> str:
    """What a run trains (training.objective): its summary says so once it has finished, its recipe from the
    start; the default when neither does (the schema's default, and every run from before preference training)."""
    summary = summary if isinstance(summary, dict) else {}
    for value in (summary.get("objective"), _section(recipe, "training").get("objective")):
        if value in OBJECTIVES:
            return value
    return DEFAULT_OBJECTIVE
