"""Whether a run fits its device, found before the run directory is written: one forward, backward and optimizer
step on the data's longest micro-batch (the worst case, not the first), measured against the device's memory.

The step leaves nothing behind. Its learning rate is 0 (AdamW's update and its weight decay are then exact no-ops;
with gradients that are not all finite the optimizer does not step at all),
its gradients and the optimizer states it created are dropped after it, and the random state its dropout drew from
is put back: a checked run trains exactly as an unchecked one (tests/test_fit_check.py compares their losses).
DeepSpeed takes its optimizer step inside backward, at the recipe's rate, so its layouts are not checked this way,
and a stream's longest rows are not known before it is read.

With training.micro_batch_size auto, a split of training.batch_size that does not fit is followed by the next
smaller one (the session then deals its batches at the split that fit). A step that fits at none of them, or
at the recipe's own micro-batch, names the estimate's largest terms for this layout and the settings that keep
the global batch (micro-batch x accumulation x processes) and fit, each estimate scaled by what this step
measured against its own estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.base.errors import RecipeError
from workbench.base.units import format_bytes, parse_bytes
from workbench.distributed.accelerator import accumulation_boundary, sum_of_batches
from workbench.estimator.memory import layout_estimate
from workbench.hardware.current import StretchPeak, device_total_bytes, is_out_of_memory, release_cached_memory
from workbench.spec import batch_split
from workbench.spec.recipe import Recipe
from workbench.spec.strategies import Layout

PROPOSED = 3  # settings a refusal names (the first that fit, in the order below)


@dataclass(frozen=True)
class Budget:
    bytes: int
    source: str  # where it comes from, for the message


def budget_for(recipe: Recipe, device) -> Budget | None:
    """The memory the check holds the step to; None where the run is not checked."""
    setting = recipe.training.fit_check
    if setting is False:
        return None
    if recipe.distributed.device_memory is not None:
        return Budget(parse_bytes(recipe.distributed.device_memory), "distributed.device_memory")
    if setting == "auto" and device.type == "cpu":
        return None
    return Budget(device_total_bytes(device), "this machine's RAM" if device.type == "cpu" else "the device's memory")


def why_not_checked(recipe: Recipe, layout: Layout) -> str | None:
    if layout.strategy == "deepspeed":
        return "DeepSpeed takes its optimizer step inside backward"
    if layout.pipelines:
        return "a pipeline's stages run a step together, in its schedule"
    if recipe.data.streaming:
        return "a stream's longest rows are not known before it is read"
    return None


def worst_micro_batch(rows, micro_batch: int, collate) -> dict:
    """The micro-batch of the `micro_batch` longest training rows: padded to the longest, as the loop pads."""
    lengths = [len(ids) for ids in rows["input_ids"]]
    longest = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:micro_batch]
    return collate([rows[i] for i in longest])


def measure_step(accelerator, model, optimizer, objective, batch: dict) -> tuple[int, int, bool]:
    """(peak bytes, bytes held before it, whether the device ran out of memory) of one whole step on `batch`, leaving the model, its
    optimizer and the random state as they were."""
    device = accelerator.device
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer: no grad scaler, no accelerate hooks
    rates = [group["lr"] for group in inner.param_groups]
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out_of_memory, was_training = False, model.training
    model.train()  # as the loop steps: dropout on
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type), \
                StretchPeak(device) as peak:
            try:
                totals = sum_of_batches(accelerator, objective.counts(model, batch))
                with accumulation_boundary(accelerator, model, last=True):  # a whole step: gradients synchronised
                    accelerator.backward(objective.loss(model, batch, totals).loss)
                # AdamW at rate 0 adds 0 x its update: exact where the update is finite, NaN where the gradients
                # are not (a batch on_nonfinite: skip would drop); such a step's states are not created
                if _gradients_finite(accelerator, inner):
                    for group in inner.param_groups:
                        group["lr"] = 0.0
                    inner.step()
            except Exception as err:  # noqa: BLE001  only an allocation failure is the check's answer
                if not is_out_of_memory(err):
                    raise
                out_of_memory = True
    finally:
        for group, rate in zip(inner.param_groups, rates):
            group["lr"] = rate
        optimizer.zero_grad(set_to_none=True)
        inner.state.clear()  # the run's first step creates its states as if none had been
        model.train(was_training)
        release_cached_memory(device)
    return peak.bytes, peak.start, out_of_memory


def _gradients_finite(accelerator, optimizer) -> bool:
    """Whether every gradient the optimizer would apply is finite, on every process."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # a sharded one: this process's shard
    local = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
    flag = torch.tensor([0.0 if bool(local) else 1.0], device=accelerator.device)
    return not bool(accelerator.reduce(flag, reduction="sum").item()) if accelerator.num_processes > 1 else \
        not bool(flag.item())


