"""Checkpoints: written whole or not at all, and resumable on the layout that wrote them or on another one.

Each checkpoint holds two copies of the training state:

- the engine's own (`accelerator.save_state`: FSDP's sharded files, DeepSpeed's ZeRO partitions, RNG
  states per rank), which resumes exactly on the same layout and world size (tensor parallel and pipeline
  parallel keep none: `Layout.keeps_engine_state`);
- a portable one (`portable.safetensors` + `portable.json`): the trainable weights and their AdamW
  moments, whole and keyed by parameter name, with the schedule and the loop's position counted in
  samples. Any layout gathers it (a collective, cheap for adapters) and every layout but ZeRO's loads it,
  so a run written by 2 FSDP processes continues in one process, and one written in one process on 2. A
  pipeline's stages each load their own parameters' tensors from it (they keep their global names).

`workbench_checkpoint.json` records the layout and world size that wrote the checkpoint, and the loop's
state and the schedule as JSON; `load` restores the copy that `resume.choose` picked (which decides whether a
checkpoint may continue a run, and how).

Nothing in a checkpoint is unpickled: Accelerate loads its own files with `weights_only=True`, but the objects
registered with `register_for_checkpointing` come back through a full unpickle, which runs whatever code the
file names. The workbench keeps its own state in JSON instead, and never resumes from a checkpoint that holds
such pickles (earlier versions wrote them; one planted in a workspace the UI serves would run there).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import reprlib
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from safetensors.torch import load_file, save_file

from workbench.base.errors import WorkbenchError, escaped, reported_as_write_error
from workbench.distributed.accelerator import unwrap
from workbench.distributed.pipeline import gather_on_main
from workbench.rundir.runs import CHECKPOINT_PREFIX, RunDir, write_json_atomic
from workbench.spec.strategies import Layout

if TYPE_CHECKING:
    from workbench.training.resume import CheckpointChoice

META = "workbench_checkpoint.json"
PORTABLE_TENSORS, PORTABLE_META = "portable.safetensors", "portable.json"
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state besides its step count
STEP_KEY = re.compile(r"[0-9]{1,18}")  # a step number as run.json names it (ASCII digits, a 64-bit count)
_SHORT = reprlib.Repr()  # a value quoted in a message stays short, however big it is
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 60, 60, 2, 4, 4


def save(accelerator, run: RunDir, layout: Layout, model, optimizer, scheduler, progress, batch: tuple[int, int],
         keep_last: int, run_id: str | None = None) -> None:
    """The full training state, staged under a temporary name and renamed into place when complete.
    batch: (micro_batch_size, grad_accum) of this run; run_id: the run's own (run.json), which the checkpoint
    carries so that no other run's checkpoint continues this one."""
    micro_batch, grad_accum = batch
    staging = run.staging_checkpoint(progress.step)
    target = run.checkpoint(progress.step)  # what a failed write names (a full disk: one line, not a traceback)
    try:
        if layout.keeps_engine_state:
            with reported_as_write_error(target):
                accelerator.save_state(str(staging), safe_serialization=True, **layout.save_state_options)
        elif accelerator.is_main_process:  # the portable copy alone, in the folder the engine would have made
            staging.mkdir(parents=True, exist_ok=True)
        portable = _gather_portable(accelerator, model, optimizer, layout)  # every rank takes part
        streams = layout.batch_streams(accelerator.num_processes)
        _pause_for_crash_tests(progress.step)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            with reported_as_write_error(target):
                if portable is not None:
                    save_file(portable, str(staging / PORTABLE_TENSORS))
                    write_json_atomic(staging / PORTABLE_META, {
                        "progress": progress.state_dict(), "scheduler": _json_scheduler(scheduler),
                        "adam_step": progress.step - progress.skipped_steps,
                        "samples_in_epoch": progress.batches_in_epoch * micro_batch * streams})
                write_json_atomic(staging / META, {
                    "step": progress.step, "layout": layout.to_json(), "world_size": accelerator.num_processes,
                    "micro_batch_size": micro_batch, "grad_accum": grad_accum, "portable": portable is not None,
                    "progress": progress.state_dict(), "scheduler": _json_scheduler(scheduler),
                    **({"run_id": run_id} if run_id else {}), "files": manifest(staging)})
                # run.json names each checkpoint it publishes by its record's digest, before it is published: a
                # checkpoint of a copy of the run, or with its record edited, is then no checkpoint of this run
                run.update_json(checkpoints={str(progress.step): manifest_digest(staging / META)})
                run.publish_checkpoint(progress.step, keep_last)
    except Exception:  # a write that failed (a full disk, a file size limit): no half checkpoint stays behind
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()


