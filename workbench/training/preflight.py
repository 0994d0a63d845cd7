"""Checks that run before any weights load, so a doomed run fails in seconds with the field to fix.

Recipe fields and files (data exists and is readable, the output folder is writable, the trackers' packages
are installed and their settings can work: W&B has a key or runs offline, MLflow's store is usable and its
server answers), the tokenizer (a chat template and EOS where the data format needs them) and the model's context
limit. Data rows themselves are checked, with file:line, as they are tokenized, and
the free disk for the checkpoints once the adapter is attached (`check_disk_space`, before the first step).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from workbench.base.errors import RecipeError, WorkbenchError, escaped
from workbench.distributed.trackers import check_trackers
from workbench.spec.formats import format_of
from workbench.spec.recipe import Recipe

BYTES_PER_TRAINABLE_IN_CHECKPOINT = 4 + 8  # fp32 weights + AdamW's two moments (8-bit optimizers need less)
DISK_MARGIN = 1.2


def preflight(recipe: Recipe, tokenizer=None, model_config=None, resume: bool = False) -> list[str]:
    """Raise on the first problem; return warnings worth printing (nothing fatal)."""
    check_trackers(recipe.output.trackers)
    check_data_files(recipe)
    check_output_dir(recipe, resume)
    warnings: list[str] = []
    if tokenizer is not None:
        check_tokenizer(recipe, tokenizer)
    if model_config is not None:
        check_context_length(recipe, model_config)
        width = getattr(model_config, "hidden_size", None)
        if width and recipe.adapter.method != "full" and recipe.adapter.r > width:
            warnings.append(f"adapter.r={recipe.adapter.r} is larger than the model's width ({width}): the adapter "
                            f"cannot learn more than a rank-{width} update and costs far more memory; use r <= "
                            f"{width} (8-64 is usual)")
    return warnings


def check_data_files(recipe: Recipe) -> None:
    several = not isinstance(recipe.data.train, str)
    named = [(f"train[{k}].path" if several else "train", source.path) for k, source in enumerate(recipe.data.sources)]
    for field, value in [*named, ("eval", recipe.data.eval)]:
        if not value:
            continue
        path = Path(value)
        if path.exists():
            if path.is_dir():
                raise RecipeError(f"data.{field}: {escaped(value)} is a folder; give a .jsonl, .json, .csv or "
                                  ".parquet file")
            if not os.access(path, os.R_OK):
                raise RecipeError(f"data.{field}: {escaped(value)} is not readable")
        elif _looks_like_a_file(value):  # not a hub data set id
            raise RecipeError(f"data.{field}: file {escaped(value)} not found (paths are relative to "
                              f"{escaped(Path.cwd())})")


def _looks_like_a_file(value: str) -> bool:
    return value.startswith((".", "/", "~")) or Path(value).suffix in (".jsonl", ".json", ".csv", ".parquet")


def check_output_dir(recipe: Recipe, resume: bool = False) -> None:
    """The run directory's nearest existing folder must take a file (a full disk or a read-only mount
    fails here, not at the first checkpoint an hour in)."""
    target = recipe.run_dir
    try:
        if target.is_symlink() and not target.exists():
            raise RecipeError(f"output.dir: {escaped(target)} is a symbolic link to nothing")
        if target.exists() and not target.is_dir():
            raise RecipeError(f"output.dir: {escaped(target)} exists and is not a folder")
        if target.is_dir() and any(target.iterdir()) and not (target / "run.json").exists() and not resume:
            raise RecipeError(f"output.dir: {escaped(target)} is a folder that holds no run (no run.json); a run is "
                              "written only into a new or empty folder, or over an earlier run")
        existing = target if target.exists() else _nearest_existing(target)
    except OSError as err:  # a name too long, a folder that cannot be listed
        raise RecipeError(f"output.dir: {escaped(target)}: {err.strerror or err}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".workbench-write-test-"):
            pass
    except OSError as err:
        raise RecipeError(f"output.dir: cannot write in {escaped(existing)} ({err.strerror or err})") from None


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def checkpoint_bytes(trainable_params: int) -> int:
    """Bytes one checkpoint takes: the trainable weights and their optimizer states."""
    return int(trainable_params * BYTES_PER_TRAINABLE_IN_CHECKPOINT)


def check_disk_space(recipe: Recipe, trainable_params: int) -> None:
    """Room for keep_last checkpoints, the one being written beside them, and the final adapter.
    Run once the adapter is attached (the exact count, before the first step)."""
    if not recipe.output.save_every:
        return
    needed = int(checkpoint_bytes(trainable_params) * (recipe.output.keep_last + 1) * DISK_MARGIN)
    folder = _nearest_existing(recipe.run_dir)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise WorkbenchError(
            f"output.dir: {folder} has {free / 2**30:.2f} GiB free, but {recipe.output.keep_last} checkpoint(s) "
            f"+ one being written need about {needed / 2**30:.2f} GiB; free space, choose another output.dir or "
            "lower output.keep_last"
        )


def check_tokenizer(recipe: Recipe, tokenizer) -> None:
    if format_of(recipe.data.format).needs_chat_template and not getattr(tokenizer, "chat_template", None):
        raise RecipeError(
            f"data.format: {recipe.data.format} needs a tokenizer with a chat template, and {recipe.model.path} has "
            "none; use format: completion or text, or a chat (instruct) model"
        )
    if tokenizer.eos_token_id is None:
        raise RecipeError(
            f"model.path: the tokenizer of {recipe.model.path} has no EOS token, so a tuned model would never "
            "learn to stop; set one in the tokenizer files"
        )


def check_context_length(recipe: Recipe, config) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit and recipe.data.max_seq_len > limit:
        if recipe.model.rope_scaling is not None:
            raise RecipeError(f"data.max_seq_len: {recipe.data.max_seq_len} is longer than model.rope_scaling "
                              f"stretches {recipe.model.path} to ({limit} positions); set data.max_seq_len <= "
                              f"{limit} or a larger model.rope_scaling.factor")
        raise RecipeError(
            f"data.max_seq_len: {recipe.data.max_seq_len} is longer than {recipe.model.path} was trained for "
            f"({limit} positions); set data.max_seq_len <= {limit}, or stretch its positions with "
            "model.rope_scaling (e.g. {type: yarn, factor: 2})"
        )
