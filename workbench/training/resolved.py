"""A run's recipe resolved once, in seconds and before any weights load: what `auto` and a resume became for this
device and this launch. The training session reads this one frozen object from then on (`session.resolved`).

In order: a resumed run's plan (what its recipe may change, and what its saved `auto` settings meant), the
precision this device computes fastest, the attention kernel and how packed rows stay apart, the preflight
checks, and the layout (the estimator's choice for `auto`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workbench.base.errors import RecipeError
from workbench.distributed.launcher import check_launcher_agrees
from workbench.estimator.batch_choice import BatchChoice
from workbench.estimator.batch_choice import choose as choose_batch_split
from workbench.estimator.layout_choice import resolve as resolve_layout
from workbench.hardware.precision import Precision, resolve_recipe
from workbench.model.attention import Attention, dense_mask_warning, flex_problem_for_run
from workbench.model.attention import with_implementation as attention_for
from workbench.model.loading import load_config, load_tokenizer
from workbench.rundir.runs import RunDir
from workbench.spec import batch_split
from workbench.spec.recipe import Recipe
from workbench.spec.strategies import Layout
from workbench.training import fit_check
from workbench.training.preflight import preflight
from workbench.training.resume import ResumePlan


@dataclass(frozen=True)
class ResolvedRun:
    recipe: Recipe  # concrete: precision, attention kernel and layout filled in; what every stage reads
    saved: Recipe  # what the run directory keeps: `auto` strategy and attention as asked (a resume chooses again)
    resume: ResumePlan
    precision: Precision
    attention: Attention
    layout: Layout
    layout_reason: str
    warnings: tuple[str, ...]
    batch_choice: BatchChoice | None = None  # training.micro_batch_size auto on a new run: the split taken


def resolve_run(recipe: Recipe, run: RunDir, *, resume: bool, world_size: int, nodes: int,
                device_kind: str) -> tuple[ResolvedRun, Any, Any]:
    """The resolved run, with the tokenizer and model config it was resolved against (loaded once, here)."""
    recipe, plan = ResumePlan.start(recipe, run, resume, world_size)  # a resume: `auto` split as its run took it
    asked_attention, asked_strategy = recipe.model.attn, recipe.distributed.strategy
    split_asked = recipe.training.batch_size if recipe.training.micro_batch_auto else None
    if split_asked:  # the checks below and the layout's choice read one sequence per micro-batch
        recipe = batch_split.provisional(recipe)
    recipe, precision = resolve_recipe(recipe, device_kind)
    tokenizer, model_config = load_tokenizer(recipe.model, recipe.data.chat_template), load_config(recipe.model)
    recipe, attention = attention_for(recipe, device_kind,
                                      flex_problem=flex_problem_for_run(recipe, model_config, device_kind))
    warnings = (*precision.warnings, *filter(None, [dense_mask_warning(attention, device_kind)]),
                *preflight(recipe, tokenizer, model_config, resume))
    recipe, layout, why = resolve_layout(recipe, world_size, nodes)
    if plan.resuming and asked_strategy == "auto" and not layout.reads_own_batches:
        # the resume kept the run's samples a step counting one batch stream a process (resume.check_resume)
        raise RecipeError(f"distributed.strategy: auto chose {layout.name} to resume this run, whose processes "
                          f"read one batch stream together; set distributed.strategy: {layout.strategy} to resume "
                          "on it")
    check_launcher_agrees(layout.strategy)
    choice = None
    if split_asked:
        measured = (fit_check.budget_for(recipe, torch.device(device_kind)) is not None
                    and fit_check.why_not_checked(recipe, layout) is None)
        recipe, choice = choose_batch_split(recipe, split_asked, layout, world_size, nodes, measured=measured)
    # saved with the split taken: a resume continues with it, whatever another machine's memory would choose
    saved = recipe.override(distributed__strategy=asked_strategy, model__attn=asked_attention)
    resolved = ResolvedRun(recipe, saved, plan, precision, attention, layout, why, warnings, choice)
    return resolved, tokenizer, model_config
