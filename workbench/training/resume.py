"""Resuming a run: every question a resumed run answers against the run it continues, in one place.

Whether there is a run to continue at all is answered first: `claim` takes the run directory and refuses a resume of
a run that completed or never saved a checkpoint; `auto_resume` says what `--resume auto` does (a completed run is
done only for its own recipe and data, `check_done`: anything that would have trained another adapter is refused).

`ResumePlan.start` reads the run once and answers them as the run gets to each (a new run's plan passes them all):

- the recipe (`check_resume`): settings that change what is trained, on which data, or the schedule it follows
  (lr, steps, batch, adapter shape, precision) are refused with one error listing them. Settings that only change
  how the run is watched or how fast it goes, and a new peak lr (the way out of a divergence: warmup and decay
  continue, scaled), are allowed and recorded with the checkpoint step they start from. `auto` in the new recipe
  keeps what the run resolved it to;
- the samples of a step (one rule, `_keep_samples_per_step` and `_continues_mid_epoch`): micro-batch x
  accumulation x processes stays what it was. On another process count the accumulation is adjusted to keep it
  (a line says so), the micro-batch and accumulation may change while their product with the process count stays
  the same, and any other product is refused, naming it before and after and the settings that keep it; a
  checkpoint taken mid-epoch continues only where a micro-batch over all processes divides its place in the epoch;
- the pair layout (`share_prompts`) and the data (`check_data`): the rows and their order stay what the
  checkpoints counted;
- the checkpoint (`choose_checkpoint`): the engine's own files on the layout, process count and micro-batch that
  wrote it, the portable copy on another, refusals naming both; no pickle is ever loaded.

`checkpoints.py` writes and reads the bytes; it decides nothing about whether a run may continue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.base.errors import RecipeError, WorkbenchError, escaped
from workbench.base.metrics import read_metrics
from workbench.data.streaming import content_hashes
from workbench.hardware.precision import AUTO
from workbench.model import base_fingerprint
from workbench.model.attention import model_drops_out, shares_prompts
from workbench.rundir.runs import RunDir
from workbench.spec import batch_split
from workbench.spec.recipe import Recipe
from workbench.spec.strategies import Layout, layout_of
from workbench.training import checkpoints

# Dotted keys (or section prefixes ending in ".") a resume may change.
SAFE_TO_CHANGE = (
    "output.log_every", "output.eval_every", "output.save_every", "output.keep_last", "output.trackers",
    "output.sample_prompts", "output.sample_max_new_tokens", "training.threads", "training.on_nonfinite",
    "training.fast_paths", "training.gradient_checkpointing", "training.activation_offloading",
    "training.compile", "model.attn",  # kernels and compilation: the same computation, faster
    "training.fit_check",  # a check before the run: it trains nothing
    "training.resume",  # how a restarted job continues, not what it trains
    "training.lr",  # the way out of a divergence: the schedule continues, scaled to the new peak
    "name", "output.dir",  # where the run is: found already, by this very recipe
    "distributed.",  # the strategy of the processes that continue it (checked when the state loads)
)
PRECISION_KEYS = ("model.dtype", "training.mixed_precision", "quantization.compute_dtype")


@dataclass
class CheckpointChoice:
    """Which copy of which checkpoint continues the run: "exact" (the engine's own files) or "portable" (the
    portable copy, re-sharded for this layout); its files checked before anything is written."""

    path: Path
    how: str
    meta: dict
    portable: dict | None = None  # portable.json, for the portable path


@dataclass(frozen=True)
class Limits:
    """What the recipe lets a checkpoint's counters reach: the epochs it runs (None: max_steps decides) and the
    longest row a batch holds (data.row_len), which bounds the tokens of a step."""

    epochs: int | None
    row_len: int


def _tokens_a_row(recipe: Recipe) -> int:
    """The most tokens one training row adds to the run's count: its length, or, for an objective that samples
    answers to it (grpo), its answers', each the prompt and a completion."""
    if recipe.training.objective_spec.samples_answers:
        grpo = recipe.training.grpo
        return grpo.num_generations * (recipe.data.row_len + grpo.max_completion_length)
    return recipe.data.row_len


