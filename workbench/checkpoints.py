"""Checkpoints: written whole or not at all, and resumable on the layout that wrote them or on another one.

Each checkpoint holds two copies of the training state:

- the engine's own (`accelerator.save_state`: FSDP's sharded files, DeepSpeed's ZeRO partitions, RNG
  states per rank), which resumes exactly on the same layout and world size;
- a portable one (`portable.safetensors` + `portable.json`): the trainable weights and their AdamW
  moments, whole and keyed by parameter name, with the schedule and the loop's position counted in
  samples. Any layout gathers it (a collective, cheap for adapters) and single, DDP and FSDP load it,
  so a run written by 2 FSDP processes continues in one process, and one written in one process on 2.

`workbench_checkpoint.json` records the layout and world size that wrote the checkpoint, and the loop's
state and the schedule as JSON; `load` restores the copy that `resume.choose` picked (which decides whether a
checkpoint may continue a run, and how).

Nothing in a checkpoint is unpickled: Accelerate loads its own files with `weights_only=True`, but the objects
registered with `register_for_checkpointing` come back through a full unpickle, which runs whatever code the
file names. The workbench keeps its own state in JSON instead, and never resumes from a checkpoint that holds
such pickles (earlier versions wrote them; one planted in a workspace the UI serves would run there).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from typing import TYPE_CHECKING
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .distributed import unwrap
from .errors import WorkbenchError, reported_as_write_error
from .runs import RunDir, write_json_atomic
from .strategies import Layout

if TYPE_CHECKING:
    from .resume import CheckpointChoice

META = "workbench_checkpoint.json"
PORTABLE_TENSORS, PORTABLE_META = "portable.safetensors", "portable.json"
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state besides its step count


def save(accelerator, run: RunDir, layout: Layout, model, optimizer, scheduler, progress, batch: tuple[int, int],
         keep_last: int) -> None:
    """The full training state, staged under a temporary name and renamed into place when complete.
    batch: (micro_batch_size, grad_accum) of this run."""
    micro_batch, grad_accum = batch
    staging = run.staging_checkpoint(progress.step)
    target = run.checkpoint(progress.step)  # what a failed write names (a full disk: one line, not a traceback)
    try:
        with reported_as_write_error(target):
            accelerator.save_state(str(staging), safe_serialization=True, **layout.save_state_options)
        portable = _gather_portable(accelerator, model, optimizer, layout)  # every rank takes part
        _pause_for_crash_tests(progress.step)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            with reported_as_write_error(target):
                if portable is not None:
                    save_file(portable, str(staging / PORTABLE_TENSORS))
                    write_json_atomic(staging / PORTABLE_META, {
                        "progress": progress.state_dict(), "scheduler": _json_scheduler(scheduler),
                        "adam_step": progress.step - progress.skipped_steps,
                        "samples_in_epoch": progress.batches_in_epoch * micro_batch * accelerator.num_processes})
                write_json_atomic(staging / META, {
                    "step": progress.step, "layout": layout.to_json(), "world_size": accelerator.num_processes,
                    "micro_batch_size": micro_batch, "grad_accum": grad_accum, "portable": portable is not None,
                    "progress": progress.state_dict(), "scheduler": _json_scheduler(scheduler)})
                run.publish_checkpoint(progress.step, keep_last)
    except Exception:  # a write that failed (a full disk, a file size limit): no half checkpoint stays behind
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()


def load(accelerator, plan: CheckpointChoice, model, optimizer, scheduler, progress, micro_batch: int) -> str:
    """Restore the checkpoint `resume.choose` picked into this run; returns how ("exact" or "portable")."""
    if plan.how == "exact":
        accelerator.load_state(str(plan.path), **_layout_of(plan).load_state_options)
        _load_schedule(scheduler, plan.meta["scheduler"])
        progress.load_state_dict(plan.meta["progress"])
    else:
        _load_portable(accelerator, plan, model, optimizer, scheduler, progress, micro_batch)
    return plan.how


def read_meta(path: Path) -> dict:
    """workbench_checkpoint.json, checked: a checkpoint without a readable one is damaged."""
    try:
        meta = json.loads((path / META).read_text())
        meta["step"] = int(meta["step"])
        if "layout" in meta or len(meta) > 1:
            meta["world_size"], meta["micro_batch_size"] = int(meta["world_size"]), int(meta["micro_batch_size"])
            Layout.from_json(meta["layout"])
        return meta
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise WorkbenchError(f"--resume: checkpoint {path} is damaged ({META}: {type(err).__name__}: {err}); "
                             "delete it to resume from the one before") from None


def pickled_files(path: Path) -> list[str]:
    """Objects Accelerate would load from `path` through a full unpickle (earlier versions wrote them)."""
    return sorted(f.name for f in path.glob("custom_checkpoint_*.pkl"))


def _layout_of(plan: CheckpointChoice) -> Layout:
    return Layout.from_json(plan.meta["layout"])


def read_portable(path: Path, model) -> dict:
    """portable.json, after checking that it and portable.safetensors hold every trainable weight's tensors in
    this model's shapes."""
    from safetensors import safe_open

    damaged = f"--resume: checkpoint {path} is damaged"
    try:
        portable = json.loads((path / PORTABLE_META).read_text())
        for key in ("progress", "scheduler", "adam_step", "samples_in_epoch"):
            portable[key]  # noqa: B018  present
        int(portable["samples_in_epoch"]), float(portable["adam_step"])
        with safe_open(str(path / PORTABLE_TENSORS), framework="pt") as tensors:
            shapes = {key: tuple(tensors.get_slice(key).get_shape()) for key in tensors.keys()}
    except Exception as err:  # noqa: BLE001  any unreadable part: one message
        raise WorkbenchError(f"{damaged} ({PORTABLE_META} / {PORTABLE_TENSORS}: {type(err).__name__}: {err}); "
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


def _load_portable(accelerator, plan: CheckpointChoice, model, optimizer, scheduler, progress, micro_batch: int) -> None:
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
    per_step = micro_batch * accelerator.num_processes
    progress.batches_in_epoch = math.ceil(int(meta["samples_in_epoch"]) / per_step)


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer


def _json_scheduler(scheduler) -> dict:
    state = scheduler.state_dict()
    return {k: v for k, v in state.items() if k != "lr_lambdas"}


def _load_schedule(scheduler, state: dict) -> None:
    scheduler.load_state_dict({"lr_lambdas": [None] * len(scheduler.lr_lambdas), **state})


def _pause_for_crash_tests(step: int) -> None:
    """LORA_WORKBENCH_CHECKPOINT_PAUSE=STEP:SECONDS holds checkpoint STEP half-written for that long, so a
    test can kill the process inside the write window (tests/test_crash.py)."""
    wanted, _, seconds = os.environ.get("LORA_WORKBENCH_CHECKPOINT_PAUSE", "").partition(":")
    if wanted == str(step):
        time.sleep(float(seconds or 0))
