"""The training entry point: `train(recipe)` runs one `TrainingSession` in this process."""

from __future__ import annotations

import os
import time

from workbench.base import heap
from workbench.base.errors import RecipeError, printable
from workbench.base.quiet import leaves_the_process_as_found, quiet_libraries
from workbench.distributed.cluster_env import check_launch_env
from workbench.hardware.current import world_size_from_env
from workbench.rundir.runs import RunDir, TrainResult, read_result
from workbench.spec.recipe import Recipe
from workbench.training.resume import AUTO_RESUME, auto_resume, check_flags
from workbench.training.session import TrainingSession


@leaves_the_process_as_found
def train(recipe: Recipe | dict | str | os.PathLike, *, resume: bool | str = False, overwrite: bool = False,
          progress_bar: bool | str = True) -> TrainResult:
    """Train the recipe in this process (one of N when launched with `accelerate launch`).
    progress_bar: True (a bar), False (quiet), or "lines" (a plain line per metrics row, for logs).
    resume: True continues the run (refused where there is nothing to continue); "auto" (or the recipe's
    training.resume: auto) continues it where it has a checkpoint and starts it otherwise.

    Nothing in the run directory is touched until the recipe, the data and the model have been checked:
    a bad row or a refused resume leaves an earlier run exactly as it was."""
    started = time.perf_counter()
    if isinstance(recipe, dict):
        recipe = Recipe.from_dict(recipe)
    elif isinstance(recipe, (str, os.PathLike)):
        recipe = Recipe.load(recipe)
    elif not isinstance(recipe, Recipe):
        raise RecipeError(f"train: expects a Recipe, a mapping or a recipe file, got {type(recipe).__name__}")
    quiet_libraries()
    check_launch_env()  # a half-configured launch (RANK without WORLD_SIZE) is refused before anything loads
    check_flags(resume, overwrite)
    auto = resume == AUTO_RESUME or (recipe.training.resume == AUTO_RESUME and not resume and not overwrite)
    if auto:
        decision = auto_resume(recipe, RunDir(recipe.run_dir), world_size_from_env())
        if decision == "done":  # a job restarted after its run completed: nothing left to train
            print(f"{printable(recipe.run_dir)}: the run has completed; nothing to resume", flush=True)
            return read_result(recipe.run_dir)
        resume, overwrite = decision == "resume", decision == "replace"
    heap.training_starts()  # what the estimate of this run assumes (workbench/base/heap.py)
    session = TrainingSession(recipe, resume=resume, overwrite=overwrite, progress_bar=progress_bar, started=started)
    session.auto_resume = auto
    session.setup()
    return session.execute()