@dataclass
class ResumePlan:
    """The answers for one run; `resuming` False: a new run, which every check lets through."""

    run: RunDir
    resuming: bool = False
    changes: dict[str, list] = field(default_factory=dict)  # allowed recipe changes, {key: [saved, new]}
    notes: list[str] = field(default_factory=list)  # what was adjusted to keep the run the same, a line each
    recorded: dict = field(default_factory=dict)  # the summary the run recorded so far
    checkpoint: CheckpointChoice | None = None
    limits: "Limits | None" = None  # what the recipe lets a checkpoint's counters reach
    published: dict | None = None  # run.json's {step: digest of the checkpoint's record} (checkpoints.save)

    @classmethod
    def start(cls, recipe: Recipe, run: RunDir, resume: bool, world_size: int) -> tuple[Recipe, "ResumePlan"]:
        """The recipe to continue with (the saved run's `auto` settings, an adjusted accumulation) and the plan.
        Reads files only; RecipeError listing every refused recipe change."""
        if not resume:
            return recipe, cls(run)
        if not run.run_json.exists() and run.latest_checkpoint() is not None:
            # what the run recorded (its data's and template's hashes, its base model) checks what it resumes on
            raise RecipeError(f"--resume: {escaped(run.run_json)} is missing; it records the data, chat template "
                              "and base model the checkpoints were trained on, without which a resume cannot "
                              "be checked; restore it, or start the run again (--overwrite)")
        record = run.read_json()
        plan = cls(run, resuming=True, recorded=record.get("summary", {}), published=record.get("checkpoints"))
        if run.recipe.exists():  # the run's own recipe says what may change (and what `auto` meant)
            recipe, plan.changes, plan.notes = check_resume(recipe, run, world_size)
        elif run.latest_checkpoint() is not None:  # every run saves it before its first checkpoint
            raise RecipeError(f"--resume: the run's own recipe {escaped(run.recipe)} is missing (it says what the "
                              f"checkpoints "
                              "hold and what a resume may change); restore it, or start the run again (--overwrite)")
        plan.limits = Limits(None if recipe.training.max_steps else math.ceil(recipe.training.epochs),
                             _tokens_a_row(recipe))
        return recipe, plan

    def share_prompts(self, recipe: Recipe, attention, model_config) -> bool:
        """Whether this run's preference pairs hold their prompt once (attention.shares_prompts). A resumed run
        keeps the layout it started with, so its rows and their order stay what its checkpoints counted."""
        here = shares_prompts(attention, recipe, model_config)
        if "train_sha256" not in self.recorded:  # a new run, or one that never got as far as its data
            return here
        before = bool(self.recorded.get("shared_prompts"))
        if before and not here:
            raise WorkbenchError(
                "--resume: this run started with each preference pair holding its prompt once, which needs a CPU's "
                "per-sample attention (training.fast_paths: true) and no dropout; here: attention "
                f"{attention.implementation} ({attention.packed_rows}), adapter.dropout {recipe.adapter.dropout}, "
                f"the model's own dropout {'on' if model_drops_out(model_config) else 'off'}; resume it where all "
                "three hold, or start a new run")
        return before

    @property
    def records_checkpoints(self) -> bool:
        """Whether the run is one this version wrote: it records its id as it starts, and its hashes and base
        fingerprint, and publishes each checkpoint in run.json (a run from before ids records none of these)."""
        return isinstance(self.recorded.get("run_id"), str) or bool(self.published)

    def publishing(self) -> dict:
        """run.json's addition as this run takes the directory over: the checkpoint it continues from, published
        where an earlier version wrote it unpublished (from here on every checkpoint of the run is named)."""
        if self.checkpoint is None:
            return {}
        step = str(self.checkpoint.meta["step"])
        if step in (self.published or {}):
            return {}
        return {"checkpoints": {step: checkpoints.manifest_digest(self.checkpoint.path / checkpoints.META)}}

    def check_data(self, stats: dict) -> None:
        """A resumed run trains on the bytes it started on: a data file changed since then is refused."""
        if self.records_checkpoints:  # this version's run records each hash before its first checkpoint
            missing = [key for key in ("train_sha256", "eval_sha256", "chat_template_sha256")
                       if stats.get(key) and not self.recorded.get(key)]
            if missing:
                raise WorkbenchError(f"--resume: the run's run.json records no {missing[0]}, which it wrote before "
                                     "its first checkpoint (it was edited); restore it, or start the run again "
                                     "(--overwrite)")
        for key in ("train_sha256", "eval_sha256"):
            if self.recorded.get(key) and stats.get(key) and self.recorded[key] != stats[key]:
                part = key.split("_")[0]
                raise WorkbenchError(f"--resume: data.{part} changed since the run started (its content hash "
                                     "differs); resume with the data it started on, or start a new run")
        before, now = self.recorded.get("chat_template_sha256"), stats.get("chat_template_sha256")
        if before and now and before != now:
            raise WorkbenchError("--resume: the chat template (data.chat_template, or the tokenizer's own) changed "
                                 "since the run started; resume with the template it started with, or start a new run")

    def check_base_model(self, path: str) -> None:
        """A resumed run trains against the base weights it started on: a model.path folder whose files hold
        other bytes since then is refused."""
        if self.records_checkpoints and "base_model" not in self.recorded:  # written as the run starts
            raise WorkbenchError("--resume: the run's run.json records no base_model fingerprint, which it wrote "
                                 "as it started (it was edited); restore it, or start the run again (--overwrite)")
        if base_fingerprint.changed(self.recorded.get("base_model"), path):
            raise WorkbenchError(f"--resume: the base model in model.path ({escaped(path)}) changed since the run "
                                 "started (its files hold other bytes), and the adapter was trained against the one "
                                 "it held; resume with the model it started on, or start a new run")

    def choose_checkpoint(self, layout: Layout, world_size: int, micro_batch: int, samples_per_epoch: float,
                          model, lr_groups: list[tuple[float, float | None]]) -> None:
        """The run's latest complete checkpoint, checked to continue as this run; none for a new run."""
        latest = self.run.latest_checkpoint() if self.resuming else None
        if latest is not None:
            run_id = self.recorded.get("run_id")
            self.checkpoint = choose(latest[1], layout, world_size, micro_batch, samples_per_epoch, model, lr_groups,
                                     self.limits, run_id=run_id if isinstance(run_id, str) else None,
                                     published=self.published, required=self.records_checkpoints)
            self._check_skipped_steps()

    def _check_skipped_steps(self) -> None:
        """The skipped updates a checkpoint counts are the steps metrics.jsonl records as skipped up to it (each
        skip writes its row before the step's checkpoint): another count would misplace AdamW's bias correction
        and the run's limit on skips."""
        choice = self.checkpoint
        progress = (choice.portable or {}).get("progress") or choice.meta.get("progress")
        if progress is None:
            return
        step, counted = progress["step"], progress.get("skipped_steps", 0)
        if not self.run.metrics.exists():
            if counted:  # nothing left to check the count against
                raise checkpoints.damage(choice.path, checkpoints.PORTABLE_META if choice.portable else
                                         checkpoints.META, "progress.skipped_steps", f"{counted}, where "
                                         "metrics.jsonl, which records each skipped step, is missing")
            return
        seen = sum(1 for row in read_metrics(self.run.metrics)
                   if row.get("skipped") and isinstance(row.get("step"), int) and row["step"] <= step)
        if seen != counted:
            raise checkpoints.damage(choice.path, checkpoints.PORTABLE_META if choice.portable else checkpoints.META,
                                     "progress.skipped_steps", f"{counted}, where metrics.jsonl records {seen} "
                                     f"skipped step(s) up to step {step}")

    def history(self) -> list[dict]:
        """The run's recipe changes so far, this resume's appended (from the step it continues at)."""
        earlier = self.recorded.get("resume_changes", [])
        if not self.changes:
            return earlier
        step = self.checkpoint.meta["step"] if self.checkpoint else 0
        return [*earlier, {"from_step": step, "changes": self.changes}]