def load(accelerator, plan: CheckpointChoice, model, optimizer, scheduler, progress, batch: tuple[int, int]) -> str:
    """Restore the checkpoint `resume.choose` picked into this run; returns how ("exact" or "portable").
    batch: (micro_batch_size, batch streams) of this run (Layout.batch_streams)."""
    if plan.how == "exact":
        settings = [{k: v for k, v in group.items() if k != "params"}  # the recipe's
                    for group in _torch_optimizer(optimizer).param_groups]
        accelerator.load_state(str(plan.path), **_layout_of(plan).load_state_options)
        _load_schedule(scheduler, plan.meta["scheduler"])
        # the optimizer's settings stay the recipe's and its rates the schedule's: optimizer.bin carries its own
        # (the step's rate among them), which nothing else checks and the first resumed step would train at
        groups = _torch_optimizer(optimizer).param_groups  # (loading replaced the groups)
        for group, setting, rate in zip(groups, settings, scheduler.get_last_lr()):
            group.update(setting, lr=rate)
        progress.load_state_dict(plan.meta["progress"])
    else:
        _load_portable(accelerator, plan, model, optimizer, scheduler, progress, *batch)
    return plan.how


# -- what ties a checkpoint's files together -------------------------------------------------------------


def manifest(folder: Path) -> dict[str, list]:
    """{file: [bytes, sha256]} of every file in a checkpoint but its meta, taken when all of them are written:
    a file swapped in from another step or run, cut short, or gone (the ranks' random states, whose loss
    Accelerate only logs) is then damage that the resume names, not a run that silently trains on."""
    return {file.relative_to(folder).as_posix(): [file.stat().st_size, manifest_digest(file)]
            for file in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != META)}


def check_published(path: Path, step: int, published: dict | None, required: bool = False) -> None:
    """The checkpoint is one this run published: run.json names its record's digest. `required`: the run is one
    this version wrote (resume.ResumePlan.records_checkpoints), which publishes every checkpoint it continues from;
    otherwise (an earlier version's run) a run.json that names none is not checked."""
    if not published and not required:
        return
    if not published:
        raise WorkbenchError("--resume: the run's run.json names none of its checkpoints (checkpoints: missing or "
                             "empty), where the run recorded each as it saved it; restore it, or start the run "
                             "again (--overwrite)")
    if not isinstance(published, dict) or not all(isinstance(k, str) and STEP_KEY.fullmatch(k) and isinstance(v, str)
                                                   for k, v in published.items()):
        raise WorkbenchError("--resume: the run's run.json is damaged (checkpoints: expected step numbers naming "
                             "digests); restore it, or start the run again (--overwrite)")
    if published.get(str(step)) != manifest_digest(path / META):
        raise WorkbenchError(f"--resume: checkpoint {escaped(path)} is not one this run published (run.json names "
                             f"{'another record' if str(step) in published else 'no checkpoint'} at step {step}: "
                             "a checkpoint copied in from another run, or a copy of this one, or its "
                             f"{META} edited); delete it to resume from the one before")


def check_files(path: Path, meta: dict) -> None:
    """The checkpoint's files are the ones its meta recorded, byte for byte, and no other (a checkpoint that
    records none was written by an earlier version)."""
    recorded = meta.get("files")
    if recorded is None:
        return
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != META}
    unlisted = sorted(present - set(recorded))
    if unlisted:
        raise damage(path, META, "files", f"the folder holds {_key(unlisted[0])}, which the record does not list")
    inside = path.resolve()
    for name, (size, sha256) in recorded.items():
        file = path / name
        # a record names files of its own folder only: nothing outside it is read, through a name or a link
        if "\0" in name or Path(name).is_absolute() or ".." in Path(name).parts or \
                not file.resolve().is_relative_to(inside):
            raise damage(path, META, f"files.{_key(name)}", "names a file outside the checkpoint")
        if not file.is_file():
            raise damage(path, META, f"files.{_key(name)}", "recorded, and missing from the folder")
        held = file.stat().st_size
        if held != size or manifest_digest(file) != sha256:
            raise damage(path, META, f"files.{_key(name)}", f"the file holds other bytes than were written "
                         f"({held} bytes, recorded {size})")


