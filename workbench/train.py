"""The training loop: one Accelerate loop, read top to bottom.

    setup → data → model → optimizer → (resume) → for each step: accumulate, clip, step, log,
    eval, checkpoint → save adapter → summary in run.json
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader

from .attention import dense_mask_warning, flex_problem_for_run, model_drops_out, shares_prompts
from .attention import with_implementation as attention_for
from .data import STAND_IN, Collator, StepBatches, TrainRows, prepare_data
from .distributed import (Heartbeat, accumulation_boundary, build_accelerator, collective_failure, collective_timeout,
                          configure_threads, host_transfer, local_parameter_elements, patience,
                          release_accelerator_state, verify_launch)
from .errors import Interrupted, NonFiniteError, RecipeError, WorkbenchError
from .export import generate_text
from .fastpath import apply_fast_paths, compile_layers
from .hardware.catalogue import peak_flops
from .hardware.current import local_kind, node_count, world_size_from_env
from .launcher import check_launcher_agrees
from .lm_loss import full_logits_loss_sum, lm_loss_sum
from . import heap
from .memory import prediction_for_run
from .metrics import FlopCounter, MetricsWriter, peak_memory_mb, read_metrics
from . import checkpoints, objectives
from .compat import check_runtime
from .model_card import refresh_model_cards, write_model_card_or_warn
from .models import attach_adapter, count_parameters, load_base_model, load_config, load_tokenizer
from .precision import compute_dtype_of, resolve_recipe
from .preflight import check_disk_space, preflight
from .quiet import leaves_the_process_as_found, quiet_libraries
from .recipe import Recipe
from .resume import check_resume
from .runs import RunDir, TrainResult, environment, metrics_frame, replace_folder
from .stopping import NonFiniteWatch, StopRequest, agree, host_group, host_reads_every_step
from .strategies import Layout
from .strategies import resolve as resolve_layout
from .trackers import finish_trackers, log_summary, log_to_trackers, start_trackers


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


@leaves_the_process_as_found
def train(recipe: Recipe | dict | str | os.PathLike, *, resume: bool = False, overwrite: bool = False,
          progress_bar: bool | str = True) -> TrainResult:
    """Train the recipe in this process (one of N when launched with `accelerate launch`).
    progress_bar: True (a bar), False (quiet), or "lines" (a plain line per metrics row, for logs).

    Nothing in the run directory is touched until the recipe, the data and the model have been checked:
    a bad row or a refused resume leaves an earlier run exactly as it was."""
    started = time.perf_counter()
    if isinstance(recipe, dict):
        recipe = Recipe.from_dict(recipe)
    elif isinstance(recipe, (str, os.PathLike)):
        recipe = Recipe.load(recipe)
    elif not isinstance(recipe, Recipe):
        raise RecipeError(f"train: expects a Recipe, a mapping or a recipe file, got {type(recipe).__name__}")
    quiet_libraries()
    if resume and overwrite:
        raise WorkbenchError("--resume and --overwrite contradict each other: continue the run, or replace it")
    heap.training_starts()  # what the estimate of this run assumes (workbench/heap.py)
    run = RunDir(recipe.run_dir)
    threads, threads_why = configure_threads(recipe.training.threads)  # before the precision probe times matmuls
    changes, adjusted = {}, []
    if resume and run.recipe.exists():  # the run's own recipe says what may change (and what `auto` meant)
        recipe, changes, adjusted = check_resume(recipe, run, world_size_from_env())
    # `auto` precision becomes what this device computes fastest; every part below reads the concrete recipe.
    recipe, precision = resolve_recipe(recipe, local_kind())
    # Seconds, before any weights load: files, output folder, disk space, tokenizer, context length.
    tokenizer, model_config = load_tokenizer(recipe.model), load_config(recipe.model)  # loaded once, used twice
    requested_attn = recipe.model.attn
    recipe, attention = attention_for(recipe, local_kind(),  # the kernel, and how packed rows stay apart
                                      flex_problem=flex_problem_for_run(recipe, model_config, local_kind()))
    warnings = [*precision.warnings, *filter(None, [dense_mask_warning(attention, local_kind())]),
                *preflight(recipe, tokenizer, model_config, resume)]
    # one complete layout (stage, offload, sharding): `auto` becomes what the estimator chose, checked
    requested = recipe.distributed.strategy
    recipe, layout, why = resolve_layout(recipe, world_size_from_env(), node_count())
    check_launcher_agrees(layout.strategy)
    accelerator = build_accelerator(recipe, str(run.path), layout)
    verify_launch(accelerator, layout)
    main = accelerator.is_main_process
    if accelerator.num_processes > 1:
        accelerator.print(f"layout: {layout.name} ({why}), {accelerator.num_processes} processes, "
                          f"came up as {str(accelerator.distributed_type).split('.')[-1]}")
    for line in adjusted:
        accelerator.print(line)
    for warning in warnings:
        accelerator.print(f"warning: {warning}")
    taken = False

    def take_over(data_stats: dict) -> None:
        """Called by the loop once data and model are ready: only now is the run directory written."""
        nonlocal taken
        if main:
            if resume:
                check_same_data(run, data_stats)
            else:
                run.clear()  # an --overwrite replaces the earlier run only now, when the new one can start
            # saved as asked (`auto` stays auto: a resume on another world size chooses again)
            recipe.override(distributed__strategy=requested, model__attn=requested_attn).save(run.recipe)
            start = {"status": "running", "strategy": layout.strategy, "strategy_reason": why,
                     "layout": layout.to_json(), **precision.to_json(), **attention.to_json(),
                     "threads": threads, "threads_reason": threads_why, "warnings": warnings}
            if changes:
                latest = run.latest_checkpoint()
                history = run.read_json().get("summary", {}).get("resume_changes", [])
                start["resume_changes"] = [*history, {"from_step": latest[0] if latest else 0, "changes": changes}]
            run.update_json(env=environment(accelerator), summary=start)
        accelerator.wait_for_everyone()
        taken = True

    state, heartbeat = Progress(), Heartbeat(accelerator)
    try:
        if main:
            run.claim(resume=resume, overwrite=overwrite)  # the lock; refusals; nothing deleted yet
        accelerator.wait_for_everyone()
        with StopRequest() as stop:
            summary = _train(recipe, run, accelerator, resume, progress_bar, started, layout, attention, stop,
                             take_over, tokenizer, model_config, state, heartbeat)
    except BaseException as err:
        latest = run.latest_checkpoint()
        named = collective_failure(err, heartbeat, state.step, (recipe.distributed.startup_timeout_s,
                                                                recipe.distributed.timeout_s),
                                   latest[1].name if latest else None)
        if named is not None:
            err = named
        if main and taken:
            status = "interrupted" if isinstance(err, (KeyboardInterrupt, Interrupted)) else "failed"
            run.update_json(summary={"status": status, "error": f"{type(err).__name__}: {err}"})
        if named is not None:
            raise named from None
        raise
    finally:
        # trackers end with the run; the process group stays open for the process's next run (the CLI closes
        # it on exit), as reopening one over the same launch store can hang
        finish_trackers(accelerator)
        collective_timeout(recipe.distributed.startup_timeout_s)  # the limit the group was opened with
        run.release()
        release_accelerator_state()
    if main:
        summary = run.read_json()["summary"]  # with what was recorded at the start
    return TrainResult(run.path, summary, metrics_frame(read_metrics(run.metrics)))


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


def _train(recipe: Recipe, run: RunDir, accelerator, resume: bool, progress_bar: bool, started: float,
           layout: Layout, attention, stop: StopRequest, take_over, tokenizer, model_config, state: "Progress",
           heartbeat: Heartbeat) -> dict:
    cfg = recipe.training
    main = accelerator.is_main_process
    torch.manual_seed(cfg.seed)

    # -- data ---------------------------------------------------------------------------------
    with accelerator.main_process_first():
        data = prepare_data(recipe.data, tokenizer, seed=cfg.seed,
                            share_prompts=pairs_share_prompts(recipe, attention, model_config, run, resume))
    if data.stats.get("train_empty") and main:
        accelerator.print(f"warning: {data.stats['train_empty']} training sample(s) lost their whole answer to "
                          f"truncation at data.max_seq_len={recipe.data.max_seq_len} and are left out")
    collate = Collator(tokenizer.pad_token_id)
    # This process's own micro-batches, dealt so that each step holds the same samples on any layout, the short step
    # that ends an epoch too (accelerate does not shard this loader again). Its own generator: creating a loader
    # iterator must not draw from the global RNG that dropout uses, or a resumed run (which creates one more
    # iterator) would drift from an uninterrupted one.
    batches_of = StepBatches(len(data.train), cfg.micro_batch_size, accelerator.num_processes,
                             accelerator.process_index, seed=cfg.seed)
    pinned = host_transfer(accelerator.device.type)["pin_memory"]  # page-locked batches copy to a GPU asynchronously
    train_loader = DataLoader(TrainRows(data.train), batch_sampler=batches_of, collate_fn=collate,
                              generator=torch.Generator().manual_seed(cfg.seed), pin_memory=pinned)
    eval_loader = (DataLoader(data.eval, batch_size=cfg.micro_batch_size, collate_fn=collate, pin_memory=pinned)
                   if data.eval is not None else None)

    # -- model and optimizer ------------------------------------------------------------------
    check_runtime(recipe, accelerator.device.type, model_config)
    torch.manual_seed(cfg.seed)  # LoRA init must not depend on what data preparation consumed
    model = attach_adapter(load_base_model(recipe), recipe)
    if cfg.fast_paths:  # same results, less work: see workbench/fastpath.py
        fast = apply_fast_paths(model, getattr(torch, compute_dtype_of(recipe)))
        if data.stats.get("shared_prompts") and not fast["packed_attention"]:
            raise WorkbenchError(f"{recipe.model.path}: the per-sample attention that preference pairs holding their "
                                 "prompt once need could not be switched on for this model; start the run with "
                                 "training.fast_paths: false")
    if cfg.compile:
        compile_layers(model)
    loss_sum_of = lm_loss_sum if cfg.fast_paths else full_logits_loss_sum
    ensure_trainable(model)
    total_params, trainable_params = count_parameters(model)
    check_disk_space(recipe, trainable_params)
    flop_counter = FlopCounter(model, model.config)
    optimizer = build_optimizer(model, recipe, accelerator.device.type)
    latest = run.latest_checkpoint() if resume else None
    plan = (checkpoints.plan_resume(latest[1], layout, accelerator.num_processes, cfg.micro_batch_size,
                                    len(data.train), model) if latest else None)
    take_over(data.stats)  # everything checked: from here on the run directory is this run's

    model, optimizer = accelerator.prepare(model, optimizer)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)
    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    scheduler = build_scheduler(optimizer, recipe, total_steps)
    accelerator.register_save_state_pre_hook(_only_trainable_weights)

    # the loss: next-token (sft) or a preference (dpo's reference is this model with the adapter off)
    objective = objectives.build(recipe, loss_sum_of, objectives.adapter_off_of(accelerator.unwrap_model(model)))
    metrics = MetricsWriter(run.metrics, enabled=main)
    if plan is not None:
        how = checkpoints.load(accelerator, plan, model, optimizer, scheduler, state, cfg.micro_batch_size)
        metrics.truncate_after(state.step)
        accelerator.print(f"resumed from {plan.path} at step {state.step} ({how})")
    elif main:
        metrics.truncate_after(0)
    if accelerator.trackers == [] and recipe.output.trackers:
        start_trackers(accelerator, recipe.name, recipe.output.trackers, run.path, _flat(recipe.to_dict()), stop)

    summary = {"status": "running", "world_size": accelerator.num_processes, "total_steps": total_steps,
               "params": total_params, "trainable_params": trainable_params, **data.stats}
    if main:  # early, so a watcher (CLI, UI) can show "step i / total" while the run is going
        run.update_json(summary=summary)
    samples = _sample_generations(recipe, model, tokenizer, accelerator) if state.step == 0 else None
    eval_first = (evaluate(model, eval_loader, accelerator, objective)
                  if eval_loader is not None and state.step == 0 else None)
    if eval_first is not None:
        _write_eval(metrics, accelerator, 0, eval_first)
        eval_first = eval_first["eval_loss"]
    elif state.step > 0:  # resumed: the run's own step-0 evaluation stands
        eval_first = next((r["eval_loss"] for r in read_metrics(run.metrics)
                           if r.get("step") == 0 and r.get("eval_loss") is not None), None)

    # -- the loop -----------------------------------------------------------------------------
    bar = _progress(total_steps, state.step, enabled=progress_bar is True and main)
    model.train()
    window_sums = torch.zeros(len(objective.sum_names), device=accelerator.device)  # what the next row reports
    window_tokens, window_start = 0, time.perf_counter()
    if state.window:  # resumed mid-window
        if main:
            # (a checkpoint written before objectives kept [loss sum, targets])
            kept = state.window.get("sums") or [state.window["loss"], state.window["targets"]]
            window_sums += torch.tensor(kept, device=accelerator.device)
            window_tokens += state.window["tokens"]
        window_start -= state.window["seconds"]
        state.window = {}
    if resume and recipe.training.lr != scheduler.base_lrs[0]:  # a resume that lowers lr (allowed, recorded)
        set_peak_lr(scheduler, recipe.training.lr)
    last_loss, last_report = None, {}
    startup_s = time.perf_counter() - started  # what the user waits for before the first step
    collective_timeout(recipe.distributed.timeout_s)  # started together: from here a stall is a failure
    heartbeat.in_loop = True
    offload = (lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)) if cfg.activation_offloading else nullcontext
    watch = NonFiniteWatch(accelerator.device)
    reads_every_step = host_reads_every_step(accelerator.device.type, cfg.on_nonfinite)
    signal_group = (host_group(recipe.distributed.timeout_s)  # stop signals agreed without waiting for the GPU
                    if accelerator.num_processes > 1 and not reads_every_step else None)
    while state.step < total_steps:
        batches_of.set_epoch(state.epoch, skip=state.batches_in_epoch)
        for micro_batches in _windows(_on_device(train_loader, accelerator), cfg.grad_accum):
            step_start = time.perf_counter()
            step_loss = torch.zeros((), device=accelerator.device)
            step_sums = torch.zeros_like(window_sums)
            # what the step's loss is normalised by (its target tokens, or pairs), over every rank
            totals = accelerator.reduce(sum((objectives.counts(mb) for mb in micro_batches if not mb.get(STAND_IN)),
                                            torch.zeros(3, device=accelerator.device)), reduction="sum")
            for i, batch in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                # DDP averages gradients over ranks: scale by the world size to undo that mean. A stand-in (no sample
                # left here in an epoch's short last step) runs the passes the other processes wait for, adding nothing
                weight = 0 if batch.get(STAND_IN) else accelerator.num_processes
                with accumulation_boundary(accelerator, model, last), offload():
                    part = objective.loss(model, batch, totals)
                    accelerator.backward(part.loss * weight)
                if not weight:
                    continue
                step_loss += part.loss.detach()
                step_sums += part.sums
                # counted by the collator on the host: no device read per micro-batch
                window_tokens += batch["num_tokens"]
                state.flops += flop_counter.step_flops(batch["num_tokens"], batch["num_attended"],
                                                       reference_forward=objective.name == "dpo")
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
            watch.observe(state.step + 1, step_loss, grad_norm)
            decides = reads_every_step or _reports_after(state.step + 1, total_steps, recipe.output)
            first_bad, signum = agree(accelerator, watch.first if decides else None, stop, signal_group)
            if signum and not decides:  # stopping here: the checkpoint it writes must be checked first
                first_bad, signum = agree(accelerator, watch.first, stop)
            if first_bad and cfg.on_nonfinite == "stop":
                raise NonFiniteError(_nonfinite_message(run, first_bad, state.step + 1, step_loss, grad_norm))
            if first_bad:  # on_nonfinite: skip (read every step) — drop this update, keep the schedule
                watch.reset()
                state.skipped_steps += 1
                if state.skipped_steps > max(MAX_SKIPPED_STEPS, MAX_SKIPPED_FRACTION * (state.step + 1)):
                    raise NonFiniteError(f"training.on_nonfinite: skip dropped {state.skipped_steps} of "
                                         f"{state.step + 1} steps: the run is not training. "
                                         + _nonfinite_message(run, first_bad, state.step + 1, step_loss, grad_norm))
                metrics.write({"step": state.step + 1, "skipped": "non-finite loss or gradients"})
            else:
                optimizer.step()
                window_sums += step_sums
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            state.step += 1
            heartbeat.beat(state.step)
            state.batches_in_epoch += len(micro_batches)
            state.train_seconds += time.perf_counter() - step_start
            bar.update(1)

            if state.step % recipe.output.log_every == 0 or state.step == total_steps:
                # The only host sync of the loop: read the loss when a row is written.
                # loss None when every step of the window was skipped (on_nonfinite: skip)
                report = objective.report(accelerator.reduce(window_sums, reduction="sum").cpu())
                last_loss, last_report = report["loss"], report
                tokens_total = int(accelerator.reduce(torch.tensor(window_tokens, device=accelerator.device),
                                                      reduction="sum"))
                state.tokens += tokens_total
                elapsed = time.perf_counter() - window_start
                norm = _rounded(float(grad_norm)) if grad_norm is not None else None
                row = {"step": state.step, "epoch": state.epoch, "loss": _rounded(last_loss),
                       "lr": scheduler.get_last_lr()[0], "grad_norm": norm,
                       "tokens": state.tokens, "tokens_per_s": round(tokens_total / max(elapsed, 1e-9), 2),
                       "peak_memory_mb": round(peak_memory_mb(accelerator.device)[0], 1),
                       **{k: _rounded(v) for k, v in report.items() if k != "loss"}}
                metrics.write(row)
                log_to_trackers(accelerator, {k: v for k, v in row.items() if k != "step" and v is not None},
                                state.step)
                bar.set_postfix(loss=f"{last_loss:.4f}" if last_loss is not None else "skipped")
                if progress_bar == "lines" and main:  # a log file's progress (the UI's live log): one line a row
                    print(f"step {state.step}/{total_steps} | loss {row['loss']} | {row['tokens_per_s']:.0f} tokens/s "
                          f"| peak {row['peak_memory_mb']:.0f} MB", flush=True)
                window_sums.zero_()
                window_tokens, window_start = 0, time.perf_counter()

            if eval_loader is not None and recipe.output.eval_every and state.step % recipe.output.eval_every == 0 \
                    and state.step != total_steps:
                _write_eval(metrics, accelerator, state.step, evaluate(model, eval_loader, accelerator, objective))

            saved = bool(recipe.output.save_every and state.step % recipe.output.save_every == 0)
            if saved or signum:  # preempted or Ctrl-C: every rank stops here, after this step's checkpoint
                state.window = _window_totals(accelerator, window_sums, window_tokens, window_start)
                with patience(recipe.distributed.startup_timeout_s, then=recipe.distributed.timeout_s):
                    checkpoints.save(accelerator, run, layout, model, optimizer, scheduler, state,
                                     (cfg.micro_batch_size, cfg.grad_accum), recipe.output.keep_last)
            if signum:
                bar.close()
                raise Interrupted(f"interrupted by {signal.Signals(signum).name} after step {state.step}; checkpoint "
                                  f"{run.checkpoint(state.step).name} saved: run the same command with --resume to "
                                  "continue", signum)

            if state.step >= total_steps:
                break
        else:  # the epoch's data ran out before the step budget
            state.epoch += 1
            state.batches_in_epoch = 0
    bar.close()
    loop_end = time.perf_counter()
    collective_timeout(recipe.distributed.startup_timeout_s)  # rank 0 writes the adapter while the others wait
    heartbeat.in_loop = False

    # -- the end: final eval, adapter, summary --------------------------------------------------
    eval_final = evaluate(model, eval_loader, accelerator, objective) if eval_loader is not None else None
    if eval_final is not None:
        _write_eval(metrics, accelerator, state.step, eval_final)
        summary.update({f"{k}_final": v for k, v in eval_final.items() if k != "eval_loss"})
        eval_final = eval_final["eval_loss"]
    save_adapter(accelerator, model, tokenizer, run, recipe)
    if samples is not None:
        after = _sample_generations(recipe, model, tokenizer, accelerator)
        samples = [{"prompt": p, "before": b, "after": a} for (p, b), (_, a) in zip(samples, after)]

    peaks = accelerator.gather(torch.tensor([peak_memory_mb(accelerator.device)[0]], device=accelerator.device))
    held = accelerator.gather(torch.tensor([local_parameter_elements(model)], device=accelerator.device))
    device_peak, peak_source = peak_flops(accelerator.device.type, compute_dtype_of(recipe), torch.get_num_threads())
    world = accelerator.num_processes
    train_s = state.train_seconds
    # what the estimator predicts for this setup, beside what was measured (computed after the
    # measurement, so that building the estimate never shows in the measured peak)
    prediction = prediction_for_run(recipe, layout, world, accelerator.device.type)
    summary.update({
        "status": "completed", "steps": state.step, "epochs_started": state.epoch + 1, "tokens": state.tokens,
        "wall_s": round(time.perf_counter() - started, 2), "train_s": round(train_s, 2),
        "startup_s": round(startup_s, 2), "finish_s": round(time.perf_counter() - loop_end, 2),
        "tokens_per_s": round(state.tokens / max(train_s, 1e-9), 2),
        "tokens_per_s_per_device": round(state.tokens / max(train_s, 1e-9) / world, 2),
        "peak_memory_mb": round(float(peaks.max()), 1), "peak_memory_mb_per_rank": [round(float(p), 1) for p in peaks],
        "peak_memory_kind": peak_memory_mb(accelerator.device)[1],
        "mfu": round(state.flops / max(train_s, 1e-9) / device_peak, 5), "peak_flops": device_peak,
        "peak_flops_source": peak_source, "final_loss": last_loss,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "param_elements_per_rank": [int(n) for n in held], "trainable_checksum_per_rank": _checksums(model, accelerator),
        "eval_loss_first": eval_first, "eval_loss_final": eval_final, "strategy": layout.strategy,
        "layout": layout.to_json(),
        "skipped_steps": state.skipped_steps, "objective": objective.name,
        **{f"{k}_final": _rounded(v) for k, v in last_report.items() if k in objectives.PREFERENCE_METRICS},
        **prediction,
    })
    if samples is not None:
        summary["samples"] = samples
    if accelerator.is_main_process:
        run.update_json(summary=summary)
        log_summary(accelerator, run.read_json()["summary"], state.step)  # with what was recorded at the start
        refresh_model_cards(run.path)  # the card saved with the adapter predates these final figures
    return summary


# -- pieces of the loop ---------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, loader, accelerator, objective) -> dict | None:
    """The objective's figures over the held-out data: {"eval_loss": ..., and for preferences "eval_reward_margin",
    "eval_reward_accuracy", ...}."""
    if loader is None:
        return None
    was_training = model.training
    model.eval()
    sums = torch.zeros(len(objective.sum_names), device=accelerator.device)
    for batch in loader:
        # normalised by this batch's own counts; the report divides the summed parts by the totals
        sums += objective.loss(model, batch, objectives.counts(batch)).sums
    model.train(was_training)
    report = objective.report(accelerator.reduce(sums, reduction="sum").cpu())
    return {f"eval_{k}": (round(v, 6) if v is not None else None) for k, v in report.items()}


def _write_eval(metrics, accelerator, step: int, figures: dict) -> None:
    metrics.write({"step": step, **figures})
    log_to_trackers(accelerator, {k: v for k, v in figures.items() if v is not None}, step)


def adamw_kernel(device_type: str) -> dict:
    """One fused kernel for the whole update on a GPU; the multi-tensor (foreach) path elsewhere."""
    return {"fused": True} if device_type == "cuda" else {"foreach": True}


def build_optimizer(model, recipe: Recipe, device_type: str = "cpu") -> torch.optim.Optimizer:
    cfg = recipe.training
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **adamw_kernel(device_type))
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
    totals = accelerator.reduce(torch.cat([sums.float(), torch.tensor([float(tokens)], device=sums.device)]),
                                reduction="sum")
    return {"sums": [float(x) for x in totals[:-1]], "tokens": int(totals[-1]), "seconds": time.perf_counter() - start}


def set_peak_lr(scheduler, lr: float) -> None:
    """A new peak learning rate for a resumed schedule: the same warmup and decay, scaled."""
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)


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


def save_adapter(accelerator, model, tokenizer, run: RunDir, recipe: Recipe) -> None:
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        target = run.adapter if recipe.adapter.method != "full" else run.path / "model"
        # staged and renamed into place, as checkpoints are: a kill or a full disk mid-write leaves the
        # previous adapter (or none), never a half-written one
        staging = target.with_name(f".tmp-{target.name}")
        shutil.rmtree(staging, ignore_errors=True)
        unwrapped.save_pretrained(staging, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        write_model_card_or_warn(staging, run.path, "adapter" if recipe.adapter.method != "full" else "merged")
        replace_folder(staging, target)
    accelerator.wait_for_everyone()


def _sample_generations(recipe, model, tokenizer, accelerator) -> list[tuple[str, str]] | None:
    prompts = recipe.output.sample_prompts
    if not prompts:
        return None
    unwrapped = accelerator.unwrap_model(model)
    return [(p, generate_text(unwrapped, tokenizer, p, max_new_tokens=recipe.output.sample_max_new_tokens))
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