def check_resume(recipe: Recipe, run: RunDir, world_size: int = 1) -> tuple[Recipe, dict[str, list], list[str]]:
    """The recipe to continue with, the allowed changes ({key: [saved, new]}) and what was adjusted to keep the
    run the same (one line each, to print); RecipeError listing every refused change otherwise.
    `world_size`: the processes that continue the run."""
    try:
        saved = Recipe.load(run.recipe)
    except (RecipeError, OSError) as err:
        raise RecipeError(f"--resume: cannot read the run's own recipe {escaped(run.recipe)}: {err}") from None
    recipe = split_as_saved(saved, recipe)
    # a step's samples count in batch streams: one a process, one a tensor-parallel group (`auto` chooses among
    # data-parallel layouts on a resume: workbench/training/resolved.py)
    streams = world_size if recipe.distributed.strategy == "auto" else \
        layout_of(recipe, world_size).batch_streams(world_size)
    recipe, notes, batch_problem = _keep_samples_per_step(saved, recipe, run, streams)
    old, new = _flat(saved.to_dict()), _flat(recipe.to_dict())
    for key in PRECISION_KEYS:  # `auto` means: what this run resolved it to
        if new.get(key) == AUTO and key in old:
            new[key] = old[key]
    changed = {key: [old.get(key), new.get(key)] for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}
    refused = {k: v for k, v in changed.items() if not _safe(k) and (k not in BATCH_KEYS or batch_problem)}
    if refused:
        listed = _listed([line for key, (a, b) in refused.items() for line in _described(key, a, b)])
        raise RecipeError(f"--resume: the recipe differs from the run's own ({escaped(run.recipe)}) in what it trains: "
                          f"{listed}{f' ({batch_problem})' if batch_problem else ''}. Resume with the run's recipe, or "
                          "start a new run (another name or --overwrite). A resume may change only "
                          f"{', '.join(SAFE_TO_CHANGE)}, and the micro-batch and accumulation where their product with "
                          "the processes stays the same")
    if batch_problem:  # only the process count changed
        raise RecipeError(f"--resume: {batch_problem}")
    overrides = {key.replace(".", "__"): new[key] for key in PRECISION_KEYS if key in new}
    return recipe.override(**overrides), changed, notes