def manifest_digest(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_meta(path: Path) -> dict:
    """workbench_checkpoint.json, checked against what the workbench writes (CheckpointMeta): a checkpoint
    without a readable, well-formed one is damaged, and the message names the field."""
    meta = _read_json(path, META, CheckpointMeta)
    if len(meta) > 1:  # the oldest hold their step alone; every later one says what wrote it
        for key in ("layout", "world_size", "micro_batch_size"):
            if key not in meta:
                raise damage(path, META, key, "missing (every checkpoint that records more than its step has it)")
    if meta["step"] != _folder_step(path, meta["step"]):  # the folder is where the resume starts counting from
        raise damage(path, META, "step", f"{meta['step']}, in the folder of step {_folder_step(path, None)}")
    if "progress" in meta:  # the loop's state: since it was written, with what wrote it and the schedule
        for key in ("grad_accum", "scheduler"):
            if key not in meta:
                raise damage(path, META, key, "missing (every checkpoint that records the loop's progress has it)")
        _check_progress(path, META, meta["progress"], meta["step"])
        _check_schedule(path, META, meta["scheduler"], meta["step"])
    elif "scheduler" in meta:
        raise damage(path, META, "progress", "missing (every checkpoint that records its schedule has it)")
    return meta


def _check_schedule(path: Path, name: str, scheduler: dict, step: int) -> None:
    """The schedule stepped once per optimizer step (a skipped update included): its counters are the step's,
    or it would continue at another point of warmup and decay."""
    if scheduler["last_epoch"] != step:
        raise damage(path, name, "scheduler.last_epoch", f"{scheduler['last_epoch']}, in the checkpoint of step {step}")
    if scheduler.get("_step_count") is not None and scheduler["_step_count"] != step + 1:
        raise damage(path, name, "scheduler._step_count", f"{scheduler['_step_count']}, in the checkpoint of step "
                     f"{step} (the schedule counts its construction as a step)")


def _folder_step(path: Path, otherwise: int | None) -> int | None:
    """The step the checkpoint's folder is named after (step-N); `otherwise` for a folder named otherwise."""
    number = path.name.removeprefix(CHECKPOINT_PREFIX)
    return int(number) if number.isascii() and number.isdigit() else otherwise


def _check_progress(path: Path, name: str, progress: dict, step: int) -> None:
    """What ties the loop's fields to each other and to the checkpoint's step."""
    if progress["step"] != step:
        raise damage(path, name, "progress.step", f"{progress['step']}, in the checkpoint of step {step}")
    if progress.get("skipped_steps", 0) > step:
        raise damage(path, name, "progress.skipped_steps",
                       f"{progress['skipped_steps']}, more than its {step} steps")
    if progress.get("epoch", 0) > step:  # every epoch the loop finished took a step at least
        raise damage(path, name, "progress.epoch", f"{progress['epoch']}, more than its {step} steps")


def _read_json(path: Path, name: str, schema: type[BaseModel]) -> dict:
    """The JSON file `name` of checkpoint `path`, validated by `schema`; a WorkbenchError naming the file and the
    field otherwise. Returned as read: the schema is strict, so what passed holds the types it names."""
    try:
        data = json.loads((path / name).read_text(), parse_constant=_no_constant)
    except (OSError, ValueError) as err:
        raise damage(path, name, None, f"{type(err).__name__}: {err}") from None
    try:
        schema.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = "".join(f"[{part}]" if isinstance(part, int) else f".{_key(part)}" for part in first["loc"]).lstrip(".")
        problem = first["msg"].removeprefix("Value error, ")
        if "input" in first and first["type"] != "missing" and not isinstance(first["input"], dict):
            problem += f", got {_SHORT.repr(first['input'])}"
        raise damage(path, name, field or None, problem) from None
    return data


def _key(name: str) -> str:
    """A key as the message shows it: quoted where it would break the line or run long (a key the file made up)."""
    return name if name.isprintable() and len(name) <= 40 else _SHORT.repr(name)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON holds")  # json reads NaN and Infinity unless told not to


def damage(path: Path, name: str, field: str | None, problem: str) -> WorkbenchError:
    where = f"{name}: {field}" if field else name
    return WorkbenchError(f"--resume: checkpoint {escaped(path)} is damaged ({where}: {problem}); delete it to "
                          "resume from the one before")


# -- what the JSON files hold ----------------------------------------------------------------------


class _Written(BaseModel):
    """Exactly what the workbench writes: a key no version writes, or a count given as "3", 3.5 or true, is
    damage, refused here in one line rather than as a traceback (or a wrong run) once the state loads."""

    model_config = ConfigDict(extra="forbid", strict=True)


Count = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]
Amount = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class WindowState(_Written):
    """The metrics window a checkpoint cut in two (Progress.window), summed over the processes: the objective's
    sums (or, written before objectives kept sums, the loss and its targets), tokens and seconds."""

    sums: list[Finite] | None = Field(None, min_length=1)
    loss: Finite | None = None
    targets: Finite | None = None
    tokens: Count
    seconds: Amount

    @model_validator(mode="after")
    def _a_loss(self):
        if self.sums is None and (self.loss is None or self.targets is None):
            raise ValueError("a window holds its sums (or its loss and targets)")
        return self


