"""SLURM: the sbatch script `workbench slurm` writes (and submits), and a job requeueing itself after a checkpoint.

The script starts one `workbench launch` per node with srun; that launcher starts the node's ranks with torchrun.
What makes a job survive preemption and time limits without its command ever being edited:
  --requeue            SLURM may put the job back in the queue (preemption, a failed node, `scontrol requeue`);
  --open-mode=append   a requeued job appends to its log instead of truncating it;
  --signal=USR1@S      S seconds before the time limit every rank gets SIGUSR1, checkpoints at the step's end, and
                       rank 0 runs `scontrol requeue $SLURM_JOB_ID` (workbench launch --requeue);
  --resume auto        the first start trains from scratch, every later one resumes the last checkpoint;
  a rendezvous port derived from SLURM_JOB_ID, so that two jobs sharing a node never collide.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from workbench.base.errors import RecipeError, WorkbenchError
from workbench.spec.recipe import Recipe

PORT_BASE, PORT_SPAN = 10000, 20000  # below Linux's ephemeral ports (32768 and up)


def requeue_wanted_for(signum: int) -> bool:
    """A stop by the time-limit warning (SIGUSR1, or a configured signal) requeues; SIGTERM is a cancel or SLURM's
    own preemption (which requeues by itself) and SIGINT is a person: neither does."""
    return signum not in (signal.SIGINT, signal.SIGTERM)


def check_requeue_possible(env=None) -> None:
    """--requeue needs a SLURM job to requeue and scontrol to do it: said before anything trains."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID", "").strip():
        raise RecipeError("--requeue: not inside a SLURM job (SLURM_JOB_ID is not set); it requeues the job that "
                          "runs it")
    if shutil.which("scontrol") is None:
        raise RecipeError("--requeue: scontrol is not on PATH (SLURM's client commands); install slurm-client or "
                          "run on a node of the cluster")


def requeue_self() -> str:
    """Put this job back in SLURM's queue (it continues with --resume auto). Returns a line to print."""
    job = os.environ["SLURM_JOB_ID"]
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if done.returncode:
        return f"warning: scontrol requeue {job} failed: {(done.stderr or done.stdout).strip()[:300]}"
    return f"requeued SLURM job {job}: it continues from the checkpoint when it starts again"


# sbatch options the script sets itself, and the flag of this command that sets each
OWN_OPTIONS = {"--cpus-per-task": "--cpus-per-task", "--nodes": "--nodes", "--ntasks-per-node": "--nproc-per-node",
               "--gpus-per-node": "--gpus-per-node", "--output": "output.dir=...", "--open-mode": "(always append)",
               "--signal": "--signal-before", "--time": "--time", "--partition": "--partition",
               "--account": "--account", "--job-name": "name=...", "--requeue": "(always requeue)",
               "--no-requeue": "(always requeue)"}
# options the script cannot run under, and why
REFUSED_OPTIONS = {"--array": "each task of an array would be a copy of the one run, all writing one run directory",
                   "--error": "the job's one log (beside the run directory) holds both output and errors",
                   "--export-file": "the job runs in the environment it was submitted from; give variables as "
                                    "--export=ALL,NAME=value",
                   "--get-user-env": "the job runs in the environment it was submitted from (the cache, HF_HOME and "
                                     "offline settings the run was checked with), not a login shell's"}
# --export is accepted only as ALL (the default) with variables added: NONE, or a list alone, would start the job
# without the environment it was submitted from
EXPORT = "--export"
QUOTING = "\"'\\"  # what sbatch removes from an #SBATCH line as it reads it
SIGNAL_BEFORE_MAX = 65535  # SLURM keeps --signal's seconds in 16 bits
SCRIPT_MARK = "#!/bin/bash\n# workbench slurm"  # how a script this command wrote begins


@dataclass
class SbatchPlan:
    script: str
    path: Path
    log: Path


