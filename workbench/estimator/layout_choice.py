"""Which layout a recipe runs on: the one it names, or, for `auto`, the first in order of preference that the
memory estimator finds fitting and the layout rules allow (workbench/spec/strategies.py holds the layouts)."""

from __future__ import annotations

from workbench.base.errors import RecipeError
from workbench.estimator.memory import estimate
from workbench.spec.recipe import Recipe
from workbench.spec.strategies import DDP, Layout, by_name, layout_of, layout_problem


def resolve(recipe: Recipe, world_size: int, nodes: int = 1, device_memory: int | str | None = None
            ) -> tuple[Recipe, Layout, str]:
    """The recipe set to run one complete layout on `world_size` processes, the layout, and why.

    `auto` asks the memory estimator for the first layout, in order of preference, that fits on the
    device and that the compatibility rules allow for this recipe. The returned recipe carries the
    layout's settings, so the accelerator that is built runs exactly what was chosen.
    """
    if world_size == 1 or recipe.distributed.strategy != "auto":
        layout = layout_of(recipe, world_size)
        why = "one process" if world_size == 1 else "set in the recipe"
    else:
        layout, why = _choose(recipe, world_size, nodes, device_memory)
    problem = layout_problem(recipe, layout)
    if problem:
        raise RecipeError(f"{problem} (layout {layout.name}: {why})")
    if recipe.distributed.deepspeed.config_file and layout.strategy == "deepspeed":
        return recipe, layout, why  # the user's JSON stays as written
    return recipe.override(**{k.replace(".", "__"): v for k, v in layout.settings().items()}), layout, why


def _choose(recipe: Recipe, world_size: int, nodes: int, device_memory) -> tuple[Layout, str]:
    est = estimate(recipe, world_size=world_size, nodes=nodes, device=None, device_memory=device_memory)
    memory = est.device["memory_bytes"]
    on_cpu = est.device["kind"] == "cpu"  # on a CPU every process of the machine shares its memory
    refused = []
    for row in est.strategies:
        layout = by_name(row["name"]) if row["name"] != "single" else DDP
        if row["refused"]:  # the estimator asked strategies.layout_problem
            refused.append(layout.name)
            continue
        if row["fits"]:
            need = row["cpu_bytes"] if on_cpu else row["per_device_bytes"]
            skipped = f"; {', '.join(refused)} not allowed for this recipe" if refused else ""
            return layout, (f"auto: {layout.name} is the first layout that fits ({need / 2**30:.2f} of "
                            f"{memory / 2**30:.2f} GiB {'on this machine' if on_cpu else 'per device'}{skipped})")
    not_allowed = f" ({', '.join(refused)} not allowed for this recipe)" if refused else ""
    raise RecipeError(
        f"distributed.strategy: auto found no layout that fits this recipe on {world_size} x {est.device['name']} "
        f"({memory / 2**30:.2f} GiB){not_allowed}; see `workbench estimate` for each layout's memory, "
        "set distributed.device_memory, or name a strategy"
    )