# Generous ceilings for the counters no step count bounds: a century of training, and far more FLOPs than any
# run does (1e30 is a million years of an exaflop machine); a value past them is damage, not a long run.
MOST_SECONDS, MOST_FLOPS = 100 * 365 * 86400.0, 1e30


class ProgressState(_Written):
    """Where the loop was (training/parts.py Progress; the fields an earlier version did not write default).
    The epoch and tokens are bounded by the step count in `_check_progress` and by the recipe in resume.choose."""

    step: Count
    epoch: Count = 0
    batches_in_epoch: Count = 0
    tokens: Count = 0
    train_seconds: Annotated[Amount, Field(le=MOST_SECONDS)] = 0.0
    flops: Annotated[Amount, Field(le=MOST_FLOPS)] = 0.0
    skipped_steps: Count = 0
    window: WindowState | None = None  # {}: none open

    _nothing_open = field_validator("window", mode="before")(lambda value: None if value == {} else value)


Rate = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class SchedulerState(_Written):
    """The schedule's state: torch's LambdaLR state_dict less its functions (`_json_scheduler`). Its private keys
    vary with torch's version (`verbose` in older ones, `_is_initial` in newer), so each is optional; any other
    key, or one of another type, is refused here: load_state_dict would take it and fail later as a traceback."""

    base_lrs: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(min_length=1)
    last_epoch: Count
    step_count: Count | None = Field(None, alias="_step_count")
    last_lr: list[Rate] | None = Field(None, alias="_last_lr", min_length=1)
    get_lr_called_within_step: bool | None = Field(None, alias="_get_lr_called_within_step")
    is_initial: bool | None = Field(None, alias="_is_initial")
    verbose: bool | None = None

    @model_validator(mode="after")
    def _a_rate_per_group(self):
        if self.last_lr is not None and len(self.last_lr) != len(self.base_lrs):
            raise ValueError(f"_last_lr holds {len(self.last_lr)} rates for {len(self.base_lrs)} groups")
        return self


class LayoutState(_Written):
    """strategies.Layout.to_json."""

    strategy: Literal["single", "ddp", "fsdp", "deepspeed", "tp", "pp"]
    stage: Annotated[int, Field(ge=0, le=3)] = 0
    hybrid: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    name: str | None = None
    shards: list[str] = []
    offloads: list[str] = []


class CheckpointMeta(_Written):
    """workbench_checkpoint.json. The oldest checkpoints hold only their step (resume.choose refuses them by name);
    every later one the layout, processes and micro-batch that wrote it; this version's the loop and schedule too."""

    step: Count
    layout: LayoutState | None = None
    world_size: Positive | None = None
    micro_batch_size: Positive | None = None
    grad_accum: Positive | None = None
    portable: bool = False
    progress: ProgressState | None = None
    scheduler: SchedulerState | None = None
    run_id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")] | None = None  # the run that wrote it (run.json's)
    files: dict[str, Annotated[tuple[Count, Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]],
                               Field(strict=False)]] | None = None  # manifest(): [bytes, sha256] each


class PortableMeta(_Written):
    """portable.json: the loop and schedule, AdamW's step count and the samples read of the epoch."""

    progress: ProgressState
    scheduler: SchedulerState
    adam_step: Amount
    samples_in_epoch: Count


def pickled_files(path: Path) -> list[str]:
    """Objects Accelerate would load from `path` through a full unpickle (earlier versions wrote them)."""
    return sorted(f.name for f in path.glob("custom_checkpoint_*.pkl"))


# what accelerate's load_state opens for the one model and optimizer of a single-process or DDP run (it falls back
# to the .bin weights, and names that when both are missing); FSDP and DeepSpeed write folders their engines read
ENGINE_FILES = (("model.safetensors", "pytorch_model.bin"), ("optimizer.bin",))


