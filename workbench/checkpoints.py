"""Checkpoints: written whole or not at all, and resumable on the layout that wrote them or on another one.

Each checkpoint holds two copies of the training state:

- the engine's own (`accelerator.save_state`: FSDP's sharded files, DeepSpeed's ZeRO partitions, RNG
  states per rank), which resumes exactly on the same layout and world size;
- a portable one (`portable.safetensors` + `portable.json`): the trainable weights and their AdamW
  moments, whole and keyed by parameter name, with the schedule and the loop's position counted in
  samples. Any layout gathers it (a collective, cheap for adapters) and single, DDP and FSDP load it,
  so a run written by 2 FSDP processes continues in one process, and one written in one process on 2.

`workbench_checkpoint.json` records the layout and world size that wrote the checkpoint; `load` picks
the copy that applies or refuses, naming both layouts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .errors import WorkbenchError
from .runs import RunDir, write_json_atomic
from .strategies import Layout

META = "workbench_checkpoint.json"
PORTABLE_TENSORS, PORTABLE_META = "portable.safetensors", "portable.json"
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state besides its step count


def save(accelerator, run: RunDir, layout: Layout, model, optimizer, scheduler, progress, micro_batch: int,
         keep_last: int) -> None:
    """The full training state, staged under a temporary name and renamed into place when complete."""
    staging = run.staging_checkpoint(progress.step)
    # DeepSpeed writes its own engine checkpoint: keep the frozen base weights out of it too.
    extra = {"exclude_frozen_parameters": True} if layout.strategy == "deepspeed" else {}
    accelerator.save_state(str(staging), safe_serialization=True, **extra)
    portable = _gather_portable(accelerator, model, optimizer, layout)  # every rank takes part
    _pause_for_crash_tests(progress.step)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if portable is not None:
            save_file(portable, str(staging / PORTABLE_TENSORS))
            write_json_atomic(staging / PORTABLE_META, {
                "progress": progress.state_dict(), "scheduler": _json_scheduler(scheduler),
                "adam_step": progress.step - progress.skipped_steps,
                "samples_in_epoch": progress.batches_in_epoch * micro_batch * accelerator.num_processes})
        write_json_atomic(staging / META, {"step": progress.step, "layout": layout.to_json(),
                                           "world_size": accelerator.num_processes, "micro_batch_size": micro_batch,
                                           "portable": portable is not None})
        run.publish_checkpoint(progress.step, keep_last)
    accelerator.wait_for_everyone()


def load(accelerator, path: Path, layout: Layout, model, optimizer, scheduler, progress, micro_batch: int) -> str:
    """Restore the state saved at `path` into this run's layout; returns how ("exact" or "portable")."""
    meta = read_meta(path)
    written = Layout.from_json(meta["layout"]) if meta.get("layout") else None
    if written == layout and meta.get("world_size") == accelerator.num_processes:
        # checkpoints hold trainable weights only; DeepSpeed names the same option its own way
        strict = {"load_module_strict": False} if layout.strategy == "deepspeed" else {"strict": False}
        accelerator.load_state(str(path), **strict)
        return "exact"
    where = f"{written.name} on {meta.get('world_size')} process(es)" if written else "an unrecorded layout"
    here = f"{layout.name} on {accelerator.num_processes} process(es)"
    problem = portable_problem(meta, layout)
    if problem:
        raise WorkbenchError(f"--resume: checkpoint {path.name} was written by {where} and this run is {here}: "
                             f"{problem}")
    _load_portable(accelerator, path, model, optimizer, scheduler, progress, micro_batch, where, here)
    return "portable"


def portable_problem(meta: dict, layout: Layout) -> str | None:
    """Why a checkpoint written on one layout cannot continue on `layout` (None: it can)."""
    if not meta.get("portable"):
        return ("it holds only its engine's own files (a full fine-tuning checkpoint, or one from an older "
                "version); resume it on the layout and process count that wrote it")
    if layout.strategy == "deepspeed":
        return ("a DeepSpeed engine loads only its own ZeRO partitions; resume on single, ddp or fsdp, or on the "
                "layout and process count that wrote it")
    return None


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


# -- the portable copy ----------------------------------------------------------------------------