def write_sbatch(recipe_path: str | Path, overrides: list[str], *, nodes: int, gpus_per_node: int,
                 nproc_per_node: int | None = None, cpus_per_task: int | None = None, time: str | None = None,
                 partition: str | None = None, account: str | None = None, signal_before_s: int = 120,
                 script: str | Path | None = None, extra: list[str] | None = None) -> SbatchPlan:
    """The sbatch script for a recipe (checked first: a bad recipe fails here, not in the queue), written."""
    if nodes < 1:
        raise RecipeError(f"--nodes: must be at least 1, got {nodes}")
    if gpus_per_node < 0:
        raise RecipeError(f"--gpus-per-node: must be 0 or more, got {gpus_per_node}")
    nproc = nproc_per_node if nproc_per_node is not None else max(1, gpus_per_node)
    if nproc < 1:
        raise RecipeError(f"--nproc-per-node: must be at least 1, got {nproc}")
    # SLURM gives a task one CPU unless told otherwise, and clusters pin tasks to theirs: every rank on one core
    cpus = nproc if cpus_per_task is None else cpus_per_task
    if cpus < nproc:
        raise RecipeError(f"--cpus-per-task: {cpus} CPUs for {nproc} processes per machine; give each process at "
                          f"least one (--cpus-per-task {nproc} or more)")
    if not 0 <= signal_before_s <= SIGNAL_BEFORE_MAX:
        raise RecipeError(f"--signal-before: seconds from 0 to {SIGNAL_BEFORE_MAX}, got {signal_before_s}")
    # each value lands on a line of a shell script: a line break (or any control character) would start a command
    for flag, value in (("RECIPE", str(recipe_path)), *(("key=value", o) for o in overrides), ("--time", time),
                        ("--partition", partition), ("--account", account), ("--script", script),
                        *(("--sbatch-arg", a) for a in (extra or []))):
        if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in str(value)):
            raise RecipeError(f"{flag}: {str(value)!r} holds a line break or control character, which an sbatch "
                              "script cannot carry")
    for flag, value in (("--time", time), ("--partition", partition), ("--account", account)):
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise RecipeError(f"{flag}: one word without spaces, got {value!r}")
    for arg in extra or []:
        _check_extra(arg)
    recipe = Recipe.load(recipe_path, overrides)
    run_dir = Path(recipe.run_dir).absolute()
    if any(ord(c) < 32 for c in str(run_dir)):
        raise RecipeError(f"output.dir: {str(run_dir)!r} holds a line break or control character, which an sbatch "
                          "script cannot carry")
    path = Path(script) if script else run_dir.with_name(run_dir.name + ".sbatch")
    log = run_dir.with_name(run_dir.name + "-%j.log")  # beside the run directory: a run's folder holds only the run
    launch = [sys.executable, "-m", "workbench", "launch", str(Path(recipe_path).absolute()), *overrides,
              "--nproc", str(nproc), "--resume", "auto", "--requeue"]
    inner = (shlex.join(launch) + ' --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID"'
             ' --master "$MASTER_ADDR:$MASTER_PORT"')
    lines = [f"{SCRIPT_MARK} {shlex.join([str(recipe_path), *overrides])}",
             f"#SBATCH --job-name={recipe.name}", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1"]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    for flag, value in (("cpus-per-task", cpus), ("time", time), ("partition", partition),
                        ("account", account)):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={value}")
    if any(c.isspace() for c in str(log)):  # sbatch reads a directive's value up to the first space
        raise RecipeError(f"output.dir: {run_dir} holds a space, which an #SBATCH --output line cannot carry; "
                          "choose a folder without one")
    lines += [f"#SBATCH --output={log}", "#SBATCH --open-mode=append", "#SBATCH --requeue"]
    if signal_before_s:
        lines.append(f"#SBATCH --signal=USR1@{signal_before_s}")
    lines += [f"#SBATCH {arg}" for arg in (extra or [])]
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(str(Path.cwd()))}",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f"export MASTER_PORT=$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))  # the job's own rendezvous port",
        'echo "job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST at $(date -Is)"',
        f"srun --kill-on-bad-exit=1 bash -c {shlex.quote('exec ' + inner)}",
    ]
    text = "\n".join(lines) + "\n"
    if path.exists() and not (path.is_file() and path.read_text(errors="replace").startswith(SCRIPT_MARK)):
        raise RecipeError(f"--script: {path} exists and is not a script `workbench slurm` wrote; choose a new path")
    try:
        # SLURM opens the log before the job's first line runs and never makes its folder: a job whose log
        # folder is missing (a first run, its script written elsewhere) would end at once, with no log at all
        log.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RecipeError(f"output.dir: cannot create {log.parent} for the job's log ({err.strerror or err})") from None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as err:
        raise RecipeError(f"--script: cannot write {path} ({err.strerror or err})") from None
    return SbatchPlan(text, path, log)