def missing_engine_file(path: Path, layout: Layout) -> str | None:
    """The first file of the engine's own copy that checkpoint `path` lacks for `layout`, or None."""
    if layout.strategy not in ("single", "ddp"):
        return None
    for names in ENGINE_FILES:
        if not any((path / name).is_file() for name in names):
            return names[0]
    return None


def _layout_of(plan: CheckpointChoice) -> Layout:
    return Layout.from_json(plan.meta["layout"])


def read_portable(path: Path, model) -> dict:
    """portable.json, after checking that it and portable.safetensors hold every trainable weight's tensors in
    this model's shapes."""
    from safetensors import safe_open

    damaged = f"--resume: checkpoint {escaped(path)} is damaged"
    portable = _read_json(path, PORTABLE_META, PortableMeta)
    step = _folder_step(path, portable["progress"]["step"])
    _check_progress(path, PORTABLE_META, portable["progress"], step)
    _check_schedule(path, PORTABLE_META, portable["scheduler"], step)
    if portable["adam_step"] > step:  # one AdamW step for each step that was not skipped
        raise damage(path, PORTABLE_META, "adam_step", f"{portable['adam_step']}, more than its {step} steps")
    updates = step - portable["progress"].get("skipped_steps", 0)
    if portable["adam_step"] != updates:  # AdamW's bias correction would be another step's
        raise damage(path, PORTABLE_META, "adam_step", f"{portable['adam_step']}, where its {step} steps less "
                     f"{step - updates} skipped made {updates} updates")
    try:
        with safe_open(str(path / PORTABLE_TENSORS), framework="pt") as tensors:
            shapes = {key: tuple(tensors.get_slice(key).get_shape()) for key in tensors.keys()}
    except Exception as err:  # noqa: BLE001  any unreadable part: one message
        raise WorkbenchError(f"{damaged} ({PORTABLE_TENSORS}: {type(err).__name__}: {err}); "
                             "delete it to resume from the one before") from None
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        for kind in ("weight", *MOMENTS):
            if shapes.get(f"{kind}/{name}") != tuple(param.shape):
                raise WorkbenchError(f"{damaged}: {PORTABLE_TENSORS} has no {kind} of shape {tuple(param.shape)} "
                                     f"for {name} (found {shapes.get(f'{kind}/{name}')}); delete it to resume from "
                                     "the one before, or resume with the adapter settings that wrote it")
    return portable


# -- the portable copy ----------------------------------------------------------------------------


def _gather_portable(accelerator, model, optimizer, layout: Layout) -> dict[str, torch.Tensor] | None:
    """Whole trainable weights and AdamW moments by parameter name, on the main process (None: not kept).

    Kept for adapters (small at any scale); a full fine-tuning's whole optimizer state is not gathered."""
    unwrapped = unwrap(accelerator, model)
    named = [(name, p) for name, p in unwrapped.named_parameters() if p.requires_grad]
    if not named or not any(getattr(p, "ds_numel", p.numel()) for p in unwrapped.parameters() if not p.requires_grad):
        return None  # full fine-tuning: nothing frozen (ZeRO-3 keeps a parameter's size in ds_numel)
    if not layout.gathers_through_deepspeed and not isinstance(_torch_optimizer(optimizer), torch.optim.AdamW):
        return None  # a bitsandbytes optimizer keeps quantized states of its own (DeepSpeed runs AdamW only)
    tensors: dict[str, torch.Tensor] = {}
    if layout.gathers_through_deepspeed:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        for name, param in named:  # collectives: every rank, same order
            tensors[f"weight/{name}"] = safe_get_full_fp32_param(param).detach().float().cpu()
            for key in MOMENTS:
                tensors[f"{key}/{name}"] = safe_get_full_optimizer_state(param, key).detach().float().cpu()
        return tensors if accelerator.is_main_process else None
    if layout.pipelines:  # each stage holds its own parameters and their moments: gathered on the main process
        state = _torch_optimizer(optimizer).state
        for name, param in named:
            tensors[f"weight/{name}"] = param.detach().float().contiguous()
            for key in MOMENTS:
                tensors[f"{key}/{name}"] = state[param][key].detach().float().contiguous()
        return gather_on_main(accelerator, tensors)
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    if _sharded(unwrapped):  # FSDP2: the full tensors, gathered (collectives: every rank)
        weights = get_model_state_dict(unwrapped, options=options)
        moments = get_optimizer_state_dict(unwrapped, _torch_optimizer(optimizer), options=options)["state"]
    else:  # whole on every rank; 8-bit layers' extra state keys (SCB) would trip torch's state-dict walk
        state = _torch_optimizer(optimizer).state
        weights = dict(named)
        moments = {name: state[p] for name, p in named if state.get(p)}
    if not accelerator.is_main_process:
        return None
    trainable = {name for name, _ in named}
    for name, value in weights.items():
        if name in trainable:  # not the quantization state that 4-bit layers add to their state dict
            tensors[f"weight/{name}"] = value.detach().float().cpu().contiguous()
    for name, state in moments.items():
        for key in MOMENTS:
            tensors[f"{key}/{name}"] = state[key].detach().float().cpu().contiguous()
    return tensors


