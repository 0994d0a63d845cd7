"""What `--resume` may change: the recipe a run saved decides, and only changes that keep the run the same run pass.

A resumed run must continue the run its files describe. Settings that change what is trained, on which data,
or the schedule it follows (lr, steps, batch, adapter shape, precision) are refused with one error listing
them. The samples of one step (micro-batch x accumulation x processes) stay what they were: on another process
count the accumulation is adjusted to keep them (and a line says so), the micro-batch and accumulation may be
changed while their product with the process count stays the same, and any other product is refused, naming it
before and after and the settings that keep it. Settings that only change how the run is watched or how fast it goes,
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
    "training.resume",  # how a restarted job continues, not what it trains
    "training.lr",  # the way out of a divergence: the schedule continues, scaled to the new peak
    "name", "output.dir",  # where the run is: found already, by this very recipe
    "distributed.",  # the strategy of the processes that continue it (checked when the state loads)
)
PRECISION_KEYS = ("model.dtype", "training.mixed_precision", "quantization.compute_dtype")


def check_resume(recipe: Recipe, run: RunDir, world_size: int = 1) -> tuple[Recipe, dict[str, list], list[str]]:
    """The recipe to continue with, the allowed changes ({key: [saved, new]}) and what was adjusted to keep the
    run the same (one line each, to print); RecipeError listing every refused change otherwise.
    `world_size`: the processes that continue the run."""
    try:
        saved = Recipe.load(run.recipe)
    except (RecipeError, OSError) as err:
        raise RecipeError(f"--resume: cannot read the run's own recipe {run.recipe}: {err}") from None
    recipe, notes, batch_problem = _keep_samples_per_step(saved, recipe, run, world_size)
    old, new = _flat(saved.to_dict()), _flat(recipe.to_dict())
    for key in PRECISION_KEYS:  # `auto` means: what this run resolved it to
        if new.get(key) == AUTO and key in old:
            new[key] = old[key]
    changed = {key: [old.get(key), new.get(key)] for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}
    refused = {k: v for k, v in changed.items() if not _safe(k) and (k not in BATCH_KEYS or batch_problem)}
    if refused:
        listed = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in refused.items())
        raise RecipeError(f"--resume: the recipe differs from the run's own ({run.recipe}) in what it trains: "
                          f"{listed}{f' ({batch_problem})' if batch_problem else ''}. Resume with the run's recipe, or "
                          "start a new run (another name or --overwrite). A resume may change only "
                          f"{', '.join(SAFE_TO_CHANGE)}, and the micro-batch and accumulation where their product with "
                          "the processes stays the same")
    if batch_problem:  # only the process count changed
        raise RecipeError(f"--resume: {batch_problem}")
    overrides = {key.replace(".", "__"): new[key] for key in PRECISION_KEYS if key in new}
    return recipe.override(**overrides), changed, notes


BATCH_KEYS = ("training.micro_batch_size", "training.grad_accum")


def _keep_samples_per_step(saved: Recipe, new: Recipe, run: RunDir,
                           world_size: int) -> tuple[Recipe, list[str], str | None]:
    """micro-batch x accumulation x processes is the samples of one step, which a resumed run keeps (else its
    schedule, its loss scale and its place in the epoch mean something else). On another process count with the
    micro-batch and accumulation the run had, the accumulation is adjusted where that keeps the product (the
    recipe to continue with, and a line saying so); any other change of the product is refused (the third item:
    why, naming the product before and after and the settings that keep it)."""
    before = _written_by(saved, run)
    micro, accum = new.training.micro_batch_size, new.training.grad_accum
    after = micro * accum * world_size
    if before is None or _product(before) == after:
        return new, [], None
    samples = _product(before)
    per_process, rest = divmod(samples, world_size)
    was = f"{samples} samples a step (micro-batch {before[0]} x accumulation {before[1]} x {before[2]} process(es))"
    now = f"{after} ({micro} x {accum} x {world_size} process(es))"
    untouched = (micro, accum) == (saved.training.micro_batch_size, saved.training.grad_accum)
    if untouched and not rest and per_process % micro == 0:
        note = (f"resume: training.grad_accum {accum} -> {per_process // micro} on {world_size} process(es), to keep "
                f"the run's {was}")
        return new.override(training__grad_accum=per_process // micro), [note], None
    if rest:
        keep = (f"no micro-batch and accumulation keep {samples} on {world_size} process(es): resume on a process "
                f"count that divides {samples} (as {before[2]} does)")
    else:
        fits = max(m for m in range(1, min(micro, per_process) + 1) if per_process % m == 0)
        keep = f"training.micro_batch_size={fits} training.grad_accum={per_process // fits} keeps it"
    return new, [], f"the run took {was} and this one would take {now}; {keep}"


def _written_by(saved: Recipe, run: RunDir) -> tuple[int, int, int] | None:
    """(micro-batch, accumulation, processes) of the run so far: the checkpoint that continues says what wrote it
    (run.json for checkpoints that do not); None where nothing says."""
    import json

    latest = run.latest_checkpoint()
    try:
        meta = json.loads((latest[1] / "workbench_checkpoint.json").read_text()) if latest else {}
        return int(meta["micro_batch_size"]), int(meta["grad_accum"]), int(meta["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        saved_world = run.read_json().get("summary", {}).get("world_size")
        if not isinstance(saved_world, int):
            return None
        return saved.training.micro_batch_size, saved.training.grad_accum, saved_world


def _product(batch: tuple[int, int, int]) -> int:
    return batch[0] * batch[1] * batch[2]


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


AUTO_RESUME = "auto"


def auto_resume(run: RunDir) -> str:
    """What `--resume auto` does with this run directory, the same answer on every rank (nothing is written
    before they all decide): "resume" (a complete checkpoint of an unfinished run), "done" (the run completed:
    a requeued or restarted job has nothing left to do), "replace" (an earlier start died before its first
    checkpoint: its files are replaced, as by --overwrite) or "new" (nothing there yet)."""
    summary = run.read_json().get("summary", {})
    if summary.get("status") == "completed":
        return "done"
    if run.latest_checkpoint() is not None:
        return "resume"
    return "replace" if run.run_json.exists() else "new"
