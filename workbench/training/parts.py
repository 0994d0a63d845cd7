"""Pieces of the training loop: evaluation, the optimizer and schedule, the adapter's save, the progress bar."""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field

import torch

from workbench.base.errors import WorkbenchError, reported_as_write_error
from workbench.data.batches import STAND_IN
from workbench.distributed.accelerator import full_state_dict, host_transfer, sum_of_batches, unwrap
from workbench.distributed.trackers import log_to_trackers
from workbench.model.inference import Answer, answer
from workbench.rundir.model_card import write_model_card_or_warn
from workbench.rundir.runs import RunDir, replace_folder
from workbench.spec.adapter_init import InitialAdapter, parameter_groups, saving_converted
from workbench.spec.recipe import Recipe


@dataclass
class Progress:
    """Where the loop is; saved with every checkpoint so a resumed run continues exactly here."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    flops: float = 0.0
    skipped_steps: int = 0
    # the steps since the last metrics row, summed over ranks when a checkpoint was saved: a resumed run
    # logs them in its first row, so its figures equal an uninterrupted run's
    window: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


@torch.no_grad()
def evaluate(model, loader, accelerator, objective) -> dict | None:
    """The objective's figures over the held-out data: {"eval_loss": ..., and for preferences "eval_reward_margin",
    "eval_reward_accuracy", ...}."""
    if loader is None:
        return None
    was_training = model.training
    model.eval()
    sums = torch.zeros(len(objective.sum_names), device=accelerator.device)
    for batch in _on_device(loader, accelerator):
        # normalised by this batch's own counts; the report divides the summed parts by the totals. A stand-in
        # (a process with no rows left) runs the passes the others' collectives wait for, and counts nothing.
        part = objective.loss(model, batch, objective.counts(model, batch)).sums
        if not batch.get(STAND_IN):
            sums += part
    model.train(was_training)
    report = objective.report(sum_of_batches(accelerator, sums).cpu())
    return {f"eval_{k}": (round(v, 6) if v is not None else None) for k, v in report.items()}


def _write_eval(metrics, accelerator, step: int, figures: dict) -> None:
    metrics.write({"step": step, **figures})
    log_to_trackers(accelerator, {k: v for k, v in figures.items() if v is not None}, step)


def adamw_kernel(device_type: str, params=()) -> dict:
    """One fused kernel for the whole update on a GPU; the multi-tensor (foreach) path elsewhere. A tensor-parallel
    model's parameters mix DTensor slices with whole tensors, which neither kernel takes in one call: one update
    per parameter."""
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(p, DTensor) for group in params for p in (group["params"] if isinstance(group, dict)
                                                                  else [group])}
    if len(kinds) > 1:
        return {"foreach": False}
    return {"fused": True} if device_type == "cuda" else {"foreach": True}


def build_optimizer(model, recipe: Recipe, device_type: str = "cpu") -> torch.optim.Optimizer:
    cfg = recipe.training
    params = parameter_groups(model, recipe)  # one group, or LoRA+'s (peft's)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                 **adamw_kernel(device_type, params))
    import bitsandbytes as bnb

    cls = bnb.optim.AdamW8bit if cfg.optimizer == "adamw_8bit" else bnb.optim.PagedAdamW8bit
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def build_scheduler(optimizer, recipe: Recipe, total_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[recipe.training.scheduler]
    warmup = int(round(recipe.training.warmup_ratio * total_steps))
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


MAX_SKIPPED_STEPS, MAX_SKIPPED_FRACTION = 3, 0.1  # on_nonfinite: skip stops a run that skips more


def _window_totals(accelerator, sums, tokens: int, start: float) -> dict:
    """The current metrics window summed over ranks (one small all-reduce per checkpoint)."""
    totals = sum_of_batches(accelerator, torch.cat([sums.float(), torch.tensor([float(tokens)],
                                                                               device=sums.device)]))
    return {"sums": [float(x) for x in totals[:-1]], "tokens": int(totals[-1]), "seconds": time.perf_counter() - start}


def set_peak_lr(scheduler, lr: float) -> None:
    """A new peak learning rate for a resumed schedule: the same warmup and decay, scaled (each group keeps its
    scale: LoRA+'s B group stays lora_plus_ratio times the rest; a group of no scale, LoRA+'s embedding factors,
    keeps its own peak)."""
    groups = scheduler.optimizer.param_groups
    scales = [group.get("lr_scale", 1.0) for group in groups]
    scheduler.base_lrs = [peak if scale is None else lr * scale for scale, peak in zip(scales, scheduler.base_lrs)]
    for group, peak, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = peak
        group["lr"] = peak * factor(scheduler.last_epoch)


def _rounded(value: float | None) -> float | None:
    """For metrics.jsonl: None (null) rather than NaN, which is not JSON."""
    return None if value is None or not math.isfinite(value) else round(value, 6)


def _reports_after(step: int, total_steps: int, output) -> bool:
    """Whether this step writes a metrics row, evaluates, checkpoints or ends the run."""
    return step == total_steps or any(every and step % every == 0
                                      for every in (output.log_every, output.eval_every, output.save_every))


def _nonfinite_message(run: RunDir, first_bad: int, step: int, step_loss: torch.Tensor, grad_norm) -> str:
    latest = run.latest_checkpoint()
    kept = f"the last good checkpoint, {latest[1].name}, is kept" if latest else "no checkpoint was saved before it"
    if first_bad == step:
        norm = f", gradient norm {float(grad_norm)}" if isinstance(grad_norm, torch.Tensor) else ""
        seen = f" (loss {float(step_loss)}{norm})"
    else:  # a GPU run checks at the steps that log, evaluate or checkpoint (stopping.host_reads_every_step)
        seen = f" (found at step {step}'s check)"
    return (f"training.step {first_bad}: the loss or gradients are not finite{seen}; "
            f"{kept}. Lower training.lr, check the data, or set training.on_nonfinite: skip")


def save_adapter(accelerator, model, tokenizer, run: RunDir, recipe: Recipe,
                 initial: InitialAdapter | None = None) -> None:
    """The adapter (or a full fine-tune's model) into the run directory. `initial`: the A0/B0 of an init that
    rewrote the base (PiSSA, OLoRA), from which the adapter is saved converted for the published base."""
    accelerator.wait_for_everyone()
    unwrapped = unwrap(accelerator, model, keep_fp32_wrapper=False)
    state = full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        target = run.adapter if recipe.adapter.method != "full" else run.model
        # staged and renamed into place, as checkpoints are: a kill or a full disk mid-write leaves the
        # previous adapter (or none), never a half-written one
        staging = target.with_name(f".tmp-{target.name}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            with reported_as_write_error(target):
                if initial is not None:
                    with saving_converted(unwrapped):
                        unwrapped.save_pretrained(staging, state_dict=initial.convert(state), safe_serialization=True)
                else:
                    unwrapped.save_pretrained(staging, state_dict=state, safe_serialization=True)
                tokenizer.save_pretrained(staging)
                write_model_card_or_warn(staging, run.path, "adapter" if recipe.adapter.method != "full" else "merged")
                replace_folder(staging, target)
        finally:  # a write that failed (a full disk, a file size limit) leaves no half adapter behind
            shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()


def _sample_generations(recipe, model, tokenizer, accelerator) -> list[tuple[str, Answer]] | None:
    prompts = recipe.output.sample_prompts
    if not prompts or recipe.training.scores_sequences:  # a reward model scores text; it does not write any
        return None
    unwrapped = unwrap(accelerator, model)
    return [(p, answer(unwrapped, tokenizer, p, max_new_tokens=recipe.output.sample_max_new_tokens))
            for p in prompts]


def _checksums(model, accelerator) -> list[float]:
    """A fingerprint of the trainable weights each rank holds (replicas must agree exactly)."""
    local = sum(float(p.detach().double().sum()) + float(p.detach().double().abs().sum())
                for p in model.parameters() if p.requires_grad and p.numel())
    return [float(x) for x in accelerator.gather(torch.tensor([local], dtype=torch.float64,
                                                              device=accelerator.device))]


def _only_trainable_weights(models, weights, output_dir) -> None:
    """Checkpoints keep what training changes (adapter weights), not the frozen base model."""
    for i, model in enumerate(models[: len(weights)]):  # FSDP and DeepSpeed save through their own engines
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        weights[i] = {k: v for k, v in weights[i].items() if k in trainable}


def _on_device(loader, accelerator):
    """The loader's batches on this process's device."""
    from accelerate.utils import send_to_device

    non_blocking = host_transfer(accelerator.device.type)["non_blocking"]
    for batch in loader:
        yield send_to_device(batch, accelerator.device, non_blocking=non_blocking)


def _windows(batches, size: int):
    """Group micro-batches into optimizer steps (the last group of an epoch may be shorter)."""
    window = []
    for batch in batches:
        window.append(batch)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def _progress(total: int, done: int, enabled: bool):
    try:  # a widget bar in notebooks that have ipywidgets, a text bar everywhere else (and no warning)
        import ipywidgets  # noqa: F401
        from tqdm.auto import tqdm
    except ImportError:
        from tqdm.std import tqdm

    return tqdm(total=total, initial=done, disable=not enabled, desc="training", unit="step", dynamic_ncols=True)


def _flat(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat(value, name + "."))
        elif isinstance(value, (int, float, str, bool)):
            flat[name] = value
        elif value is not None:
            flat[name] = str(value)
    return flat


def ensure_trainable(model) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        raise WorkbenchError("no trainable parameters: check adapter.target_modules")