def _check_extra(arg: str) -> None:
    """Refuse an --sbatch-arg that would set an option the script sets itself: a later #SBATCH line wins, and it
    would undo what the script needs. sbatch reads `--opt=v` and `--opt v` alike and takes any unique prefix of a
    long option for the option (`--sig` is --signal), so every prefix of the script's own options is refused.
    Short options (-o, -J, -t, ...) are refused outright: several stand for the script's own."""
    if not arg.startswith("--"):
        raise RecipeError(f"--sbatch-arg: an sbatch option such as --qos=high (its long form), got {arg!r}")
    # sbatch unquotes an #SBATCH line as a shell would (`--"time"=1` is --time, `\--signal` is --signal): rather
    # than guess its parser's every rule, the characters it reads that way are not accepted
    if any(c in arg for c in QUOTING):
        raise RecipeError(f"--sbatch-arg: {arg!r} holds a quote or a backslash, which sbatch removes as it reads "
                          "the #SBATCH line (hiding the option it sets); give the option without them")
    # sbatch reads every option on an #SBATCH line: `--qos=high --signal=X` sets both
    words = arg.split()
    for i, word in enumerate(words):
        if word.startswith("-"):
            option, _, value = word.partition("=")
            _check_option(option, arg, value or (words[i + 1] if i + 1 < len(words) else ""))


def _check_option(option: str, arg: str, value: str) -> None:
    if not option.startswith("--"):
        raise RecipeError(f"--sbatch-arg: {arg!r} holds the short option {option}; give sbatch options in their "
                          "long form (--qos=high)")
    own = next((name for name in OWN_OPTIONS if name.startswith(option)), None)
    if own is not None:
        what = f"{own} is" if option == own else f"{option} abbreviates or overrides {own}, which is"
        raise RecipeError(f"--sbatch-arg: {what} set by the script itself; use `workbench slurm "
                          f"{OWN_OPTIONS[own]}` instead")
    if EXPORT.startswith(option) and len(option) >= len("--exp"):  # (shorter prefixes are ambiguous to sbatch)
        if value.split(",", 1)[0].upper() != "ALL":
            raise RecipeError(f"--sbatch-arg: {arg!r} would start the job without the environment it was submitted "
                              "from (the cache, HF_HOME and offline settings the run was checked with); give "
                              "--export=ALL,NAME=value to add variables")
        return
    refused = next((name for name in REFUSED_OPTIONS if name.startswith(option)), None)
    if refused is not None:
        what = refused if option == refused else f"{option} (abbreviating {refused})"
        raise RecipeError(f"--sbatch-arg: {what} is not accepted: {REFUSED_OPTIONS[refused]}")


def submit(path: Path) -> str:
    """sbatch the script; the job id."""
    if shutil.which("sbatch") is None:
        raise RecipeError("--submit: sbatch is not on PATH (SLURM's client commands); install slurm-client or "
                          "submit from the cluster's login node")
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode:
        raise WorkbenchError(f"sbatch {path}: {(done.stderr or done.stdout).strip()[:500]}")
    return done.stdout.strip().split(";")[0]