def _gather_portable(accelerator, model, optimizer, layout: Layout) -> dict[str, torch.Tensor] | None:
    """Whole trainable weights and AdamW moments by parameter name, on the main process (None: not kept).

    Kept for adapters (small at any scale); a full fine-tuning's whole optimizer state is not gathered."""
    unwrapped = accelerator.unwrap_model(model)
    named = [(name, p) for name, p in unwrapped.named_parameters() if p.requires_grad]
    if not named or not any(getattr(p, "ds_numel", p.numel()) for p in unwrapped.parameters() if not p.requires_grad):
        return None  # full fine-tuning: nothing frozen (ZeRO-3 keeps a parameter's size in ds_numel)
    if layout.strategy != "deepspeed" and not isinstance(_torch_optimizer(optimizer), torch.optim.AdamW):
        return None  # a bitsandbytes optimizer keeps quantized states of its own (DeepSpeed runs AdamW only)
    tensors: dict[str, torch.Tensor] = {}
    if layout.strategy == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        for name, param in named:  # collectives: every rank, same order
            tensors[f"weight/{name}"] = safe_get_full_fp32_param(param).detach().float().cpu()
            for key in MOMENTS:
                tensors[f"{key}/{name}"] = safe_get_full_optimizer_state(param, key).detach().float().cpu()
        return tensors if accelerator.is_main_process else None
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    weights = get_model_state_dict(unwrapped, options=options)
    moments = get_optimizer_state_dict(unwrapped, _torch_optimizer(optimizer), options=options)["state"]
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


def _load_portable(accelerator, path: Path, model, optimizer, scheduler, progress, micro_batch: int,
                   where: str, here: str) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    meta = json.loads((path / PORTABLE_META).read_text())
    tensors = load_file(str(path / PORTABLE_TENSORS))
    unwrapped = accelerator.unwrap_model(model)
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False)
    weights = {k.removeprefix("weight/"): v for k, v in tensors.items() if k.startswith("weight/")}
    trainable = {name for name, p in unwrapped.named_parameters() if p.requires_grad}
    if set(weights) != trainable:
        raise WorkbenchError(f"--resume: checkpoint {path.name} ({where}) holds other trainable weights than this "
                             f"run ({here}): {sorted(set(weights) ^ trainable)[:3]}")
    set_model_state_dict(unwrapped, weights, options=options)
    torch_optimizer = _torch_optimizer(optimizer)
    # this optimizer's own full state (created if it has none yet), then the saved moments put in it
    state_dict = get_optimizer_state_dict(unwrapped, torch_optimizer, options=options)
    step = float(meta["adam_step"])
    for name in trainable:
        state_dict["state"][name] = {"step": torch.tensor(step), **{k: tensors[f"{k}/{name}"] for k in MOMENTS}}
    set_optimizer_state_dict(unwrapped, torch_optimizer, state_dict, options=options)
    scheduler.load_state_dict({"lr_lambdas": [None] * len(scheduler.lr_lambdas), **meta["scheduler"]})
    for group, lr in zip(torch_optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # the rate of the saved step (the optimizer's own groups were created fresh)
    progress.load_state_dict(meta["progress"])
    # the loop's place in the epoch, counted in samples: the same samples come next at any process count
    per_step = micro_batch * accelerator.num_processes
    samples = int(meta["samples_in_epoch"])
    if samples % per_step:
        raise WorkbenchError(f"--resume: checkpoint {path.name} ({where}) stopped {samples} samples into its epoch, "
                             f"which {here} with micro-batch {micro_batch} cannot continue from exactly; keep the "
                             "micro-batch size times the process count a divisor of it")
    progress.batches_in_epoch = samples // per_step


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer


def _json_scheduler(scheduler) -> dict:
    state = scheduler.state_dict()
    return {k: v for k, v in state.items() if k != "lr_lambdas"}


def _pause_for_crash_tests(step: int) -> None:
    """LORA_WORKBENCH_CHECKPOINT_PAUSE=STEP:SECONDS holds checkpoint STEP half-written for that long, so a
    test can kill the process inside the write window (tests/test_crash.py)."""
    wanted, _, seconds = os.environ.get("LORA_WORKBENCH_CHECKPOINT_PAUSE", "").partition(":")
    if wanted == str(step):
        time.sleep(float(seconds or 0))