BATCH_KEYS = ("training.micro_batch_size", "training.grad_accum", "training.batch_size")


def split_as_saved(saved: Recipe, new: Recipe) -> Recipe:
    """training.micro_batch_size auto means: the split of training.batch_size the run took (its own recipe holds
    it as numbers), so that a resume continues it exactly. Another batch_size keeps the run's micro-batch where it
    divides it, and the change is then judged as any change of the step's samples."""
    if saved.training.micro_batch_auto:  # a run saves the split it took, as numbers
        raise RecipeError("--resume: the run's own recipe says training.micro_batch_size: auto, where the run saved "
                          "the split it took as numbers (it was edited); restore its micro_batch_size and "
                          "grad_accum, or start the run again (--overwrite)")
    if not new.training.micro_batch_auto:
        return new
    micro = saved.training.micro_batch_size
    batch_size = new.training.batch_size
    return batch_split.split(new, batch_size, micro if batch_size % micro == 0 else
                             batch_split.largest_within(batch_size, micro))


def _keep_samples_per_step(saved: Recipe, new: Recipe, run: RunDir,
                           world_size: int) -> tuple[Recipe, list[str], str | None]:
    """micro-batch x accumulation x processes is the samples of one step, which a resumed run keeps (else its
    schedule, its loss scale and its place in the epoch mean something else). On another process count with the
    micro-batch and accumulation the run had, the accumulation is adjusted where that keeps the product (the
    recipe to continue with, and a line saying so); any other change of the product is refused (the third item:
    why, naming the product before and after and the settings that keep it)."""
    before = _written_by(saved, run)
    micro, accum = new.training.micro_batch_size, new.training.grad_accum
    after = micro * accum * world_size
    if before is None or _product(before) == after:
        return new, [], None
    samples = _product(before)
    per_process, rest = divmod(samples, world_size)
    was = f"{samples} samples a step (micro-batch {before[0]} x accumulation {before[1]} x {before[2]} process(es))"
    now = f"{after} ({micro} x {accum} x {world_size} process(es))"
    untouched = (micro, accum) == (saved.training.micro_batch_size, saved.training.grad_accum)
    if untouched and not rest and per_process % micro == 0:
        note = (f"resume: training.grad_accum {accum} -> {per_process // micro} on {world_size} process(es), to keep "
                f"the run's {was}")
        kept = {"training__batch_size": per_process} if new.training.batch_size is not None else {}
        return new.override(training__grad_accum=per_process // micro, **kept), [note], None
    if rest:
        keep = (f"no micro-batch and accumulation keep {samples} on {world_size} process(es): resume on a process "
                f"count that divides {samples} (as {before[2]} does)")
    else:
        fits = max(m for m in range(1, min(micro, per_process) + 1) if per_process % m == 0)
        keep = f"training.micro_batch_size={fits} training.grad_accum={per_process // fits}"
        # (a recipe that gives training.batch_size names the product too, which must agree)
        keep += f" training.batch_size={per_process} keeps it" if new.training.batch_size is not None else " keeps it"
    return new, [], f"the run took {was} and this one would take {now}; {keep}"


def _written_by(saved: Recipe, run: RunDir) -> tuple[int, int, int] | None:
    """(micro-batch, accumulation, processes) of the run so far: the checkpoint that continues says what wrote it
    (run.json for checkpoints that do not); None where nothing says."""
    latest = run.latest_checkpoint()
    try:
        meta = checkpoints.read_meta(latest[1]) if latest else {}
        return int(meta["micro_batch_size"]), int(meta["grad_accum"]), _streams(meta)
    except (WorkbenchError, ValueError, KeyError, TypeError):
        saved_world = run.read_json().get("summary", {}).get("world_size")
        if not isinstance(saved_world, int):
            return None
        return saved.training.micro_batch_size, saved.training.grad_accum, saved_world


def _streams(meta: dict) -> int:
    """The batch streams of the run that wrote a checkpoint: its processes, but one a tensor-parallel group."""
    layout = meta.get("layout")
    world = int(meta["world_size"])
    return Layout.from_json(layout).batch_streams(world) if isinstance(layout, dict) else world


def _continues_mid_epoch(samples_in_epoch: int, samples_per_epoch: float, micro_batch: int, world_size: int) -> bool:
    """The other half of the rule: a checkpoint taken `samples_in_epoch` samples into its epoch continues exactly
    where one micro-batch over all processes divides that (or the epoch is over)."""
    return samples_in_epoch % (micro_batch * world_size) == 0 or samples_in_epoch >= samples_per_epoch


# -- the checkpoint ------------------------------------------------------------------------------


def choose(path: Path, layout: Layout, world_size: int, micro_batch: int, samples_per_epoch: float,
           model, lr_groups: list[tuple[float, float | None]], limits: Limits | None = None,
           run_id: str | None = None, published: dict | None = None, required: bool = False) -> CheckpointChoice:
    """Check that the checkpoint at `path` can continue as this run (layout, process count, micro-batch, the
    optimizer's parameter groups, `lr_groups`: (peak rate, scale) each) and that the files it needs are whole; WorkbenchError naming both
    sides otherwise. Reads files only."""
    meta = checkpoints.read_meta(path)
    if meta.get("run_id") and meta["run_id"] != run_id:  # a checkpoint copied in from another run
        raise WorkbenchError(f"--resume: checkpoint {escaped(path)} was written by another run (run id "
                             f"{meta['run_id'][:12]}, where this run's run.json records "
                             f"{(run_id or 'none')[:12]}); only the run's own checkpoints continue it")
    checkpoints.check_published(path, meta["step"], published, required)  # (one of a copy of the run, or edited)
    pickles = checkpoints.pickled_files(path)
    if pickles and ("progress" in meta or not meta.get("portable")):
        raise WorkbenchError(
            f"--resume: checkpoint {escaped(path)} holds pickled state ({', '.join(pickles)}), which loading would "
            f"execute; "
            + ("the workbench never writes it: the file was put there" if "progress" in meta else
               "it was written by an earlier version and has no portable copy: resume it with that version, or "
               "start the run again (--overwrite)"))
    checkpoints.check_files(path, meta)
    if "layout" not in meta:  # written before checkpoints recorded their layout (and without a portable copy)
        raise WorkbenchError(f"--resume: checkpoint {escaped(path)} was written by an earlier version that recorded no "
                             "layout; start the run again (--overwrite)")
    saved_groups = len(meta.get("scheduler", {}).get("base_lrs", []))
    if saved_groups and saved_groups != len(lr_groups):  # its schedule would leave some groups at a rate of their own
        raise WorkbenchError(f"--resume: checkpoint {escaped(path)} holds {saved_groups} learning-rate groups and "
                             f"this run "
                             f"{len(lr_groups)} (LoRA+ gives an embedding layer's factors and B's biases groups of their "
                             "own, as peft does, since it was written); resume it with the version that wrote it, "
                             "or start the run again (--overwrite)")
    written = Layout.from_json(meta["layout"])
    where = f"{written.name} on {meta['world_size']} process(es) with micro-batch {meta['micro_batch_size']}"
    here = f"{layout.name} on {world_size} process(es) with micro-batch {micro_batch}"
    same = (written, meta["world_size"], meta["micro_batch_size"]) == (layout, world_size, micro_batch)
    _check_place(path, meta, samples_per_epoch)
    _check_counters(path, checkpoints.META, meta, meta.get("progress"), samples_per_epoch, limits)
    if saved_groups:
        _check_group_rates(path, checkpoints.META, meta["scheduler"]["base_lrs"], lr_groups)
    if "progress" not in meta and not pickles and not meta.get("portable"):  # its loop state is nowhere
        raise checkpoints.damage(path, checkpoints.META, "progress", "missing, and the checkpoint has no portable "
                                 "copy that holds it")
    if same and layout.keeps_engine_state and not pickles and "progress" in meta:
        missing = checkpoints.missing_engine_file(path, layout)
        if missing:  # accelerate would name its own fallback file, in a traceback
            raise checkpoints.damage(path, missing, None, "missing")
        return CheckpointChoice(path, "exact", meta)
    # another layout, or an earlier version's checkpoint whose pickles stay unread: the portable copy (weights,
    # moments, schedule, place in the epoch; safetensors and JSON only) continues it
    problem = portable_problem(meta, layout)
    if problem:
        raise WorkbenchError(f"--resume: checkpoint {path.name} was written by {where} and this run is {here}: "
                             f"{problem}")
    portable = checkpoints.read_portable(path, model)
    _check_place(path, meta, samples_per_epoch, portable)
    _check_same_place(path, meta, portable)
    if len(portable["scheduler"]["base_lrs"]) == len(lr_groups):  # (another count: refused above, from the meta)
        _check_group_rates(path, checkpoints.PORTABLE_META, portable["scheduler"]["base_lrs"], lr_groups)
    _check_counters(path, checkpoints.PORTABLE_META, meta, portable["progress"], samples_per_epoch, limits)
    streams = layout.batch_streams(world_size)
    if not _continues_mid_epoch(int(portable["samples_in_epoch"]), samples_per_epoch, micro_batch, streams):
        raise WorkbenchError(
            f"--resume: checkpoint {path.name} ({where}) stopped {portable['samples_in_epoch']} samples into its "
            f"epoch, which {here} cannot continue from exactly ({micro_batch * streams} samples a micro-batch "
            "over all processes); resume on the process count that wrote it, or with a micro-batch that divides "
            "that count")
    return CheckpointChoice(path, "portable", meta, portable)


def _check_place(path: Path, meta: dict, samples_per_epoch: float, portable: dict | None = None) -> None:
    """The checkpoint's place in its epoch lies within the epoch this run's data gives (a stream's has no known
    end): a place past it would skip the rest of the epoch unseen. Counted in the micro-batches of the processes
    that wrote it (and, in portable.json, in samples)."""
    if math.isinf(samples_per_epoch):
        return
    per_round = meta["micro_batch_size"] * _streams(meta)
    rounds = math.ceil(samples_per_epoch / per_round)
    placed = meta.get("progress", {}).get("batches_in_epoch")
    places = [(checkpoints.META, "progress.batches_in_epoch", placed, rounds)]
    if portable is not None:
        places.append((checkpoints.PORTABLE_META, "samples_in_epoch", portable["samples_in_epoch"],
                       rounds * per_round))
    for name, key, value, end in places:
        if value is not None and value > end:
            raise WorkbenchError(
                f"--resume: checkpoint {escaped(path)} lies past the end of its epoch ({name}: {key}: {value}, where "
                f"this run's {samples_per_epoch:.0f} training rows make {rounds} micro-batches of "
                f"{meta['micro_batch_size']} x {meta['world_size']} process(es)); it is damaged, or the data changed "
                "since it was written: delete it to resume from the one before, or resume with the data it was "
                "written on")


def _check_group_rates(path: Path, name: str, base_lrs: list[float], groups: list[tuple[float, float | None]]) -> None:
    """Each group's peak rate keeps its scale to the first scaled group's (LoRA+'s B group: lora_plus_ratio times
    the rest; a resume's new peak scales them all alike), and a group of no scale its own peak: another rate would
    train a group at a speed the recipe does not give it."""
    reference = next(((peak, scale) for peak, (_, scale) in zip(base_lrs, groups) if scale), None)
    for i, (peak, (rate, scale)) in enumerate(zip(base_lrs, groups)):
        want = rate if scale is None or reference is None else reference[0] * scale / reference[1]
        if not math.isclose(peak, want, rel_tol=1e-6):
            raise checkpoints.damage(path, name, f"scheduler.base_lrs[{i}]", f"{peak:g}, where the recipe's rates "
                                     f"give {want:g}")


def _check_same_place(path: Path, meta: dict, portable: dict) -> None:
    """portable.json was written with workbench_checkpoint.json from the same loop state: the place it continues
    from is the one the checkpoint names, in samples."""
    if "progress" not in meta:  # (an earlier version's checkpoint: the portable copy alone says)
        return
    if portable["progress"] != meta["progress"]:
        differ = sorted(k for k in set(meta["progress"]) | set(portable["progress"])
                        if meta["progress"].get(k) != portable["progress"].get(k))
        raise checkpoints.damage(path, checkpoints.PORTABLE_META, f"progress.{differ[0]}",
                                 f"{_show(portable['progress'].get(differ[0]))}, where {checkpoints.META} holds "
                                 f"{_show(meta['progress'].get(differ[0]))} (both are written from the same state)")
    samples = meta["progress"].get("batches_in_epoch", 0) * meta["micro_batch_size"] * _streams(meta)
    if portable["samples_in_epoch"] != samples:
        raise checkpoints.damage(path, checkpoints.PORTABLE_META, "samples_in_epoch",
                                 f"{portable['samples_in_epoch']}, where {checkpoints.META} places it {samples} "
                                 "samples into its epoch")


def _check_counters(path: Path, name: str, meta: dict, progress: dict | None, samples_per_epoch: float,
                    limits: Limits | None) -> None:
    """The loop's counters within what the recipe and the step count allow (checkpoints._check_progress ties them
    to the step alone): an epoch past the recipe's, or another than its steps end in, would train on another
    shuffle, and a token count past what the steps could read would be reported as the run's."""
    if progress is None or not meta.get("grad_accum"):  # (written before it was recorded)
        return
    epoch = progress.get("epoch", 0)
    if limits is not None and limits.epochs is not None and epoch >= limits.epochs:
        raise checkpoints.damage(path, name, "progress.epoch", f"{epoch}, where the recipe runs {limits.epochs} "
                                  "epoch(s), counted from 0")
    samples = meta["micro_batch_size"] * meta["grad_accum"] * _streams(meta)
    per_step = samples * limits.row_len if limits is not None else math.inf  # each sample at most data.row_len tokens
    if progress.get("tokens", 0) > progress["step"] * per_step:
        raise checkpoints.damage(path, name, "progress.tokens", f"{progress['tokens']}, more than its "
                                  f"{progress['step']} steps can read ({per_step} tokens a step at most)")
    _check_place_in_epoch(path, name, meta, progress, samples_per_epoch)


def _check_place_in_epoch(path: Path, name: str, meta: dict, progress: dict, samples_per_epoch: float) -> None:
    """The epoch and the micro-batches read of it follow from the step alone: every epoch takes ceil(rows /
    samples a step) steps, each of `grad_accum` micro-batches of the processes that wrote the checkpoint (a resume
    keeps the samples of a step, so this holds across layouts), and an epoch's last step reads what is left of it.
    Counters that are plausible but not these would continue on another shuffle, or at another place in it.
    A stream's epochs have no known length: its counters are held to what its steps can have read."""
    step, epoch, placed = progress["step"], progress.get("epoch", 0), progress.get("batches_in_epoch", 0)
    accum, per_round = meta["grad_accum"], meta["micro_batch_size"] * _streams(meta)
    steps_an_epoch = math.ceil(samples_per_epoch / (per_round * accum)) if not math.isinf(samples_per_epoch) else 0
    if step == 0:
        expected_epoch, expected_place = 0, range(0, 1)
    elif math.isinf(samples_per_epoch):
        expected_epoch = epoch if epoch < step else None
        start = (step - 1) * accum + 1 if epoch == 0 else 1  # the first epoch of a stream has ended or not
        expected_place = range(start, (step - epoch) * accum + 1)
    else:
        expected_epoch = (step - 1) // steps_an_epoch
        rounds = math.ceil(samples_per_epoch / per_round)
        into = min((step - expected_epoch * steps_an_epoch) * accum, rounds)
        expected_place = range(into, into + 1)
    if expected_epoch != epoch:
        ends_in = (f"end in epoch {expected_epoch} ({steps_an_epoch} steps an epoch, counted from 0)"
                   if expected_epoch is not None else "finish fewer epochs")
        raise checkpoints.damage(path, name, "progress.epoch", f"{epoch}, where its {step} steps {ends_in}")
    if placed not in expected_place:
        want = (str(expected_place.start) if len(expected_place) == 1 else
                f"{expected_place.start} to {expected_place.stop - 1}")
        raise checkpoints.damage(path, name, "progress.batches_in_epoch", f"{placed}, where its {step} steps of "
                                  f"{accum} micro-batch(es) read {want} of epoch {epoch}")


def portable_problem(meta: dict, layout: Layout) -> str | None:
    """Why a checkpoint written on one layout cannot continue on `layout` (None: it can)."""
    if not meta.get("portable"):
        return ("it holds only its engine's own files (a full fine-tuning checkpoint, or one written by a "
                "bitsandbytes optimizer); resume it on the layout, process count and micro-batch that wrote it")
    if not layout.loads_portable_state:
        return ("a DeepSpeed engine loads only its own ZeRO partitions; resume on single, ddp or fsdp, or on the "
                "layout, process count and micro-batch that wrote it")
    return None


# -- small helpers -------------------------------------------------------------------------------


def _product(batch: tuple[int, int, int]) -> int:
    return batch[0] * batch[1] * batch[2]


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE)


