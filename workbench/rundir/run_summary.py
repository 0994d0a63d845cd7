"""The run's summary, as run.json's "summary" holds it: every key the loop writes is named here, once, and every
reader (the CLI, model cards, compare tables, charts, the UI) reads it back through `RunSummary.read`.

It is written three times, each write merged into what is there: when the run takes its directory over
(`at_start`), when data and model are ready (`at_first_step`, so a watcher can show "step i / total"), and when
the run ends (`at_end`, or `at_failure`). The key order of each write is the order run.json has always had."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

PEAK_MEMORY_MB = "peak_memory_mb"  # a metrics row's and the summary's measured peak, in MiB


@dataclass
class RunSummary:
    status: str = "running"
    error: str | None = None

    # -- at the start: how the run was set up -------------------------------------------------------------------
    strategy: str | None = None
    strategy_reason: str | None = None
    layout: dict | None = None
    precision: dict = field(default_factory=dict)  # model_dtype, mixed_precision, compute_dtype, precision_reason
    attention: dict = field(default_factory=dict)  # attention, attention_packed_rows, attention_reason
    threads: int | None = None
    threads_reason: str | None = None
    warnings: list = field(default_factory=list)
    resume_changes: list | None = None  # every resume that changed the recipe, oldest first
    owner: dict | None = None  # {host, pid, started}: the process writing the run (runs.owner_gone reads it)
    run_id: str | None = None  # the run's own id, which its checkpoints carry (training/checkpoints.py)

    # -- once data and model are ready --------------------------------------------------------------------------
    world_size: int | None = None
    total_steps: int | None = None
    params: int | None = None
    trainable_params: int | None = None
    data: dict = field(default_factory=dict)  # prepare_data's figures (examples, tokens, content hashes, ...)
    base_model: dict | None = None  # the fingerprint of a local model.path folder (model/base_fingerprint.py)
    fit_check: dict | None = None  # what training.fit_check measured (training/fit_check.py)
    batch_choice: dict | None = None  # training.micro_batch_size auto: the split taken and why

    # -- at the end ---------------------------------------------------------------------------------------------
    eval_final: dict = field(default_factory=dict)  # the objective's other held-out figures, as "<name>_final"
    steps: int | None = None
    epochs_started: int | None = None
    tokens: int | None = None
    wall_s: float | None = None
    train_s: float | None = None
    startup_s: float | None = None
    startup_peak_memory_mb: float | None = None  # the floor: model, adapter, optimizer and data before step 1
    finish_s: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_per_device: float | None = None
    peak_memory_mb: float | None = None
    peak_memory_mb_per_rank: list | None = None
    peak_memory_kind: str | None = None
    mfu: float | None = None
    peak_flops: float | None = None
    peak_flops_source: str | None = None
    final_loss: float | None = None
    distributed_type: str | None = None
    param_elements_per_rank: list | None = None
    trainable_checksum_per_rank: list | None = None
    eval_loss_first: float | None = None
    eval_loss_final: float | None = None
    skipped_steps: int | None = None
    objective: str | None = None
    preference_final: dict = field(default_factory=dict)  # the last row's preference figures, as "<name>_final"
    prediction: dict = field(default_factory=dict)  # the estimator's figures for this setup (predicted_*)
    samples: list | None = None  # sample prompts' generations before and after training

    def at_start(self) -> dict:
        start = {"status": self.status, "strategy": self.strategy, "strategy_reason": self.strategy_reason,
                 "layout": self.layout, **self.precision, **self.attention,
                 "threads": self.threads, "threads_reason": self.threads_reason, "warnings": self.warnings}
        if self.owner is not None:
            start["owner"] = self.owner
        if self.run_id is not None:
            start["run_id"] = self.run_id
        if self.resume_changes is not None:
            start["resume_changes"] = self.resume_changes
        return start

    def at_first_step(self) -> dict:
        return {"status": self.status, "world_size": self.world_size, "total_steps": self.total_steps,
                "params": self.params, "trainable_params": self.trainable_params, **self.data,
                "base_model": self.base_model, "fit_check": self.fit_check,
                "batch_choice": self.batch_choice}

    def at_end(self) -> dict:
        summary = {**self.at_first_step(), **self.eval_final}
        summary.update({
            "status": self.status, "steps": self.steps, "epochs_started": self.epochs_started, "tokens": self.tokens,
            "wall_s": self.wall_s, "train_s": self.train_s, "startup_s": self.startup_s,
            "startup_peak_memory_mb": self.startup_peak_memory_mb, "finish_s": self.finish_s,
            "tokens_per_s": self.tokens_per_s, "tokens_per_s_per_device": self.tokens_per_s_per_device,
            PEAK_MEMORY_MB: self.peak_memory_mb, "peak_memory_mb_per_rank": self.peak_memory_mb_per_rank,
            "peak_memory_kind": self.peak_memory_kind, "mfu": self.mfu, "peak_flops": self.peak_flops,
            "peak_flops_source": self.peak_flops_source, "final_loss": self.final_loss,
            "distributed_type": self.distributed_type, "param_elements_per_rank": self.param_elements_per_rank,
            "trainable_checksum_per_rank": self.trainable_checksum_per_rank,
            "eval_loss_first": self.eval_loss_first, "eval_loss_final": self.eval_loss_final,
            "strategy": self.strategy, "layout": self.layout, "skipped_steps": self.skipped_steps,
            "objective": self.objective, **self.preference_final, **self.prediction,
        })
        if self.samples is not None:
            summary["samples"] = self.samples
        return summary

    def at_failure(self) -> dict:
        return {"status": self.status, "error": self.error}

    # -- reading it back ----------------------------------------------------------------------------------------

    @classmethod
    def read(cls, record: dict | None) -> "RunSummary":
        """run.json's summary (or a TrainResult's) as a RunSummary: each named key on its attribute; the grouped
        figures back in their groups (the estimator's `predicted_*`, held-out `eval_*_final`, the preference
        finals); the rest (precision, attention, data figures) in `data`. Missing keys stay None."""
        record = record or {}
        named = {f.name for f in fields(cls)} - GROUPS
        summary = cls(**{key: value for key, value in record.items() if key in named})
        summary.status = record.get("status")  # a record without one says nothing (not "running")
        for key, value in record.items():
            if key in named:
                continue
            if key.startswith("predicted_"):
                summary.prediction[key] = value
            elif key.endswith("_final") and key.startswith("eval_"):
                summary.eval_final[key] = value
            elif key.endswith("_final"):
                summary.preference_final[key] = value
            else:
                summary.data[key] = value
        return summary

    @property
    def predicted_peak_memory_mb(self) -> float | None:
        return self.prediction.get("predicted_peak_memory_mb")


GROUPS = {"precision", "attention", "data", "eval_final", "preference_final", "prediction"}  # flattened on write

# The headline figures of a run, in the order tables show them: (RunSummary attribute, label).
HEADLINE = [("status", "status"), ("steps", "steps"), ("strategy", "strategy"), ("world_size", "world size"),
            ("tokens_per_s", "tokens/s"), ("peak_memory_mb", "peak memory (MB)"),
            ("predicted_peak_memory_mb", "predicted peak (MB)"), ("mfu", "MFU"), ("wall_s", "wall (s)"),
            ("final_loss", "final loss"), ("eval_loss_first", "eval loss before"), ("eval_loss_final", "eval loss after")]
