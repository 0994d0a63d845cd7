"""Merge a run's adapter into its base: a plain transformers folder that loads without peft."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from workbench.base.errors import RecipeError, WorkbenchError, escaped, reported_as_write_error
from workbench.base.quiet import leaves_the_process_as_found, quiet_libraries
from workbench.model.inference import check_adapter, hub_options, load_adapter, stop_token_ids, tokenizer_of
from workbench.model.loading import DTYPES, model_class, resolve_model_path, reward_config
from workbench.outputs.hub import check_hub_access, push_folder
from workbench.rundir.model_card import write_model_card_or_warn
from workbench.rundir.runs import load_run
from workbench.rundir.staging import give_default_modes, merge_staging_folder


# -- merging ----------------------------------------------------------------------------------


@leaves_the_process_as_found
def merge(run_dir: str | Path, out: str | Path | None = None, dtype: str = "bfloat16",
          push_to_hub: str | None = None) -> Path:
    """Fold a run's adapter into its base model and save a plain transformers folder (safetensors,
    tokenizer, chat template, generation config) that loads without peft. Returns the folder.

    The base is loaded unquantized in `dtype` even for QLoRA runs: merging into 4-bit weights would
    round the adapter's update away, so a QLoRA adapter merges into the dequantized base.
    `push_to_hub="owner/name"` uploads the folder afterwards (access is checked before merging).
    """
    from transformers import AutoModelForCausalLM

    quiet_libraries()
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
    if dtype not in DTYPES:
        raise RecipeError(f"--dtype: must be one of bf16, fp16, fp32 ({', '.join(DTYPES)}), got {dtype!r}")
    run = load_run(run_dir)
    out = Path(out) if out else run.dir.merged
    _check_out(out, run.path)
    if push_to_hub:
        check_hub_access(push_to_hub)  # fail in seconds, not after minutes of merging

    full_model = run.dir.model
    if full_model.exists():  # full fine-tuning: the model is already whole
        model = AutoModelForCausalLM.from_pretrained(full_model, dtype=DTYPES[dtype])
        tokenizer = tokenizer_of(full_model)
    else:
        check_adapter(run.path, run.adapter_dir)
        recipe = run.checked_recipe()
        base_path = resolve_model_path(recipe.model.path)
        options = hub_options(recipe.model)
        if recipe.training.scores_sequences:  # a reward model: the sequence classifier, its score head from the adapter
            options["config"] = reward_config(recipe, options.get("config"))
        base = model_class(recipe).from_pretrained(base_path, dtype=DTYPES[dtype], **options)
        model = load_adapter(base, run.adapter_dir).merge_and_unload()
        tokenizer = tokenizer_of(run.adapter_dir)
    model.config.use_cache = True  # training may have switched it off for gradient checkpointing
    generation = getattr(model, "generation_config", None)  # None: a reward model writes no text
    if generation is not None:
        if generation.pad_token_id is None:
            generation.pad_token_id = tokenizer.pad_token_id
        # a run's chat template may end turns with a token of its own (data.chat_template): generation stops there
        stops = stop_token_ids(model, tokenizer)
        if stops:
            generation.eos_token_id = stops if len(stops) > 1 else stops[0]

    # Written beside the target under a name of this merge's own and renamed into place, so a crash never
    # leaves a half model and no folder of the user's is taken for the staging one.
    staging = _staging_folder(out)
    try:
        # a full disk or a file size limit: one line, not a traceback
        with reported_as_write_error(f"--out: {escaped(out)}"):
            model.save_pretrained(staging, safe_serialization=True)  # also writes generation_config.json
            tokenizer.save_pretrained(staging)  # tokenizer files and chat_template.jinja
            write_model_card_or_warn(staging, run.path, kind="merged")  # README.md: how it was made, how to load it
            mark = {"written_by": "workbench merge", "run": str(run.path)}
            (staging / MERGE_MARK).write_text(json.dumps(mark) + "\n")
            give_default_modes(staging)
        _check_out(out, run.path)  # again: a folder may have been put there while the model was merged
        replaced = staging.with_name(staging.name + ".replaced")
        if out.exists() or out.is_symlink():
            os.rename(out, replaced)  # only an earlier merge or an empty folder (_check_out)
        os.rename(staging, out)
        shutil.rmtree(replaced, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if push_to_hub:
        push_folder(out, push_to_hub)
    return out


# Written into every merged folder: the mark of a folder that a later merge may replace (see `is_earlier_merge`).
MERGE_MARK = ".workbench-merge.json"


def is_earlier_merge(folder: Path) -> bool:
    """Whether `folder` is a model folder `merge` wrote (it holds MERGE_MARK)."""
    try:
        if folder.is_symlink() or not folder.is_dir():
            return False
        mark = json.loads((folder / MERGE_MARK).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("written_by") == "workbench merge"


def _check_out(out: Path, run_path: Path) -> None:
    """Refuse a target whose replacement would delete the run or anything else merge did not write: what exists
    at `out` is replaced only when it is an empty folder or an earlier merge (MERGE_MARK)."""
    target, run_path = out.resolve(), run_path.resolve()
    if target == run_path or target in run_path.parents or target == run_path / "adapter":
        raise WorkbenchError(f"--out: {escaped(out)} would overwrite the run itself; choose another folder")
    try:
        empty = out.is_dir() and not out.is_symlink() and not any(out.iterdir())
        taken = out.exists() or out.is_symlink()
    except OSError as err:
        raise WorkbenchError(f"--out: {escaped(out)}: {err.strerror or err}") from None
    if taken and not empty and not is_earlier_merge(out):
        raise WorkbenchError(f"--out: {escaped(out)} exists and was not written by workbench merge (only its own "
                             "merges are replaced); choose a new or empty folder")


def _staging_folder(out: Path) -> Path:
    try:
        return merge_staging_folder(out.parent)
    except OSError as err:
        raise WorkbenchError(f"--out: cannot write {escaped(out)} ({err.strerror or err})") from None
