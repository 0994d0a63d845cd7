"""training.micro_batch_size auto: training.batch_size, the samples of one optimizer step on each process, split
into micro-batch x accumulation. Which split a run takes is the estimator's (workbench/estimator/batch_choice.py)
and then the fit check's (workbench/training/fit_check.py); the recipe the loop reads holds it as numbers."""

from __future__ import annotations

import math

from workbench.spec.recipe import Recipe


def splits(batch_size: int) -> list[int]:
    """The micro-batches that divide `batch_size`, largest (fewest accumulation steps: the faster step) first."""
    small = [d for d in range(1, math.isqrt(batch_size) + 1) if batch_size % d == 0]
    return sorted({*small, *(batch_size // d for d in small)}, reverse=True)


def largest_within(batch_size: int, limit: int) -> int:
    """The largest micro-batch dividing `batch_size` that is at most `limit` (1 where none is)."""
    return next((micro for micro in splits(batch_size) if micro <= limit), 1)


def provisional(recipe: Recipe) -> Recipe:
    """What the checks that come before a split is chosen read: one sequence per micro-batch, the least memory."""
    batch_size = recipe.training.batch_size
    return recipe.override(training__micro_batch_size=1, training__grad_accum=batch_size, training__batch_size=None)


def split(recipe: Recipe, batch_size: int, micro_batch: int) -> Recipe:
    return recipe.override(training__micro_batch_size=micro_batch, training__grad_accum=batch_size // micro_batch,
                           training__batch_size=batch_size)
