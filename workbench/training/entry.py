"""The training entry point: `train(recipe)` runs one `TrainingSession` in this process."""

from __future__ import annotations

import os
import time

from .. import heap
from ..errors import RecipeError, WorkbenchError
from ..quiet import leaves_the_process_as_found, quiet_libraries
from ..recipe import Recipe
from ..runs import TrainResult
from .session import TrainingSession


@leaves_the_process_as_found
def train(recipe: Recipe | dict | str | os.PathLike, *, resume: bool = False, overwrite: bool = False,
          progress_bar: bool | str = True) -> TrainResult:
    """Train the recipe in this process (one of N when launched with `accelerate launch`).
    progress_bar: True (a bar), False (quiet), or "lines" (a plain line per metrics row, for logs).

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
    if resume and overwrite:
        raise WorkbenchError("--resume and --overwrite contradict each other: continue the run, or replace it")
    heap.training_starts()  # what the estimate of this run assumes (workbench/heap.py)
    session = TrainingSession(recipe, resume=resume, overwrite=overwrite, progress_bar=progress_bar, started=started)
    session.setup()
    return session.execute()
