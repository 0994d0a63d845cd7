"""One training run: one Accelerate loop, read top to bottom.

    setup → setup_data → setup_model → take_over → prepare → before_training →
    run (each epoch: each step: accumulate, clip, step; log_row, maybe_evaluate, maybe_checkpoint) →
    finish (final eval, adapter, summary in run.json)

Nothing in the run directory is touched until the recipe, the data and the model have been checked (`take_over`):
a bad row or a refused resume leaves an earlier run exactly as it was.
"""

from __future__ import annotations

import math
import os
import signal
import time
import uuid
from contextlib import nullcontext
from dataclasses import replace

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from workbench.base.builtin import is_builtin, resolve_builtin
from workbench.base.errors import Interrupted, NonFiniteError, RecipeError, WorkbenchError, escaped, printable
from workbench.base.metrics import FlopCounter, MetricsWriter, read_metrics
from workbench.data.batches import STAND_IN, Collator, StepBatches, TrainRows, FirstEpochBatches, first_rows
from workbench.data.prepared import prepare_data
from workbench.data.streaming import StreamBatches, stream_data
from workbench.distributed.accelerator import (Heartbeat, accumulation_boundary, batch_readers, batch_replicas,
                                               build_accelerator, clip_gradients, collective_failure,
                                               collective_timeout,
                                               configure_threads, host_transfer, local_parameter_elements, patience,
                                               release_accelerator_state, sum_of_batches, unwrap, verify_launch)
from workbench.distributed.pipeline import Pipeline
from workbench.distributed.stopping import NonFiniteWatch, StopRequest, agree, host_group, host_reads_every_step
from workbench.distributed.trackers import finish_trackers, log_summary, log_to_trackers, start_trackers
from workbench.estimator.memory import prediction_for_run
from workbench.hardware.catalogue import peak_flops
from workbench.hardware.current import local_kind, node_count, peak_memory_mb, world_size_from_env
from workbench.hardware.precision import compute_dtype_of
from workbench.model import base_fingerprint
from workbench.model.fastpath import apply_fast_paths, compile_layers, lora_fast_paths
from workbench.model.lm_loss import full_logits_loss_sum, lm_loss_sum
from workbench.model.loading import attach_adapter, count_parameters, load_base_model
from workbench.rundir.model_card import refresh_model_cards
from workbench.rundir.run_summary import PEAK_MEMORY_MB, RunSummary
from workbench.rundir.runs import RunDir, TrainResult, environment, process_owner, read_result
from workbench.spec import adapter_init, batch_split
from workbench.spec.compat import check_runtime
from workbench.spec.recipe import Recipe
from workbench.training import checkpoints, fit_check, losses, objectives
from workbench.training.parts import (MAX_SKIPPED_FRACTION, MAX_SKIPPED_STEPS, Progress, _checksums, _flat,
                                      _nonfinite_message, _on_device, _only_trainable_weights, _progress,
                                      _reports_after, _rounded, _sample_generations, _window_totals, _windows,
                                      _write_eval, build_optimizer, build_scheduler, ensure_trainable, evaluate,
                                      save_adapter, set_peak_lr)
from workbench.training.preflight import check_disk_space
from workbench.training.resolved import resolve_run
from workbench.training.resume import agree_on_resume, claim


def clear_stop_request(run: RunDir) -> None:
    try:
        run.stop_request.unlink(missing_ok=True)
    except OSError as err:  # a folder in its place
        raise WorkbenchError(f"{run.stop_request}: cannot clear the stop request ({err.strerror or err}); remove it "
                             "and start again") from None


