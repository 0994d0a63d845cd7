"""What a run checks before it takes its run directory over: the data and the pair layout a resumed run
started with."""

from __future__ import annotations

from ..attention import model_drops_out, shares_prompts
from ..errors import WorkbenchError
from ..recipe import Recipe
from ..runs import RunDir


def pairs_share_prompts(recipe: Recipe, attention, model_config, run: RunDir, resume: bool) -> bool:
    """Whether this run's preference pairs hold their prompt once (attention.shares_prompts). A resumed run keeps
    the layout it started with, so its rows and their order stay what its checkpoints counted."""
    here = shares_prompts(attention, recipe, model_config)
    started = run.read_json().get("summary", {}) if resume else {}
    if "train_sha256" not in started:  # a new run, or one that never got as far as its data
        return here
    before = bool(started.get("shared_prompts"))
    if before and not here:
        raise WorkbenchError(
            "--resume: this run started with each preference pair holding its prompt once, which needs a CPU's "
            "per-sample attention (training.fast_paths: true) and no dropout; here: attention "
            f"{attention.implementation} ({attention.packed_rows}), adapter.dropout {recipe.adapter.dropout}, "
            f"the model's own dropout {'on' if model_drops_out(model_config) else 'off'}; resume it where all three "
            "hold, or start a new run")
    return before


def check_same_data(run: RunDir, stats: dict) -> None:
    """A resumed run trains on the bytes it started on: a data file changed since then is refused."""
    recorded = run.read_json().get("summary", {})
    for key in ("train_sha256", "eval_sha256"):
        if recorded.get(key) and stats.get(key) and recorded[key] != stats[key]:
            part = key.split("_")[0]
            raise WorkbenchError(f"--resume: data.{part} changed since the run started (its content hash differs); "
                                 "resume with the data it started on, or start a new run")
