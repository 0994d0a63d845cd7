"""`workbench launch`: build, print and run the `accelerate launch` command for a recipe.

The command starts N processes per machine with torchrun (through `accelerate launch --multi_gpu`);
each process runs `workbench train`, which builds the strategy's plugin from the recipe. That route
works on GPUs and on CPUs (gloo) alike; routes such as `accelerate launch --cpu` silently start one
process, which `workbench train` would then detect and refuse.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from workbench.base.errors import RecipeError, WorkbenchError
from workbench.distributed.cluster_env import RANK_VARIABLES, check_host, check_launch_env
from workbench.distributed.stopping import STOP_SIGNAL_ENV, parse_signal, warning_signals
from workbench.distributed.trackers import check_tracker_packages
from workbench.hardware.current import available_cpus, gpu_count, local_kind
from workbench.hardware.precision import resolve as resolve_precision
from workbench.spec.recipe import Recipe
from workbench.spec.strategies import FSDP, ZERO2, schedule_problem


@dataclass
class LaunchPlan:
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    run_dir: Path | None = None
    nproc: int = 1  # processes on this machine
    nnodes: int = 1
    master: str = ""
    startup_timeout_s: float = 0
    unset: list[str] = field(default_factory=list)  # stale launcher variables the processes must not inherit

    def shell(self) -> str:
        words = ["env", *(f"-u {name}" for name in self.unset)] if self.unset else []
        words += [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*words, shlex.join(self.command)])

    def environment(self) -> dict[str, str]:
        """This process's environment as the launched processes get it."""
        return {**{k: v for k, v in os.environ.items() if k not in self.unset}, **self.env}


