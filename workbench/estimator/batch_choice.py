"""Which split of training.batch_size a recipe with training.micro_batch_size auto starts with: the largest
micro-batch whose estimate fits the device. Where the fit check will measure it (workbench/training/fit_check.py,
which steps down the splits until one fits), the estimate is read at the low end of its layout's measured range,
so that the measurement, not the estimate's caution, sets the split; where nothing will measure it, at the high
end."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.estimator.memory import micro_batch_limit
from workbench.spec import batch_split
from workbench.spec.recipe import Recipe
from workbench.spec.strategies import Layout


@dataclass(frozen=True)
class BatchChoice:
    batch_size: int  # samples of one optimizer step on each process
    micro_batch: int
    estimated_limit: int  # the largest micro-batch the estimate fits (0: not even one)
    reason: str

    def to_json(self) -> dict:
        return {"batch_size": self.batch_size, "micro_batch_size": self.micro_batch,
                "grad_accum": self.batch_size // self.micro_batch, "estimated_limit": self.estimated_limit,
                "reason": self.reason}


def choose(recipe: Recipe, batch_size: int, layout: Layout, world_size: int, nodes: int = 1, *,
           measured: bool) -> tuple[Recipe, BatchChoice]:
    """`recipe` (its micro-batch `auto`, or already set provisionally) set to the chosen split of `batch_size`, and
    the choice. `measured`: whether the fit check will measure the split's step before the run."""
    if recipe.training.micro_batch_auto:
        recipe = batch_split.provisional(recipe)
    end = "low" if measured else "high"
    limit = micro_batch_limit(recipe, layout, world_size, nodes, end=end)
    micro = batch_split.largest_within(batch_size, limit)
    then = "; the fit check measures it" if measured else ""
    reason = (f"the largest split of {batch_size} whose estimate fits on {layout.name} (up to {limit} at the {end} "
              f"end of its measured range){then}" if limit else
              f"not even one sequence fits on {layout.name} by the estimate; the smallest split{then}")
    return batch_split.split(recipe, batch_size, micro), BatchChoice(batch_size, micro, limit, reason)