def _sharded(model) -> bool:
    """Whether FSDP2 shards the model's parameters (DTensors) in this process."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _load_portable(accelerator, plan: CheckpointChoice, model, optimizer, scheduler, progress, micro_batch: int,
                   streams: int) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    meta = plan.portable
    tensors = load_file(str(plan.path / PORTABLE_TENSORS))
    unwrapped = unwrap(accelerator, model)
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False)
    trainable = [name for name, p in unwrapped.named_parameters() if p.requires_grad]
    set_model_state_dict(unwrapped, {name: tensors[f"weight/{name}"] for name in trainable}, options=options)
    torch_optimizer = _torch_optimizer(optimizer)
    # this optimizer's own full state (created if it has none yet), then the saved moments put in it
    state_dict = get_optimizer_state_dict(unwrapped, torch_optimizer, options=options)
    step = float(meta["adam_step"])
    for name in trainable:
        state_dict["state"][name] = {"step": torch.tensor(step), **{k: tensors[f"{k}/{name}"] for k in MOMENTS}}
    set_optimizer_state_dict(unwrapped, torch_optimizer, state_dict, options=options)
    _load_schedule(scheduler, meta["scheduler"])
    for group, lr in zip(torch_optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # the rate of the saved step (the optimizer's own groups were created fresh)
    progress.load_state_dict(meta["progress"])
    # the loop's place in the epoch, counted in samples: the same samples come next at any process count (an
    # epoch that ended on a short step is skipped whole, and the loop starts the next)
    per_step = micro_batch * streams
    progress.batches_in_epoch = math.ceil(int(meta["samples_in_epoch"]) / per_step)


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer


def _json_scheduler(scheduler) -> dict:
    state = scheduler.state_dict()
    return {k: v for k, v in state.items() if k != "lr_lambdas"}


def check_schedule(plan: CheckpointChoice, scheduler) -> None:
    """The rates the chosen copy's schedule records are what its own warmup and decay give at its step (the
    portable path's first step trains at them, and metrics.jsonl would log others). Before the run directory is
    written: `scheduler` is this run's, built for its steps."""
    name, state = (PORTABLE_META, plan.portable["scheduler"]) if plan.how == "portable" else \
        (META, plan.meta["scheduler"])
    rates = _rates_at(scheduler, state["base_lrs"], state["last_epoch"])
    recorded = state.get("_last_lr")
    if recorded is not None and (len(recorded) != len(rates) or any(
            not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip(recorded, rates))):
        raise damage(plan.path, name, "scheduler._last_lr", f"{_SHORT.repr(recorded)}, where its schedule gives "
                     f"{_SHORT.repr([float(f'{r:.6g}') for r in rates])} at step {state['last_epoch']}")


def _rates_at(scheduler, base_lrs: list[float], step: int) -> list[float]:
    return [base * rule(step) for base, rule in zip(base_lrs, scheduler.lr_lambdas)]


def _load_schedule(scheduler, state: dict) -> None:
    """The schedule's state, its rates those its own warmup and decay give at its step (check_schedule compared
    them with the recorded ones)."""
    scheduler.load_state_dict({"lr_lambdas": [None] * len(scheduler.lr_lambdas), **state})
    scheduler._last_lr = _rates_at(scheduler, scheduler.base_lrs, scheduler.last_epoch)


def _pause_for_crash_tests(step: int) -> None:
    """LORA_WORKBENCH_CHECKPOINT_PAUSE=STEP:SECONDS holds checkpoint STEP half-written for that long, so a
    test can kill the process inside the write window (tests/test_crash.py)."""
    wanted, _, seconds = os.environ.get("LORA_WORKBENCH_CHECKPOINT_PAUSE", "").partition(":")
    if wanted == str(step):
        time.sleep(float(seconds or 0))