def plan_launch(recipe_path: str | Path, overrides: list[str] | None = None, nproc: int = 1, nnodes: int = 1,
                node_rank: int = 0, master: str = "127.0.0.1:29500", train_args: list[str] | None = None,
                stop_signal: str | None = None) -> LaunchPlan:
    """The command that runs the recipe on nproc x nnodes processes; `stop_signal` (a name, e.g. USR2) is one
    more signal that checkpoints and stops every rank, given to them in the command's environment."""
    check_launch_env({k: os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT")})
    stale = [name for name in RANK_VARIABLES if os.environ.get(name)]  # this launch numbers its own processes

    if nproc < 1 or nnodes < 1:
        raise RecipeError("--nproc and --nnodes: must be at least 1")
    if not 0 <= node_rank < nnodes:
        raise RecipeError(f"--node-rank: must be between 0 and {nnodes - 1}, got {node_rank}")
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RecipeError(f"--master: expected IP:PORT with a port from 1 to 65535, got {master!r}")
    check_host("--master", host)

    recipe = Recipe.load(recipe_path, overrides or [])  # fail here, before any process starts
    check_tracker_packages(recipe.output.trackers)  # a missing package would fail every rank at once
    # accelerate's flag wants a concrete mode; each rank resolves the recipe again on its own device
    mixed_precision = resolve_precision(recipe, local_kind()).mixed_precision
    train = ["-m", "workbench", "train", str(recipe_path), *(overrides or []), *(train_args or [])]
    stop = {STOP_SIGNAL_ENV: signal.Signals(parse_signal(stop_signal)).name} if stop_signal else {}
    world = nproc * nnodes
    if recipe.distributed.strategy == "pp":  # one stage a process: what the schedule needs of the step
        problem = schedule_problem(recipe.training.grad_accum, world, recipe.distributed.pipeline.schedule)
        if problem:
            raise RecipeError(problem)
    if world == 1:
        return LaunchPlan([sys.executable, *train], stop, recipe.run_dir, 1, unset=stale)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(world),
               "--num_machines", str(nnodes), "--machine_rank", str(node_rank), "--main_process_ip", host,
               "--main_process_port", port, "--mixed_precision", mixed_precision,
               "--dynamo_backend", "no"]
    if nnodes > 1:
        # the machines must find each other within startup_timeout_s, not torchrun's default 10 minutes
        command += ["--rdzv_backend", "static", "--same_network",
                    "--rdzv_conf", f"timeout={math.ceil(recipe.distributed.startup_timeout_s)}"]
    env = {**stop, "NUM_NODES": str(nnodes)}
    if local_kind() == "cpu":  # the CPUs this machine (or pod: its CPU quota) really gives
        env["OMP_NUM_THREADS"] = str(recipe.training.threads or max(1, available_cpus()[0] // nproc))
    return LaunchPlan(command + train, env, recipe.run_dir, nproc, nnodes, master,
                      recipe.distributed.startup_timeout_s, unset=stale)


def run_launch(plan: LaunchPlan, timeout: float | None = None) -> int:
    """Run the plan in the foreground and return its exit code.

    Ctrl-C reaches every rank through the terminal's process group: this process only waits for the
    ranks to checkpoint and exit. A SIGTERM sent to this process alone (a scheduler, `kill PID`) is
    passed on to the launcher, which passes it on to the ranks.
    """
    devices = gpu_count() or available_cpus()[0]
    if plan.nproc > devices:  # a plan (--dry-run) may be for another machine; running it here may not
        what = "GPUs" if gpu_count() else "CPU cores"
        raise RecipeError(f"--nproc: {plan.nproc} processes on a machine with {devices} {what}; one process per "
                          f"{what[:-1]} at most")
    env = plan.environment()
    started = time.time()
    # stderr passes through a reader that also watches for the launcher's rendezvous failures
    warnings = warning_signals(env)
    # torchrun dies of SIGUSR1 (and of a configured stop signal) by default, taking no checkpoint: the launcher
    # starts with them ignored (its ranks install their own handlers), and this process passes them on
    process = subprocess.Popen(plan.command, env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                               preexec_fn=lambda: [signal.signal(s, signal.SIG_IGN) for s in warnings])
    watcher = _RendezvousWatcher(process.stderr)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, lambda signum, frame: process.send_signal(signum))
        for signum in warnings:
            previous[signum] = signal.signal(signum, lambda signum, frame: _to_ranks(process.pid, signum))
    try:
        while True:
            try:
                code = process.wait(timeout=timeout)
                break
            except KeyboardInterrupt:
                continue  # the ranks got it too and are stopping: wait for them
    except subprocess.TimeoutExpired:
        process.kill()
        raise WorkbenchError(f"the launch did not finish within {timeout} s") from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        watcher.join()
    if code and watcher.failed and plan.nnodes > 1 and not _training_started(plan, started):
        raise WorkbenchError(
            f"the {plan.nnodes} machines did not find each other within distributed.startup_timeout_s="
            f"{plan.startup_timeout_s:g} s at --master {plan.master} ({watcher.failed}); start the same "
            "`workbench launch` with every --node-rank, and give each the address of machine rank 0")
    return code


def _to_ranks(launcher_pid: int, signum: int) -> None:
    """A warning signal sent to this process alone reaches the ranks (torchrun passes on only SIGINT/SIGTERM);
    one sent to the whole job reaches them twice, which the ranks' handlers take as once."""
    import psutil

    try:
        launcher = psutil.Process(launcher_pid)
        ranks = [launcher, *launcher.children(recursive=True)]  # the launcher ignores it; one process is the rank
    except psutil.Error:
        return
    for rank in ranks:
        try:
            rank.send_signal(signum)
        except psutil.Error:
            pass


def _training_started(plan: LaunchPlan, since: float) -> bool:
    """Whether the ranks got as far as the run directory (so a later failure is not a rendezvous one)."""
    run_json = plan.run_dir / "run.json" if plan.run_dir is not None else None
    try:
        return run_json is not None and run_json.stat().st_mtime >= since
    except OSError:
        return False


class _RendezvousWatcher(threading.Thread):
    """Copies the launch's stderr to ours, remembering a rendezvous timeout or refused connection."""

    SIGNS = ("waiting for clients", "DistStoreError", "failed to connect", "Connection refused")

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.failed = stream, ""
        self.start()

    def run(self) -> None:
        for line in self.stream:
            sys.stderr.write(line)
            if not self.failed and any(sign in line for sign in self.SIGNS):
                self.failed = line.strip()[-200:]
        sys.stderr.flush()


def check_launcher_agrees(strategy: str) -> None:
    """An accelerate config (or flags) asking for another strategy than the recipe is an error."""
    if "LOCAL_RANK" not in os.environ:
        return
    for layout in (FSDP, ZERO2):  # one layout of each strategy an accelerate config can ask for
        name = layout.strategy
        if os.environ.get(layout.launch_flag, "").lower() == "true" and strategy != name:
            raise RecipeError(
                f"distributed.strategy: the recipe runs {strategy}, but the accelerate launch configuration "
                f"asks for {name}; remove {name} from the accelerate config (the recipe decides the strategy)"
            )