class TrainingSession:
    """One run of a recipe in this process (one of N when launched with `accelerate launch`); its state lives here."""

    def __init__(self, recipe: Recipe, *, resume: bool, overwrite: bool, progress_bar: bool | str, started: float):
        self.recipe, self.resume, self.overwrite = recipe, resume, overwrite
        self.progress_bar, self.started = progress_bar, started
        self.run_dir = RunDir(recipe.run_dir)
        self.summary = RunSummary()
        self.taken = False  # whether the run directory is this run's (a failure is recorded there only then)
        self.auto_resume = False  # --resume auto decided `resume` (the same command continues the run)

    # -- setup: seconds, before any weights load ----------------------------------------------------------------

    def setup(self) -> None:
        """The resolved run (resume plan, precision, attention, layout), the preflight checks and the accelerator."""
        run, s = self.run_dir, self.summary
        # before anything reads the base model (a folder written while it loads is found in take_over); by the
        # process that writes the run, before there is an accelerator to say which that is
        self.base_files = None
        if os.environ.get("RANK", "0") == "0":
            if is_builtin(self.recipe.model.path):  # built now rather than as it loads: its files are fingerprinted
                resolve_builtin(self.recipe.model.path)
            self.base_files = base_fingerprint.stat_digest(self.recipe.model.path)
            s.base_model = base_fingerprint.fingerprint(self.recipe.model.path)
        # before the precision probe times matmuls
        s.threads, s.threads_reason = configure_threads(self.recipe.training.threads)
        self.resolved, self.tokenizer, self.model_config = resolve_run(
            self.recipe, run, resume=self.resume, world_size=world_size_from_env(), nodes=node_count(),
            device_kind=local_kind())
        self.recipe = recipe = self.resolved.recipe  # from here on, the one recipe every stage reads
        self.layout = layout = self.resolved.layout
        # what the estimator predicts for this setup, kept beside what the run measures: taken before the
        # accelerator exists (ZeRO-3's model construction hooks, active from then on, cannot build a meta model)
        self.prediction = prediction_for_run(recipe, layout, world_size_from_env(), local_kind())
        self.accelerator = accelerator = build_accelerator(recipe, str(run.path), layout)
        verify_launch(accelerator, layout)
        if self.auto_resume:
            agree_on_resume(accelerator, self.resume, run.path)
        self.cfg, self.main = recipe.training, accelerator.is_main_process
        s.strategy, s.strategy_reason, s.layout = layout.strategy, self.resolved.layout_reason, layout.to_json()
        s.precision, s.attention = self.resolved.precision.to_json(), self.resolved.attention.to_json()
        s.warnings = list(self.resolved.warnings)
        if accelerator.num_processes > 1:
            accelerator.print(f"layout: {layout.name} ({self.resolved.layout_reason}), {accelerator.num_processes} "
                              f"processes, came up as {str(accelerator.distributed_type).split('.')[-1]}")
        for line in self.resolved.resume.notes:  # notes and warnings name paths and recipe values: escaped
            accelerator.print(printable(line))
        for warning in s.warnings:
            accelerator.print(f"warning: {printable(warning)}")
        self.state, self.heartbeat = Progress(), Heartbeat(accelerator)

    def execute(self) -> TrainResult:
        """Claim the run directory and train; a failure is recorded in run.json once the directory is this run's."""
        run, accelerator = self.run_dir, self.accelerator
        try:
            if self.main:
                claim(run, resume=self.resume, overwrite=self.overwrite)  # the lock; refusals; nothing deleted yet
            accelerator.wait_for_everyone()
            with StopRequest() as self.stop:
                self.setup_data()
                self.setup_model()
                self.prepare_model()
                self.check_fit()  # one step on the longest micro-batch, where the device's memory is checked
                self.take_over()  # everything checked: from here on the run directory is this run's
                self.prepare()
                self.before_training()
                self.run()
                self.finish()
        except BaseException as err:
            named = self.record_failure(err)
            if named is not None:
                raise named from None
            raise
        finally:
            # trackers end with the run; the process group stays open for the process's next run (the CLI closes
            # it on exit), as reopening one over the same launch store can hang
            finish_trackers(accelerator)
            collective_timeout(self.recipe.distributed.startup_timeout_s)  # the limit the group was opened with
            run.release()
            release_accelerator_state()
        # rank 0's summary is run.json's, with what was recorded at the start
        return read_result(run.path, None if self.main else self.summary.at_end())

    def record_failure(self, err: BaseException) -> BaseException | None:
        """The failure in run.json; returns the error a stalled collective is better named as (or None)."""
        latest = self.run_dir.latest_checkpoint()
        distributed = self.recipe.distributed
        named = collective_failure(err, self.heartbeat, self.state.step,
                                   (distributed.startup_timeout_s, distributed.timeout_s),
                                   latest[1].name if latest else None)
        if named is not None:
            err = named
        if self.main and self.taken:
            self.summary.status = "interrupted" if isinstance(err, (KeyboardInterrupt, Interrupted)) else "failed"
            self.summary.error = f"{type(err).__name__}: {err}"
            self.run_dir.update_json(summary=self.summary.at_failure())
        return named

    def setup_data(self) -> None:
        recipe, cfg, accelerator = self.recipe, self.cfg, self.accelerator
        torch.manual_seed(cfg.seed)
        streamed = recipe.data.streaming
        with accelerator.main_process_first():
            self.data = (stream_data if streamed else prepare_data)(
                recipe.data, self.tokenizer, seed=cfg.seed,
                share_prompts=self.resolved.resume.share_prompts(recipe, self.resolved.attention, self.model_config),
                whole_only=cfg.scores_sequences)
        # the data a resumed run reads is the data its checkpoints counted: checked before any checkpoint is chosen
        self.resolved.resume.check_data(self.data.stats)
        # (a stream has read its first buffer: what it left out so far)
        among = f" (of the first {self.data.stats['train_opening_rows']} rows read)" if streamed else ""
        if self.data.stats.get("train_cut") and self.main:
            accelerator.print(f"warning: {self.data.stats['train_cut']} training pair(s){among} longer than "
                              f"data.max_seq_len={recipe.data.max_seq_len} are left out (a reward model scores whole "
                              "answers)")
        if self.data.stats.get("train_empty") and self.main:
            accelerator.print(f"warning: {self.data.stats['train_empty']} training sample(s){among} lost their whole "
                              f"answer to truncation at data.max_seq_len={recipe.data.max_seq_len} and are left out")
        self.collate = Collator(self.tokenizer.pad_token_id)
        self.deal_batches()

    def deal_batches(self) -> None:
        """The loaders of this process's micro-batches, at the recipe's micro-batch (dealt again where the fit
        check took a smaller split of training.batch_size)."""
        cfg, accelerator, collate, streamed = self.cfg, self.accelerator, self.collate, self.recipe.data.streaming
        # (data parallel: one stream of batches per process; a tensor-parallel group reads one stream together)
        self.readers, self.replicas = batch_readers(accelerator), batch_replicas(accelerator)
        readers, reader = self.readers
        # This process's own micro-batches, dealt so that each step holds the same samples on any layout, the short step
        # that ends an epoch too (accelerate does not shard this loader again). Its own generator: creating a loader
        # iterator must not draw from the global RNG that dropout uses, or a resumed run (which creates one more
        # iterator) would drift from an uninterrupted one.
        # page-locked batches copy to a GPU asynchronously
        pinned = host_transfer(accelerator.device.type)["pin_memory"]
        if streamed:  # dealt alike, as the stream is read (workbench/data/streaming.py)
            self.batches_of = StreamBatches(self.data.train, collate, cfg.micro_batch_size, readers, reader)
            self.train_loader = self.batches_of
        else:
            self.batches_of = StepBatches(len(self.data.train), cfg.micro_batch_size, readers, reader, seed=cfg.seed)
            self.train_loader = DataLoader(TrainRows(self.data.train), batch_sampler=self.batches_of,
                                           collate_fn=collate, generator=torch.Generator().manual_seed(cfg.seed),
                                           pin_memory=pinned)
        # the held-out rows dealt the same way, in file order: each row scored once on one process (accelerate's
        # sharding would repeat rows to even out the processes, and count them twice)
        self.eval_loader = (DataLoader(TrainRows(self.data.eval), collate_fn=collate, pin_memory=pinned,
                                       batch_sampler=StepBatches(len(self.data.eval), cfg.micro_batch_size,
                                                                 readers, reader, shuffle=False))
                            if self.data.eval is not None else None)

    def setup_model(self) -> None:
        """The model with its adapter, the optimizer, and (resuming) the plan for loading the checkpoint."""
        recipe, cfg, device_type = self.recipe, self.cfg, self.accelerator.device.type
        check_runtime(recipe, device_type, self.model_config)
        torch.manual_seed(cfg.seed)  # LoRA init must not depend on what data preparation consumed
        init = adapter_init.of(recipe)
        calibration = first_rows(self.data.train, cfg.seed, adapter_init.CORDA_ROWS) if init.before_adapter else None
        base = load_base_model(recipe, tp_size=self.accelerator.num_processes if self.layout.splits_layers else 1)
        if init.needs_data and device_type == "cuda" and not self.layout.shards_weights and recipe.quantization is None:
            base.to(self.accelerator.device)  # a data-driven init's forward passes run where training will
        model = attach_adapter(base, recipe, calibration)
        # PiSSA and OLoRA rewrote the base: their A0/B0, to save the adapter converted for the published base
        self.initial_adapter = adapter_init.InitialAdapter.of(model) if adapter_init.of(recipe).changes_base else None
        if cfg.fast_paths:  # same results, less work: see workbench/model/fastpath.py
            fast = apply_fast_paths(model, getattr(torch, compute_dtype_of(recipe)))
            if self.data.stats.get("shared_prompts") and not fast["packed_attention"]:
                raise WorkbenchError(f"{recipe.model.path}: the per-sample attention that preference pairs holding "
                                     "their prompt once need could not be switched on for this model; start the run "
                                     "with training.fast_paths: false")
        self.eva_components = self.data_driven_init(model) if init.needs_data and not init.before_adapter else None
        if self.eva_components is not None and cfg.fast_paths:
            lora_fast_paths(model)  # the layers whose rank EVA changed were rebuilt with peft's own dropout
        if cfg.compile:
            compile_layers(model)
        self.loss_sum_of = lm_loss_sum if cfg.fast_paths else full_logits_loss_sum
        ensure_trainable(model)
        self.summary.params, self.summary.trainable_params = count_parameters(model)
        check_disk_space(recipe, self.summary.trainable_params)
        self.flop_counter = FlopCounter(model, model.config)
        # pipeline parallel: this process keeps its own stage of the model, adapter attached whole (workbench/
        # distributed/pipeline.py); the optimizer holds the stage's own parameters
        self.pipeline = (Pipeline(model, self.accelerator, recipe, self.tokenizer.pad_token_id)
                         if self.layout.pipelines else None)
        self.model, self.optimizer = model, build_optimizer(model, recipe, device_type)
        self.resolved.resume.choose_checkpoint(self.layout, self.accelerator.num_processes, cfg.micro_batch_size,
                                        math.inf if self.recipe.data.streaming else len(self.data.train), model,
                                        [(group["lr"], group.get("lr_scale", 1.0))
                                         for group in self.optimizer.param_groups])

    def data_driven_init(self, model) -> dict:
        """adapter.init eva: A from this run's training data (the first epoch as one process is dealt it, on every
        rank alike), or, resuming, the components the run saved, so that the adapter is the one it started with."""
        saved = None
        if self.resume:
            path = self.run_dir.path / adapter_init.EVA_FILE
            if not path.exists():
                raise WorkbenchError(f"{escaped(path)}: missing; the run's EVA initialisation cannot be repeated "
                                     "exactly (--overwrite starts it again)")
            saved = load_file(str(path))
        else:
            longest = max(map(len, self.data.train["input_ids"])) * min(self.cfg.micro_batch_size, len(self.data.train))
            problem = adapter_init.eva_problem(self.recipe, longest)
            if problem:
                raise RecipeError(problem)
        batches = FirstEpochBatches(self.data.train, Collator(self.tokenizer.pad_token_id), self.cfg.micro_batch_size,
                                    1, 0, self.cfg.seed)
        with torch.no_grad():
            return adapter_init.initialize_eva(model, batches, saved)

    def take_over(self) -> None:
        """Called once data and model are ready: only now is the run directory written."""
        run = self.run_dir
        if self.main:
            clear_stop_request(run)  # a request the run it was meant for has answered
            # any write between the fingerprint and now (a file swapped and swapped back: another inode, ctime)
            if base_fingerprint.stat_digest(self.recipe.model.path) != self.base_files:
                raise WorkbenchError(f"model.path: the files of {escaped(self.recipe.model.path)} changed while the "
                                     "run loaded them; start it again when nothing writes there")
            if self.resume:
                self.resolved.resume.check_base_model(self.recipe.model.path)
            else:
                run.clear()  # an --overwrite replaces the earlier run only now, when the new one can start
            # saved as asked (`auto` stays auto: a resume on another world size chooses again)
            self.resolved.saved.save(run.recipe)
            if self.eva_components is not None and not self.resume:
                save_file(self.eva_components, str(run.path / adapter_init.EVA_FILE))
            if self.resolved.resume.changes:
                self.summary.resume_changes = self.resolved.resume.history()
            # the id its checkpoints carry (a run from before ids gets one now; its older checkpoints carry none)
            self.summary.run_id = (self.resolved.resume.recorded.get("run_id") if self.resume else None) or \
                uuid.uuid4().hex
            self.summary.owner = process_owner()
            run.update_json(env=environment(self.accelerator), summary=self.summary.at_start(),
                            **self.resolved.resume.publishing())
        self.accelerator.wait_for_everyone()
        self.taken = True

    def prepare_model(self) -> None:
        """Model and optimizer placed for the layout, the schedule, the objective (nothing written yet)."""
        recipe, accelerator = self.recipe, self.accelerator
        if self.pipeline is not None:  # no engine wraps a stage: the schedule runs it
            self.model = self.model.to(accelerator.device)  # (the other stages' parameters are empty)
            self.optimizer = accelerator.prepare(self.optimizer)
        else:
            self.model, self.optimizer = accelerator.prepare(self.model, self.optimizer)
        self.plan_schedule()
        if self.resolved.resume.checkpoint is not None:  # its schedule's record, against this run's schedule
            checkpoints.check_schedule(self.resolved.resume.checkpoint, self.scheduler)
        accelerator.register_save_state_pre_hook(_only_trainable_weights)

        # the loss: next-token (sft), a preference, or rewards of sampled answers (grpo); the reference of dpo, kto
        # and grpo's KL term is this model, adapter off
        self.objective = losses.build(recipe, self.loss_sum_of,
                                          objectives.adapter_off_of(unwrap(accelerator, self.model)),
                                          self.tokenizer.pad_token_id, self.tokenizer)

    def plan_schedule(self) -> None:
        """The run's steps and its learning-rate schedule over them (a streamed run has no length: it runs
        training.max_steps)."""
        cfg = self.cfg
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * math.ceil(len(self.train_loader)
                                                                                    / cfg.grad_accum)))
        self.scheduler = build_scheduler(self.optimizer, self.recipe, self.total_steps)

    def check_fit(self) -> None:
        """training.fit_check: RecipeError before the run directory is written where a step would not fit; with
        training.micro_batch_size auto, the split whose step fit is taken."""
        measured = fit_check.check(self)
        if measured:
            self.summary.fit_check = measured
        choice = self.resolved.batch_choice
        if choice is None:
            return
        if measured and measured.get("micro_batch_size", choice.micro_batch) != choice.micro_batch:
            micro = measured["micro_batch_size"]
            choice = replace(choice, micro_batch=micro, reason=f"the largest split of {choice.batch_size} whose "
                             f"measured step fit (the estimate's, {choice.micro_batch}, did not)")
            self.recipe = recipe = batch_split.split(self.recipe, choice.batch_size, micro)
            self.resolved = replace(self.resolved, recipe=recipe, batch_choice=choice,
                                    saved=batch_split.split(self.resolved.saved, choice.batch_size, micro))
            self.cfg = recipe.training
            self.deal_batches()
            self.plan_schedule()
        self.summary.batch_choice = choice.to_json()
        self.accelerator.print(f"training.micro_batch_size auto: micro-batch {choice.micro_batch} x accumulation "
                               f"{choice.batch_size // choice.micro_batch} ({choice.reason})")

    def prepare(self) -> None:
        """The metrics file, a resumed run's checkpoint loaded, the trackers started."""
        recipe, cfg, accelerator, state = self.recipe, self.cfg, self.accelerator, self.state
        self.metrics = MetricsWriter(self.run_dir.metrics, enabled=self.main)
        checkpoint = self.resolved.resume.checkpoint
        if checkpoint is not None:
            how = checkpoints.load(accelerator, checkpoint, self.model, self.optimizer, self.scheduler, state,
                                   (cfg.micro_batch_size, self.layout.batch_streams(accelerator.num_processes)))
            self.metrics.truncate_after(state.step)
            accelerator.print(f"resumed from {checkpoint.path} at step {state.step} ({how})")
        elif self.main:
            self.metrics.truncate_after(0)
        if accelerator.trackers == [] and recipe.output.trackers:
            start_trackers(accelerator, recipe.name, recipe.output.trackers, self.run_dir.path,
                           _flat(recipe.to_dict()), self.stop)

    def before_training(self) -> None:
        """The summary so far, and what the run is measured against: sample generations and the step-0 evaluation."""
        accelerator, state, s = self.accelerator, self.state, self.summary
        s.world_size, s.total_steps, s.data = accelerator.num_processes, self.total_steps, self.data.stats
        if self.main:  # early, so a watcher (CLI, UI) can show "step i / total" while the run is going
            self.run_dir.update_json(summary=s.at_first_step())
        self.samples = (_sample_generations(self.recipe, self.model, self.tokenizer, accelerator)
                        if state.step == 0 else None)
        eval_first = (evaluate(self.model, self.eval_loader, accelerator, self.objective)
                      if self.eval_loader is not None and state.step == 0 else None)
        if eval_first is not None:
            _write_eval(self.metrics, accelerator, 0, eval_first)
            eval_first = eval_first["eval_loss"]
        elif state.step > 0:  # resumed: the run's own step-0 evaluation stands
            eval_first = next((r["eval_loss"] for r in read_metrics(self.run_dir.metrics)
                               if r.get("step") == 0 and r.get("eval_loss") is not None), None)
        s.eval_loss_first = eval_first

    # -- the loop -----------------------------------------------------------------------------------------------

    def start_loop(self) -> None:
        recipe, cfg, accelerator, state = self.recipe, self.cfg, self.accelerator, self.state
        self.bar = _progress(self.total_steps, state.step, enabled=self.progress_bar is True and self.main)
        self.model.train()
        # what the next row reports
        self.window_sums = torch.zeros(len(self.objective.sum_names), device=accelerator.device)
        self.window_tokens, self.window_start = 0, time.perf_counter()
        if state.window:  # resumed mid-window
            if self.main:
                # (a checkpoint written before objectives kept [loss sum, targets])
                kept = state.window.get("sums") or [state.window["loss"], state.window["targets"]]
                self.window_sums += torch.tensor(kept, device=accelerator.device)
                self.window_tokens += state.window["tokens"]
            self.window_start -= state.window["seconds"]
            state.window = {}
        # a resume that lowers lr (allowed, recorded)
        if self.resume and recipe.training.lr != self.scheduler.base_lrs[0]:
            set_peak_lr(self.scheduler, recipe.training.lr)
        self.last_loss, self.last_report = None, {}
        # what the user waits for before the first step
        self.summary.startup_s = round(time.perf_counter() - self.started, 2)
        self.summary.startup_peak_memory_mb = round(peak_memory_mb(accelerator.device)[0], 1)
        collective_timeout(recipe.distributed.timeout_s)  # started together: from here a stall is a failure
        self.heartbeat.in_loop = True
        self.offload = ((lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)) if cfg.activation_offloading
                        else nullcontext)
        self.watch = NonFiniteWatch(accelerator.device)
        self.reads_every_step = host_reads_every_step(accelerator.device.type, cfg.on_nonfinite)
        self.signal_group = (host_group(recipe.distributed.timeout_s)  # stop signals agreed without waiting for the GPU
                             if accelerator.num_processes > 1 and not self.reads_every_step else None)

    def run(self) -> None:
        """Epochs until the step budget is spent."""
        self.start_loop()
        while self.state.step < self.total_steps:
            self.train_epoch()
        if self.recipe.data.streaming:  # a stream read up to its last step: still the bytes the run recorded
            self.data.train.check_unchanged()
        self.bar.close()
        self.loop_end = time.perf_counter()
        collective_timeout(self.recipe.distributed.startup_timeout_s)  # rank 0 writes the adapter while the others wait
        self.heartbeat.in_loop = False

    def train_epoch(self) -> None:
        """The epoch's steps from where the run is (a resumed run starts mid-epoch); the budget may end it early."""
        state = self.state
        self.batches_of.set_epoch(state.epoch, skip=state.batches_in_epoch)
        for micro_batches in _windows(_on_device(self.train_loader, self.accelerator), self.cfg.grad_accum):
            grad_norm, signum = self.step(micro_batches)
            if state.step % self.recipe.output.log_every == 0 or state.step == self.total_steps:
                self.log_row(grad_norm)
            self.maybe_evaluate()
            self.maybe_checkpoint(signum)
            if state.step >= self.total_steps:
                return
        # the epoch's data ran out before the step budget
        state.epoch += 1
        state.batches_in_epoch = 0

    def accumulate(self, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over one step's micro-batches: the step's loss, and its sums for the next row."""
        accelerator, objective = self.accelerator, self.objective
        step_loss = torch.zeros((), device=accelerator.device)
        step_sums = torch.zeros_like(self.window_sums)
        # what the step's loss is normalised by (its target tokens, or pairs), over every rank. A stand-in counts
        # nothing but runs any forward its objective's counts take: sharded layouts gather weights in lockstep
        totals = sum_of_batches(accelerator, sum((objective.counts(self.model, mb) * (0 if mb.get(STAND_IN) else 1)
                                                  for mb in micro_batches),
                                                 torch.zeros(objectives.COUNTS, device=accelerator.device)))
        if self.pipeline is not None:  # the step's micro-batches through every stage, in the schedule
            with self.offload():
                step_loss, step_sums = self.pipeline.step(micro_batches, totals[objectives.TARGETS])
            for batch in micro_batches:
                self.count(batch)
            return step_loss, step_sums
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # DDP and FSDP average gradients over the data-parallel ranks: scale by their count to undo that mean
            # (a tensor-parallel group computes one batch's gradient together: no mean). A stand-in (no sample
            # left here in an epoch's short last step) runs the passes the other processes wait for, adding nothing
            weight = 0 if batch.get(STAND_IN) else self.readers[0]
            with accumulation_boundary(accelerator, self.model, last), self.offload():
                part = objective.loss(self.model, batch, totals)
                accelerator.backward(part.loss * weight)
            if not weight:
                continue
            step_loss += part.loss.detach()
            step_sums += part.sums
            self.count(batch)
        return step_loss, step_sums

    def count(self, batch: dict) -> None:
        """A micro-batch's tokens and this process's share of its work (counted by the collator on the host: no
        device read per micro-batch)."""
        self.window_tokens += batch["num_tokens"]
        self.state.flops += self.flop_counter.step_flops(batch["num_tokens"], batch["num_attended"],
                                                         extra_forwards=self.recipe.training.extra_forwards) \
            / self.replicas

    def step(self, micro_batches: list) -> tuple:
        """One optimizer step: accumulate, clip, check for non-finite values, update (or skip). Returns the gradient
        norm and the stop signal every rank agreed on (0 for none)."""
        cfg, accelerator, state, run = self.cfg, self.accelerator, self.state, self.run_dir
        step_start = time.perf_counter()
        step_loss, step_sums = self.accumulate(micro_batches)
        grad_norm = clip_gradients(accelerator, self.model, cfg.max_grad_norm or float("inf"))
        self.watch.observe(state.step + 1, step_loss, grad_norm)
        decides = self.reads_every_step or _reports_after(state.step + 1, self.total_steps, self.recipe.output)
        self.stop.poll_file(run.stop_request)  # `workbench stop`: a signal where none can be sent (Ray's threads)
        first_bad, signum = agree(accelerator, self.watch.first if decides else None, self.stop, self.signal_group)
        if signum and not decides:  # stopping here: the checkpoint it writes must be checked first
            first_bad, signum = agree(accelerator, self.watch.first, self.stop)
        if first_bad and cfg.on_nonfinite == "stop":
            raise NonFiniteError(_nonfinite_message(run, first_bad, state.step + 1, step_loss, grad_norm))
        if first_bad:  # on_nonfinite: skip (read every step) — drop this update, keep the schedule
            self.watch.reset()
            state.skipped_steps += 1
            if state.skipped_steps > max(MAX_SKIPPED_STEPS, MAX_SKIPPED_FRACTION * (state.step + 1)):
                raise NonFiniteError(f"training.on_nonfinite: skip dropped {state.skipped_steps} of "
                                     f"{state.step + 1} steps: the run is not training. "
                                     + _nonfinite_message(run, first_bad, state.step + 1, step_loss, grad_norm))
            self.metrics.write({"step": state.step + 1, "skipped": "non-finite loss or gradients"})
        else:
            self.optimizer.step()
            self.window_sums += step_sums
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        state.step += 1
        self.heartbeat.beat(state.step)
        state.batches_in_epoch += len(micro_batches)
        state.train_seconds += time.perf_counter() - step_start
        self.bar.update(1)
        return grad_norm, signum

    def log_row(self, grad_norm) -> None:
        """A metrics row (and the trackers', and the progress bar's) for the steps since the last one."""
        accelerator, state = self.accelerator, self.state
        # The only host sync of the loop: read the loss when a row is written.
        # loss None when every step of the window was skipped (on_nonfinite: skip)
        window_sums = sum_of_batches(accelerator, self.window_sums).cpu()
        tokens_total = int(sum_of_batches(accelerator, torch.tensor(self.window_tokens, device=accelerator.device)))
        state.tokens += tokens_total
        elapsed = time.perf_counter() - self.window_start
        report = self.objective.report_window(window_sums, elapsed * accelerator.num_processes)
        self.last_loss, self.last_report = report["loss"], report
        norm = _rounded(float(grad_norm)) if grad_norm is not None else None
        row = {"step": state.step, "epoch": state.epoch, "loss": _rounded(self.last_loss),
               "lr": self.scheduler.get_last_lr()[0], "grad_norm": norm,
               "tokens": state.tokens, "tokens_per_s": round(tokens_total / max(elapsed, 1e-9), 2),
               PEAK_MEMORY_MB: round(peak_memory_mb(accelerator.device)[0], 1),
               **{k: _rounded(v) for k, v in report.items() if k != "loss"}}
        self.metrics.write(row)
        log_to_trackers(accelerator, {k: v for k, v in row.items() if k != "step" and v is not None}, state.step)
        self.bar.set_postfix(loss=f"{self.last_loss:.4f}" if self.last_loss is not None else "skipped")
        if self.progress_bar == "lines" and self.main:  # a log file's progress (the UI's live log): one line a row
            print(f"step {state.step}/{self.total_steps} | loss {row['loss']} | {row['tokens_per_s']:.0f} tokens/s "
                  f"| peak {row[PEAK_MEMORY_MB]:.0f} MB", flush=True)
        self.window_sums.zero_()
        self.window_tokens, self.window_start = 0, time.perf_counter()

    def maybe_evaluate(self) -> None:
        step, every = self.state.step, self.recipe.output.eval_every
        if self.eval_loader is not None and every and step % every == 0 and step != self.total_steps:
            _write_eval(self.metrics, self.accelerator, step,
                        evaluate(self.model, self.eval_loader, self.accelerator, self.objective))

    def maybe_checkpoint(self, signum: int) -> None:
        """A checkpoint every output.save_every steps, and when a stop signal arrived (then the run stops)."""
        recipe, cfg, accelerator, state = self.recipe, self.cfg, self.accelerator, self.state
        saved = bool(recipe.output.save_every and state.step % recipe.output.save_every == 0)
        if saved or signum:  # preempted or Ctrl-C: every rank stops here, after this step's checkpoint
            state.window = _window_totals(accelerator, self.window_sums, self.window_tokens, self.window_start)
            with patience(recipe.distributed.startup_timeout_s, then=recipe.distributed.timeout_s):
                checkpoints.save(accelerator, self.run_dir, self.layout, self.model, self.optimizer, self.scheduler,
                                 state, (cfg.micro_batch_size, cfg.grad_accum), recipe.output.keep_last,
                                 self.summary.run_id)
        if signum:
            self.bar.close()
            raise Interrupted(f"interrupted by {signal.Signals(signum).name} after step {state.step}; checkpoint "
                              f"{self.run_dir.checkpoint(state.step).name} saved: "
                              + ("run the same command to continue" if self.auto_resume else
                                 "run the same command with --resume to continue"), signum)

    # -- the end: final eval, adapter, summary ------------------------------------------------------------------

    def finish(self) -> None:
        accelerator, state, s = self.accelerator, self.state, self.summary
        eval_final = (evaluate(self.model, self.eval_loader, accelerator, self.objective)
                      if self.eval_loader is not None else None)
        if eval_final is not None:
            _write_eval(self.metrics, accelerator, state.step, eval_final)
            s.eval_final = {f"{k}_final": v for k, v in eval_final.items() if k != "eval_loss"}
            s.eval_loss_final = eval_final["eval_loss"]
        save_adapter(accelerator, self.model, self.tokenizer, self.run_dir, self.recipe, self.initial_adapter)
        if self.samples is not None:
            after = _sample_generations(self.recipe, self.model, self.tokenizer, accelerator)
            # `ended`: whether each answer stopped with an end-of-sequence token within output.sample_max_new_tokens
            s.samples = [{"prompt": p, "before": b.text, "after": a.text, "ended": {"before": b.ended, "after": a.ended}}
                         for (p, b), (_, a) in zip(self.samples, after)]
        self.measure()
        if self.main:
            self.run_dir.update_json(summary=s.at_end())
            log_summary(accelerator, self.run_dir.read_json()["summary"], state.step)  # with what the start recorded
            refresh_model_cards(self.run_dir.path)  # the card saved with the adapter predates these final figures

    def measure(self) -> None:
        """What the run measured, beside what the estimator predicts for it, into the summary."""
        accelerator, state, s, device = self.accelerator, self.state, self.summary, self.accelerator.device
        peaks = accelerator.gather(torch.tensor([peak_memory_mb(device)[0]], device=device))
        held = accelerator.gather(torch.tensor([local_parameter_elements(self.model)], device=device))
        device_peak, peak_source = peak_flops(device.type, compute_dtype_of(self.recipe), torch.get_num_threads())
        world = accelerator.num_processes
        train_s = state.train_seconds
        s.prediction = self.prediction
        s.status, s.steps, s.epochs_started, s.tokens = "completed", state.step, state.epoch + 1, state.tokens
        s.wall_s, s.train_s = round(time.perf_counter() - self.started, 2), round(train_s, 2)
        s.finish_s = round(time.perf_counter() - self.loop_end, 2)
        s.tokens_per_s = round(state.tokens / max(train_s, 1e-9), 2)
        s.tokens_per_s_per_device = round(state.tokens / max(train_s, 1e-9) / world, 2)
        s.peak_memory_mb, s.peak_memory_mb_per_rank = round(float(peaks.max()), 1), [round(float(p), 1) for p in peaks]
        s.peak_memory_kind = peak_memory_mb(device)[1]
        s.mfu, s.peak_flops = round(state.flops / max(train_s, 1e-9) / device_peak, 5), device_peak
        s.peak_flops_source, s.final_loss = peak_source, self.last_loss
        s.distributed_type = str(accelerator.distributed_type).split(".")[-1]
        s.param_elements_per_rank = [int(n) for n in held]
        s.trainable_checksum_per_rank = _checksums(self.model, accelerator)
        s.skipped_steps, s.objective = state.skipped_steps, self.objective.name
        s.preference_final = {f"{k}_final": _rounded(v) for k, v in self.last_report.items()
                              if k in self.objective.final_metrics}
