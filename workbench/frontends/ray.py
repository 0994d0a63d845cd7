"""Ray Train: `ray_train(recipe, num_workers=N)` runs the recipe on N Ray workers, and continues it by itself.

Ray's `TorchTrainer` starts the workers and their process group; each worker runs `train(recipe, resume="auto")`,
so a worker group that Ray restarts after a failure (`max_failures`) continues from the run's last checkpoint
instead of starting again. Paths are made absolute on the driver before any worker starts: Ray runs each worker
in its own session folder, where a recipe's relative paths would point nowhere. The run directory must be on
storage every node sees (one machine: any folder).

A worker's loop runs in a thread, where no signal handler can be installed: a run under Ray is stopped with
`workbench stop RUN_DIR` (a request file the loop reads at every step), which checkpoints and ends it as a signal
would.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

from workbench.base.errors import Interrupted, RecipeError, WorkbenchError
from workbench.rundir.runs import RunDir, TrainResult, read_result
from workbench.spec.recipe import Recipe, with_paths_changed
from workbench.training.entry import train
from workbench.training.preflight import check_data_files


def ray_train(recipe: Recipe | str | os.PathLike, *, num_workers: int = 2, use_gpu: bool = False,
              cpus_per_worker: int = 1, max_failures: int = 2, address: str | None = None,
              overwrite: bool = False) -> TrainResult:
    """Train `recipe` on `num_workers` Ray workers (a local Ray started for the call where none runs, or the
    cluster at `address`); a failed worker group is restarted up to `max_failures` times and resumes the run.
    The run always continues its run directory's last checkpoint (`--resume auto`); `overwrite` replaces an
    earlier run there first."""
    ray, train_api, TorchTrainer = _ray()
    if not isinstance(recipe, Recipe):
        recipe = Recipe.load(recipe)
    for name, value in (("num_workers", num_workers), ("cpus_per_worker", cpus_per_worker)):
        if not isinstance(value, int) or value < 1:
            raise RecipeError(f"ray_train: {name} must be a whole number of at least 1, got {value!r}")
    if not isinstance(max_failures, int) or max_failures < 0:
        raise RecipeError(f"ray_train: max_failures must be 0 or more, got {max_failures!r}")
    recipe = anchored(recipe, Path.cwd())
    check_data_files(recipe)  # here, in one line, not on every worker after Ray started them
    run = RunDir(recipe.run_dir)
    if overwrite:  # here, once: a restarted worker group must resume what the first one wrote, not replace it
        run.claim(resume=False, overwrite=True)
        try:
            run.clear()
        finally:
            run.release()
    started_here = not ray.is_initialized()
    if started_here:
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
        except ConnectionError as err:
            raise WorkbenchError(f"ray_train: no Ray cluster at {address}: {err}") from None
    try:
        trainer = TorchTrainer(
            _train_on_worker, train_loop_config={"recipe": recipe.to_dict()},
            scaling_config=train_api.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                                   resources_per_worker={"CPU": cpus_per_worker}),
            run_config=train_api.RunConfig(name=recipe.name, storage_path=str(Path(recipe.run_dir).parent / ".ray"),
                                           failure_config=train_api.FailureConfig(max_failures=max_failures)))
        with _signals_ask_the_workers_to_stop(run):
            trainer.fit()
    except train_api.TrainingFailedError as err:
        raise WorkbenchError(f"ray_train: the run failed on its workers after {max_failures} restart(s): "
                             f"{str(err).strip().splitlines()[-1]}") from None
    finally:
        if started_here:
            ray.shutdown()
    result = read_result(recipe.run_dir)
    if result.summary.get("status") == "interrupted":
        latest = run.latest_checkpoint()
        raise Interrupted(f"{recipe.run_dir}: stopped on request, checkpoint {latest[1].name if latest else '(none)'} "
                          "saved: run the same command to continue", signal.SIGTERM)
    return result


def _train_on_worker(config: dict) -> None:
    """One Ray worker: its rank's share of the run, continued from the last checkpoint after a restart. A run
    stopped on request ends the worker normally: Ray must not restart what was asked to stop."""
    recipe = Recipe.from_dict(config["recipe"], source="ray_train")
    try:
        train(recipe, resume="auto", progress_bar="lines")
    except Interrupted as stopped:
        print(f"{stopped}", flush=True)


def anchored(recipe: Recipe, base: Path) -> Recipe:
    """The recipe with its local paths absolute against `base`, as the workers run elsewhere: every field the
    schema marks as a path (recipe.path_fields: data files, a local model folder, a chat template file, a
    DeepSpeed config file, the output folder). Hub ids, builtin models and registered names stay as they are."""
    def local(value: str, mark: dict) -> str:
        if mark["path"] == "output":
            return value if Path(value).is_absolute() else str(base.resolve() / value)
        if not value or value in mark["names"] or Path(value).is_absolute() or not (base / value).exists():
            return value
        return str((base / value).resolve())

    return with_paths_changed(recipe, local)


@contextmanager
def _signals_ask_the_workers_to_stop(run: RunDir):
    """SIGINT/SIGTERM to the driver (Ctrl-C, a scheduler) become a stop request the workers read at their next
    step: they checkpoint and end, and fit() returns; without this Ray's own handler aborts the driver at once.
    A signal to the driver's whole process group also reaches the Ray this driver started (same group): its GCS
    dies of it and Ray ends the driver with exit 1; signal the driver's PID (or use `workbench stop`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ask(signum, frame) -> None:
        try:
            run.request_stop()
            print(f"{signal.Signals(signum).name}: the workers checkpoint and stop at their next step", flush=True)
        except OSError as err:
            print(f"{signal.Signals(signum).name}: cannot ask the workers to stop ({err})", flush=True)

    previous = {signum: signal.signal(signum, ask) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _ray():
    """Ray and Ray Train, or one line saying how to get them."""
    try:
        import ray
        from ray import train as train_api
        from ray.train.torch import TorchTrainer
    except ImportError:
        raise WorkbenchError("ray_train needs Ray Train: pip install 'lora-workbench[ray]' (ray[train])") from None
    return ray, train_api, TorchTrainer
