"""What `--resume` may change: the recipe a run saved decides, and only changes that keep the run the same run pass.

A resumed run must continue the run its files describe. Settings that change what is trained, on which data,
or the schedule it follows (lr, steps, batch, adapter shape, precision) are refused with one error listing
them; the micro-batch and accumulation may change with the process count while their product with it (the
samples of one step) stays the same. Settings that only change how the run is watched or how fast it goes,
and a new peak lr (the way out of a divergence: warmup and decay continue, scaled), are allowed and
recorded with the checkpoint step they start from. `auto` in the new recipe keeps what the run resolved it to.
"""

from __future__ import annotations

from typing import Any

from .errors import RecipeError
from .precision import AUTO
from .recipe import Recipe
from .runs import RunDir

# Dotted keys (or section prefixes ending in ".") a resume may change.
SAFE_TO_CHANGE = (
    "output.log_every", "output.eval_every", "output.save_every", "output.keep_last", "output.trackers",
    "output.sample_prompts", "output.sample_max_new_tokens", "training.threads", "training.on_nonfinite",
    "training.fast_paths", "training.gradient_checkpointing", "training.activation_offloading",
    "training.compile", "model.attn",  # kernels and compilation: the same computation, faster
    "training.lr",  # the way out of a divergence: the schedule continues, scaled to the new peak
    "name", "output.dir",  # where the run is: found already, by this very recipe
    "distributed.",  # the strategy of the processes that continue it (checked when the state loads)
)
PRECISION_KEYS = ("model.dtype", "training.mixed_precision", "quantization.compute_dtype")


def check_resume(recipe: Recipe, run: RunDir, world_size: int = 1) -> tuple[Recipe, dict[str, list]]:
    """The recipe to continue with, and the allowed changes ({key: [saved, new]}); RecipeError listing every
    refused change otherwise. `world_size`: the processes that continue the run."""
    try:
        saved = Recipe.load(run.recipe)
    except (RecipeError, OSError) as err:
        raise RecipeError(f"--resume: cannot read the run's own recipe {run.recipe}: {err}") from None
    old, new = _flat(saved.to_dict()), _flat(recipe.to_dict())
    for key in PRECISION_KEYS:  # `auto` means: what this run resolved it to
        if new.get(key) == AUTO and key in old:
            new[key] = old[key]
    changed = {key: [old.get(key), new.get(key)] for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}
    refused = {k: v for k, v in changed.items() if not _safe(k)}
    if _same_global_batch(saved, recipe, run, world_size):  # another process count: the same samples per step
        refused = {k: v for k, v in refused.items() if k not in BATCH_KEYS}
    if refused:
        listed = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in refused.items())
        raise RecipeError(f"--resume: the recipe differs from the run's own ({run.recipe}) in what it trains: "
                          f"{listed}. Resume with the run's recipe, or start a new run (another name or --overwrite). "
                          f"A resume may change only {', '.join(SAFE_TO_CHANGE)}")
    overrides = {key.replace(".", "__"): new[key] for key in PRECISION_KEYS if key in new}
    return recipe.override(**overrides), changed


BATCH_KEYS = ("training.micro_batch_size", "training.grad_accum")


def _same_global_batch(saved: Recipe, new: Recipe, run: RunDir, world_size: int) -> bool:
    """micro-batch x accumulation x processes unchanged: the run sees the same samples in each step. The
    checkpoint that continues says what wrote it (run.json for checkpoints that do not)."""
    import json

    latest = run.latest_checkpoint()
    try:
        meta = json.loads((latest[1] / "workbench_checkpoint.json").read_text()) if latest else {}
        before = int(meta["micro_batch_size"]) * int(meta["grad_accum"]) * int(meta["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        saved_world = run.read_json().get("summary", {}).get("world_size")
        if not isinstance(saved_world, int):
            return False
        before = saved.training.micro_batch_size * saved.training.grad_accum * saved_world
    return before == new.training.micro_batch_size * new.training.grad_accum * world_size


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE)


def _flat(data: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
