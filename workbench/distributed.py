"""recipe.distributed → one configured Accelerator. Accelerate and PyTorch do the distributed work."""

from __future__ import annotations

import os

import torch

from .errors import RecipeError
from .recipe import Recipe


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_strategy(recipe: Recipe, world_size: int) -> tuple[str, str]:
    """(strategy, why). One process always runs `single`; several default to DDP."""
    requested = recipe.distributed.strategy
    if world_size == 1:
        if requested not in ("auto", "single", "ddp"):
            raise RecipeError(
                f"distributed.strategy: {requested} shards across processes, but this run has one process; "
                "launch it with `workbench launch RECIPE --nproc N` or set strategy: auto"
            )
        return "single", "one process"
    if requested in ("auto", "ddp"):
        return "ddp", "several processes; a full replica per process"
    raise RecipeError(f"distributed.strategy: {requested} is not available in this version; use ddp or auto")


def build_accelerator(recipe: Recipe, project_dir: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    # Accelerate keeps its state in process-wide singletons; a notebook that trains twice with
    # different precisions needs a fresh one (the process group in PartialState is kept).
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()

    return Accelerator(
        mixed_precision=recipe.training.mixed_precision,
        log_with=list(recipe.output.trackers) or None,
        project_dir=project_dir,
        step_scheduler_with_optimizer=False,
    )


def configure_threads(requested: int | None) -> int:
    """CPU threads per process: the recipe's number, else this process's share of the cores."""
    if requested is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        requested = max(1, cores // local)
    torch.set_num_threads(requested)
    return requested