def _flat(data: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _show(value) -> str:
    """A value in one line, 60 characters at most: both ends kept, where a path keeps its file's name."""
    text = repr(value)
    return text if len(text) <= 60 else text[:28] + "..." + text[-29:]


LISTED_CHANGES = 12  # changes a refusal names one by one (the rest counted): its line stays readable


def _described(key: str, old, new) -> list[str]:
    """`key: old -> new`, walked into mappings and lists down to the values that differ, so that a change inside a
    list of sources is named precisely (data.train[1].weight: 1.0 -> 3.0) instead of as two long lists."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for k in sorted(set(old) | set(new), key=str) if old.get(k) != new.get(k)
                for line in _described(f"{key}.{k}", old.get(k), new.get(k))]
    if isinstance(old, list) and isinstance(new, list):
        both = [(old[i] if i < len(old) else None, new[i] if i < len(new) else None)
                for i in range(max(len(old), len(new)))]
        return [line for i, (a, b) in enumerate(both) if a != b for line in _described(f"{key}[{i}]", a, b)]
    return [f"{key}: {_show(old)} -> {_show(new)}"]


def _listed(lines: list[str]) -> str:
    more = len(lines) - LISTED_CHANGES
    return "; ".join(lines[:LISTED_CHANGES]) + (f"; and {more} more" if more > 0 else "")


# -- whether there is a run to continue ------------------------------------------------------------------------

AUTO_RESUME = "auto"


def check_flags(resume: bool | str, overwrite: bool) -> None:
    """RecipeError for a --resume that names anything but `auto`; WorkbenchError for --resume with --overwrite."""
    if resume not in (True, False, AUTO_RESUME):
        raise RecipeError(f"--resume: expects nothing or `auto`, got {resume!r}")
    if resume and overwrite:
        raise WorkbenchError("--resume and --overwrite contradict each other: continue the run, or replace it")


def claim(run: RunDir, resume: bool, overwrite: bool) -> None:
    """Take the run directory for this process (RunDir.claim: the lock, and a run there is taken only to continue
    or replace it) and, resuming, refuse a run that has nothing to continue: none there, one that completed, or
    one that stopped before its first checkpoint. Deletes nothing but checkpoint writes a crash cut short."""
    check_flags(resume, overwrite)
    if resume and not run.holds_files():
        raise WorkbenchError(f"{escaped(run.path)}: nothing to resume (no such run directory)")
    run.claim(resume=resume, overwrite=overwrite)
    if not resume:
        return
    if run.completed():
        raise WorkbenchError(f"{escaped(run.path)}: the run has completed; nothing to resume (--overwrite to train "
                             f"it again)")
    if run.latest_checkpoint() is None:
        raise WorkbenchError(f"{escaped(run.path)}: no complete checkpoint to resume from (the run stopped before "
                             "its first save); --overwrite starts it again")
    run.drop_cut_short_checkpoints()


def auto_resume(recipe: Recipe, run: RunDir, world_size: int) -> str:
    """What `--resume auto` does with this run directory, the same answer on every rank (nothing is written
    before they all decide): "resume" (a complete checkpoint of an unfinished run), "done" (the run completed:
    a requeued or restarted job has nothing left to do), "replace" (an earlier start died before its first
    checkpoint: its files are replaced, as by --overwrite) or "new" (nothing there yet).

    A completed run is "done" only for the run it is (`check_done`), or its adapter would pass for what another
    recipe, or other data, trains."""
    if run.completed():
        check_done(recipe, run)
        return "done"
    if run.latest_checkpoint() is not None:
        return "resume"
    return "replace" if run.run_json.exists() else "new"


# What a completed run may be asked for again with: settings that cannot change what it trained (how many CPU
# threads, how often a row is logged) and where the run is and how a restarted job finds it. Everything else,
# the lr and the rest of SAFE_TO_CHANGE included, would have trained another adapter.
SAME_RUN = ("training.threads", "output.log_every", "training.resume", "name", "output.dir", "training.fit_check",
            "distributed.device_memory")


def check_done(recipe: Recipe, run: RunDir) -> None:
    """RecipeError unless `recipe` asks for the completed run as it is: its own recipe (but for SAME_RUN) on the
    data and chat template whose content hashes the run recorded (the files hashed as they are, not tokenized)."""
    try:
        saved = Recipe.load(run.recipe)
    except (RecipeError, OSError) as err:
        raise RecipeError(f"--resume auto: cannot read the completed run's own recipe {escaped(run.recipe)}: "
                          f"{err}") from None
    recipe = split_as_saved(saved, recipe)
    old, new = _flat(saved.to_dict()), _flat(recipe.to_dict())
    for key in PRECISION_KEYS:  # `auto` means: what this run resolved it to
        if new.get(key) == AUTO and key in old:
            new[key] = old[key]
    differs = [line for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key) and key not in SAME_RUN
               for line in _described(key, old.get(key), new.get(key))]
    what = "recipe" if differs else "data"
    if not differs:  # the same recipe: its files still hold what trained the run (read only when it matters)
        recorded, hashes = run.read_json().get("summary", {}), content_hashes(recipe.data)
        names = {"train_sha256": "data.train", "eval_sha256": "data.eval", "chat_template_sha256": "data.chat_template"}
        differs = [f"{names[key]}: the file's content changed since the run (content hash {recorded[key][:12]} -> "
                   f"{hashes[key][:12]})" for key in names
                   if recorded.get(key) and hashes.get(key) and recorded[key] != hashes[key]]
        if not differs and base_fingerprint.changed(recorded.get("base_model"), recipe.model.path):
            what = "base model"
            differs.append(f"model.path: the base model's files in {escaped(recipe.model.path)} hold other bytes "
                           "than the run was trained against")
    if differs:
        raise RecipeError(f"--resume: the {what} differs from the run's own ({escaped(run.recipe)}), which has "
                          f"completed: "
                          f"{_listed(differs)}. A completed run is done only for the recipe and data that trained it: "
                          f"start a new run (another name or --overwrite); only {', '.join(SAME_RUN)} may differ")


def agree_on_resume(accelerator, resume: bool, run_path) -> None:
    """Every rank of a `--resume auto` run decided alone from the files it sees: they must agree (a run directory
    not on storage every machine shares would have one rank resume and another start afresh)."""
    if accelerator.num_processes == 1:
        return
    import torch

    votes = accelerator.gather(torch.tensor([int(resume)], device=accelerator.device))
    if int(votes.min()) != int(votes.max()):
        raise WorkbenchError(f"--resume auto: ranks disagree whether {escaped(run_path)} holds a checkpoint (ranks "
                             f"{[i for i, v in enumerate(votes.tolist()) if v]} see one): output.dir must be on "
                             "storage that every machine shares")