def check(session) -> dict | None:
    """Run the check for a session whose model, optimizer and objective are prepared; RecipeError where the step
    does not fit. Returns what was measured (for the summary), or None where the run is not checked."""
    recipe, accelerator, layout = session.recipe, session.accelerator, session.layout
    budget = budget_for(recipe, accelerator.device)
    if budget is None:
        return None
    skipped = why_not_checked(recipe, layout)
    if skipped:
        accelerator.print(f"training.fit_check: not run ({skipped})")
        return {"fit_check": "skipped", "fit_check_reason": skipped}
    # training.micro_batch_size auto: the estimate's split first, then each smaller one, until a step fits
    choice = session.resolved.batch_choice
    micro_batches = [recipe.training.micro_batch_size]
    if choice is not None:
        micro_batches += [micro for micro in batch_split.splits(choice.batch_size) if micro < micro_batches[0]]
    for micro in micro_batches:
        batch = worst_micro_batch(session.data.train, micro, session.collate)
        peak, start, out_of_memory = _measured_everywhere(
            accelerator, measure_step(accelerator, session.model, session.optimizer, session.objective, batch))
        if not out_of_memory and peak <= budget.bytes:
            split = {"micro_batch_size": micro} if choice is not None else {}
            return {"fit_check": "fits", "fit_check_peak_bytes": peak, "fit_check_start_bytes": start,
                    "fit_check_budget_bytes": budget.bytes, **split}
        if micro != micro_batches[-1]:
            accelerator.print(f"training.micro_batch_size auto: micro-batch {micro} "
                              f"{'ran out of memory' if out_of_memory else f'peaked at {format_bytes(peak)}'} over "
                              f"{format_bytes(budget.bytes)} of {budget.source}; measuring a smaller split")
    if choice is not None:
        recipe = batch_split.split(recipe, choice.batch_size, micro)
    raise RecipeError(overflow_message(recipe, layout, accelerator.num_processes, accelerator.device.type,
                                       budget, peak, start, out_of_memory, batch["input_ids"].shape))


def _measured_everywhere(accelerator, measured: tuple[int, int, bool]) -> tuple[int, int, bool]:
    """The worst process's (peak, start, out of memory): every rank stops, or none."""
    if accelerator.num_processes == 1:
        return measured
    peak, start, out_of_memory = measured
    seen = accelerator.gather(torch.tensor([[peak, start, int(out_of_memory)]], device=accelerator.device))
    worst = int(seen[:, 0].argmax())
    return int(seen[worst, 0]), int(seen[worst, 1]), bool(seen[:, 2].max())


TERM_NAMES = {"other": "runtime and allocator"}  # the estimate's lump of what is not weights, states or activations


def overflow_message(recipe: Recipe, layout: Layout, world_size: int, device_type: str, budget: Budget, peak: int,
                     start: int, out_of_memory: bool, shape) -> str:
    estimated = layout_estimate(recipe, layout, world_size, device_type, budget.bytes)
    scale = max(1.0, peak / estimated["per_device_bytes"]) if estimated["per_device_bytes"] else 1.0
    terms = sorted(estimated["breakdown"].items(), key=lambda kv: -kv[1])
    largest = ", ".join(f"{TERM_NAMES.get(name, name)} {format_bytes(size)}" for name, size in terms[:3])
    what = ("ran out of the device's memory" if out_of_memory else
            f"peaked at {format_bytes(peak)} (the step itself {format_bytes(max(0, peak - start))} of it), over the "
            f"{format_bytes(budget.bytes)} of {budget.source}")
    proposals = fitting_settings(recipe, layout, world_size, device_type, budget.bytes, scale)
    offer = ("; settings that keep the global batch and fit (estimated): " + "; ".join(proposals) if proposals else
             "; no setting of micro-batch, accumulation, checkpointing or the chunked loss fits by the estimate: a "
             "device with more memory, adapter.method=qlora, or more processes with distributed.strategy=fsdp")
    return (f"training.fit_check: one step on the longest micro-batch of the data ({shape[0]} x {shape[1]} tokens) "
            f"{what}; the estimate's largest terms on {layout.name}: {largest}{offer}. The run directory was not "
            "written (training.fit_check=false skips the check)")


def fitting_settings(recipe: Recipe, layout: Layout, world_size: int, device_type: str, budget: int,
                     scale: float) -> list[str]:
    """Overrides that keep micro-batch x accumulation and whose estimate (x `scale`) fits: a smaller micro-batch
    with more accumulation, then checkpointing, then the chunked loss, each alone and with the one before."""
    train = recipe.training
    samples = train.micro_batch_size * train.grad_accum
    tried: list[list[str]] = []
    micro = train.micro_batch_size // 2
    while micro >= 1:
        if samples % micro == 0:
            tried.append([f"training.micro_batch_size={micro}", f"training.grad_accum={samples // micro}"])
        micro //= 2
    extra = []
    if not train.gradient_checkpointing:
        extra.append("training.gradient_checkpointing=true")
    if not train.fast_paths:
        extra.append("training.fast_paths=true")
    candidates = [[e] for e in extra] + tried + [split + extra for split in tried if extra]
    found = []
    for overrides in candidates:
        changed = recipe.override(*overrides)
        row = layout_estimate(changed, layout, world_size, device_type, budget)
        need = row["per_device_bytes"] * scale
        if need <= budget:
            found.append(f"{' '.join(overrides)} ({format_bytes(int(need))})")
        if len(found) == PROPOSED:
            break
    return found
