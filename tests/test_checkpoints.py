"""Resuming through the portable copy in one process: another micro-batch split, an epoch that ended on a short
step, damaged files (one clear error, nothing in the run touched), the samples per step a resume on another process
count keeps, and which errors count as a peer's failure."""

import hashlib
import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from workbench import Recipe, RecipeError, WorkbenchError, train
from workbench.distributed.accelerator import _raised_in_collective, collective_failure
from workbench.rundir.runs import RunDir
from workbench.spec.strategies import Layout
from workbench.training.resume import check_resume

pytestmark = pytest.mark.slow

COMMON = ["model.dtype=float32", "training.mixed_precision=no", "data.eval=null", "output.eval_every=null",
          "output.log_every=1"]


def run(run_dir, *overrides, resume=False):
    recipe = Recipe.load("recipes/tiny.yaml", [*COMMON, *overrides, f"output.dir={run_dir}"])
    return train(recipe, resume=resume, overwrite=not resume, progress_bar=False).summary


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def interrupted_copy(source, target, keep_step: int):
    shutil.copytree(source, target)
    run_dir = RunDir(target)
    for step, path in run_dir.complete_checkpoints():
        if step > keep_step:
            shutil.rmtree(path)
    shutil.rmtree(target / "adapter")
    run_dir.update_json(summary={"status": "running"})
    return target


def test_another_micro_batch_split_resumes_on_the_same_samples(tmp_path):
    """1 x 4 -> 2 x 2 in the same layout: the exact files would skip the wrong batches; the portable copy does not."""
    whole = tmp_path / "whole"
    run(whole, "training.max_steps=6", "output.save_every=3", "training.micro_batch_size=1", "training.grad_accum=4")
    resumed = interrupted_copy(whole, tmp_path / "resumed", 3)
    s = run(resumed, "training.max_steps=6", "output.save_every=3", "training.micro_batch_size=2",
            "training.grad_accum=2", resume=True)
    assert s["steps"] == 6
    assert losses(resumed) == pytest.approx(losses(whole), rel=1e-5)
    assert RunDir(resumed).read_json()["summary"]["resume_changes"][-1]["changes"]["training.grad_accum"] == [4, 2]


def test_a_checkpoint_at_an_epoch_ending_on_a_short_step_resumes_with_another_split(tmp_path):
    whole = tmp_path / "whole"
    run(whole, "training.max_steps=40", "output.save_every=1000", "training.micro_batch_size=1",
        "training.grad_accum=4")
    rows = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    steps_per_epoch = sum(1 for r in rows if r.get("epoch") == 0 and "loss" in r)
    total = steps_per_epoch + 2
    run(whole, f"training.max_steps={total}", f"output.save_every={steps_per_epoch}", "training.micro_batch_size=1",
        "training.grad_accum=4")
    meta = json.loads((RunDir(whole).checkpoint(steps_per_epoch) / "portable.json").read_text())
    assert meta["samples_in_epoch"] % 2, "the epoch must end on a short step for this test"
    resumed = interrupted_copy(whole, tmp_path / "resumed", steps_per_epoch)
    s = run(resumed, f"training.max_steps={total}", f"output.save_every={steps_per_epoch}",
            "training.micro_batch_size=2", "training.grad_accum=2", resume=True)
    assert s["steps"] == total and s["epochs_started"] == 2
    assert losses(resumed) == pytest.approx(losses(whole), rel=1e-5)


def damage(checkpoint, how: str) -> None:
    tensors_path, meta_path = checkpoint / "portable.safetensors", checkpoint / "portable.json"
    if how == "no-json":
        meta_path.unlink()
    elif how == "truncated-json":
        meta_path.write_text(meta_path.read_text()[:40])
    elif how == "truncated-tensors":
        tensors_path.write_bytes(tensors_path.read_bytes()[:200])
    elif how == "missing-moment":
        tensors = load_file(str(tensors_path))
        tensors.pop(next(k for k in tensors if k.startswith("exp_avg_sq/")))
        save_file(tensors, str(tensors_path))
    elif how == "wrong-shape":
        tensors = load_file(str(tensors_path))
        key = next(k for k in tensors if k.startswith("exp_avg/"))
        tensors[key] = tensors[key][:1].contiguous()
        save_file(tensors, str(tensors_path))
    elif how == "no-meta":
        (checkpoint / "workbench_checkpoint.json").unlink()


@pytest.mark.parametrize("how", ["no-json", "truncated-json", "truncated-tensors", "missing-moment", "wrong-shape",
                                 "no-meta"])
def test_a_damaged_checkpoint_is_one_clear_error_and_leaves_the_run_as_it_was(tmp_path, how):
    whole = tmp_path / "whole"
    run(whole, "training.max_steps=4", "output.save_every=2", "training.micro_batch_size=1", "training.grad_accum=4")
    target = interrupted_copy(whole, tmp_path / "damaged", 2)
    damage(RunDir(target).checkpoint(2), how)
    before = {name: (target / name).read_bytes() for name in ("recipe.yaml", "run.json", "metrics.jsonl")}
    with pytest.raises(WorkbenchError, match=r"--resume: checkpoint .*step-2 is damaged.*delete it to resume"):
        run(target, "training.max_steps=4", "output.save_every=2", "training.micro_batch_size=2",
            "training.grad_accum=2", resume=True)
    assert {name: (target / name).read_bytes() for name in before} == before


@pytest.mark.parametrize("missing", ["model.safetensors", "optimizer.bin"])
def test_a_checkpoint_missing_an_engine_file_is_one_line_naming_it(tmp_path, missing):
    """Resumed on the layout that wrote it, a checkpoint loads through accelerate, which named its own fallback
    (pytorch_model.bin) in a traceback when model.safetensors was gone: refused before the run is touched, by
    its manifest, and where it has none (an earlier version's) by the engine's own files."""
    whole = tmp_path / "whole"
    run(whole, "training.max_steps=2", "output.save_every=1")
    for manifest in (True, False):
        target = interrupted_copy(whole, tmp_path / f"damaged-{manifest}", 1)
        if not manifest:
            _edit(RunDir(target).checkpoint(1), "workbench_checkpoint.json", lambda meta: meta.pop("files"))
        (RunDir(target).checkpoint(1) / missing).unlink()
        before = {name: (target / name).read_bytes() for name in ("recipe.yaml", "run.json", "metrics.jsonl")}
        with pytest.raises(WorkbenchError) as refused:
            run(target, "training.max_steps=2", "output.save_every=1", resume=True)
        what = f"workbench_checkpoint.json: files.{missing}: recorded, and missing from the folder" if manifest \
            else f"{missing}: missing"
        assert str(refused.value) == (f"--resume: checkpoint {RunDir(target).checkpoint(1)} is damaged ({what}); "
                                      "delete it to resume from the one before")
        assert {name: (target / name).read_bytes() for name in before} == before


def test_a_refused_pair_leaves_the_run_as_it_was(tmp_path):
    """Another samples-per-step product is refused before anything is written (the recipe stays the run's)."""
    whole = tmp_path / "whole"
    run(whole, "training.max_steps=4", "output.save_every=2", "training.micro_batch_size=1", "training.grad_accum=4")
    target = interrupted_copy(whole, tmp_path / "target", 2)
    before = (target / "recipe.yaml").read_bytes(), (target / "run.json").read_bytes()
    with pytest.raises(WorkbenchError, match="training.grad_accum: 4 -> 1"):
        run(target, "training.max_steps=4", "output.save_every=2", "training.micro_batch_size=2",
            "training.grad_accum=1", resume=True)
    assert ((target / "recipe.yaml").read_bytes(), (target / "run.json").read_bytes()) == before


def written(tmp_path, micro: int, accum: int, world: int, *overrides) -> RunDir:
    """A run directory as a run on `world` processes leaves it after its step-2 checkpoint."""
    run_dir = RunDir(tmp_path / "written")
    run_dir.path.mkdir(parents=True)
    recipe(micro, accum, *overrides).save(run_dir.recipe)
    run_dir.checkpoint(2).mkdir(parents=True)
    (run_dir.checkpoint(2) / "workbench_checkpoint.json").write_text(json.dumps(
        {"step": 2, "world_size": world, "micro_batch_size": micro, "grad_accum": accum,
         "layout": Layout("ddp" if world > 1 else "single").to_json()}))
    return run_dir


def recipe(micro: int, accum: int, *overrides) -> Recipe:
    return Recipe.load("recipes/tiny.yaml", [*COMMON, f"training.micro_batch_size={micro}",
                                             f"training.grad_accum={accum}", *overrides])


def test_another_process_count_keeps_the_samples_per_step_by_adjusting_the_accumulation(tmp_path):
    """Written on 2 processes with 1 x 2, continued on 1 with the same recipe: 4 samples a step, as before."""
    run_dir = written(tmp_path, 1, 2, 2)
    continued, changes, notes = check_resume(recipe(1, 2), run_dir, world_size=1)
    assert continued.training.grad_accum == 4 and changes["training.grad_accum"] == [2, 4]
    assert notes == ["resume: training.grad_accum 2 -> 4 on 1 process(es), to keep the run's 4 samples a step "
                     "(micro-batch 1 x accumulation 2 x 2 process(es))"]
    continued, _, _ = check_resume(recipe(2, 2), written(tmp_path / "back", 2, 2, 1), world_size=2)
    assert continued.training.grad_accum == 1


@pytest.mark.parametrize("micro, accum, world, new_world, new, message", [
    (1, 2, 2, 3, (1, 2), "the run took 4 samples a step (micro-batch 1 x accumulation 2 x 2 process(es)) and this one "
                         "would take 6 (1 x 2 x 3 process(es)); no micro-batch and accumulation keep 4 on 3 process(es)"),
    (4, 1, 2, 4, (4, 1), "the run took 8 samples a step (micro-batch 4 x accumulation 1 x 2 process(es)) and this one "
                         "would take 16 (4 x 1 x 4 process(es)); training.micro_batch_size=2 training.grad_accum=1 "
                         "keeps it"),
    (1, 2, 2, 1, (1, 3), "training.grad_accum: 2 -> 3 (the run took 4 samples a step (micro-batch 1 x accumulation 2 "
                         "x 2 process(es)) and this one would take 3 (1 x 3 x 1 process(es)); "
                         "training.micro_batch_size=1 training.grad_accum=4 keeps it)"),
])
def test_another_samples_per_step_is_refused_naming_both_and_what_keeps_it(tmp_path, micro, accum, world, new_world,
                                                                          new, message):
    with pytest.raises(RecipeError) as refused:
        check_resume(recipe(*new), written(tmp_path, micro, accum, world), world_size=new_world)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_advice_on_another_samples_per_step_names_the_batch_size_a_recipe_gives(tmp_path):
    """A recipe with training.batch_size (micro x accumulation) refuses other numbers beside it: the advice names
    it too, so that following it works."""
    written_dir = written(tmp_path, 4, 1, 2, "training.batch_size=4")
    with pytest.raises(RecipeError) as refused:
        check_resume(recipe(4, 1, "training.batch_size=4"), written_dir, world_size=4)
    advice = "training.micro_batch_size=2 training.grad_accum=1 training.batch_size=2 keeps it"
    assert advice in str(refused.value)
    continued, _, _ = check_resume(recipe(2, 1, "training.batch_size=2"), written_dir, world_size=4)
    assert (continued.training.micro_batch_size, continued.training.batch_size) == (2, 2)


def heartbeat(in_loop=True):
    return SimpleNamespace(rank=0, world=2, in_loop=in_loop, others=lambda step: "rank 1 (pid 7) exited")


def test_only_errors_out_of_a_collective_are_a_peers_failure():
    for message in ("DataLoader timed out after 30 seconds", "tokenizer download: Connection reset by peer",
                    "ProcessGroupGloo does not support reduce_scatter"):
        assert collective_failure(RuntimeError(message), heartbeat(), 5, (600, 60), "step-4") is None
    backend_error = torch.distributed.DistBackendError("Connection closed by peer")
    assert _raised_in_collective(backend_error)
    named = collective_failure(backend_error, heartbeat(), 5, (600, 60), "step-4")
    assert "rank 0 of 2: a collective after step 5 failed or waited longer than distributed.timeout_s=60 s: " \
           "rank 1 (pid 7) exited" in str(named) and "step-4, stays usable" in str(named)
    early = collective_failure(backend_error, heartbeat(in_loop=False), 0, (600, 60), None)
    assert "before the first step" in str(early) and "startup_timeout_s=600 s" in str(early)
    assert "No checkpoint was complete yet" in str(early)


def _planted_pickle(path, marker) -> None:
    import pickle

    class Runs:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    path.write_bytes(pickle.dumps(Runs()))


@pytest.mark.parametrize("written_by", ["this version", "an earlier version"])
def test_a_pickle_in_a_checkpoint_is_never_loaded(tmp_path, written_by):
    """A checkpoint's loop state is JSON: resuming unpickles nothing that could run code (a workspace's checkpoints
    may come from anyone, and the UI resumes them). A pickle planted where Accelerate keeps registered objects is
    refused unread; an earlier version's checkpoint, which held its state in such pickles, continues from its
    portable copy with the pickles unread."""
    whole = tmp_path / "whole"
    run(whole, "training.max_steps=4", "output.save_every=2")
    assert not list(whole.rglob("custom_checkpoint_*.pkl"))
    target = interrupted_copy(whole, tmp_path / "planted", 2)
    checkpoint, marker = RunDir(target).checkpoint(2), tmp_path / "ran"
    _planted_pickle(checkpoint / "custom_checkpoint_0.pkl", marker)
    if written_by == "this version":
        with pytest.raises(WorkbenchError, match=r"holds pickled state \(custom_checkpoint_0.pkl\), which loading "
                                                 r"would execute; the workbench never writes it"):
            run(target, "training.max_steps=4", "output.save_every=2", resume=True)
    else:  # as an earlier version wrote it: the loop's state in pickles only
        # (its record as that version wrote it, without manifest; the run's record of it to match)
        _edit(checkpoint, "workbench_checkpoint.json",
              lambda meta: [meta.pop(key) for key in ("progress", "scheduler", "files", "run_id")])
        s = run(target, "training.max_steps=4", "output.save_every=2", resume=True)
        assert s["steps"] == 4 and losses(target) == pytest.approx(losses(whole), rel=1e-5)
    assert not marker.exists()


def _edit(checkpoint, name: str, change) -> None:
    """A tampered record. Where it is covered by the checkpoint's manifest, the manifest is rewritten to match
    (a tamperer who knows the format): the record's own checks are what is tested."""
    path = checkpoint / name
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    _republish(checkpoint, name)


def _republish(checkpoint, name: str) -> None:
    """The manifest entry of a rewritten file, and run.json's digest of the record, made to match again."""
    path = checkpoint / name
    meta_path = checkpoint / "workbench_checkpoint.json"
    meta = json.loads(meta_path.read_text())
    if name in meta.get("files", {}):
        meta["files"][name] = [path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()]
        meta_path.write_text(json.dumps(meta))
    run = RunDir(checkpoint.parent.parent)
    if run.run_json.exists() and "checkpoints" in run.read_json():  # and the run's record of what it published
        run.update_json(checkpoints={checkpoint.name.removeprefix("step-"):
                                     hashlib.sha256(meta_path.read_bytes()).hexdigest()})


def _both_steps(data, step) -> None:
    data["step"] = data["progress"]["step"] = step


# (file, edit, the field the refusal names, the resume's micro-batch x accumulation: 1 x 4 loads the engine's own
# files, 2 x 2 the portable copy)
TAMPERED = {
    "negative-step": ("workbench_checkpoint.json", lambda m: _both_steps(m, -3), r"json: step: .*got -3", (1, 4)),
    "step-of-another-folder": ("workbench_checkpoint.json", lambda m: _both_steps(m, 1), r"step: 1, in the folder of "
                               r"step 2", (1, 4)),
    "progress-a-string": ("workbench_checkpoint.json", lambda m: m.update(progress="x"), r"progress: .*got 'x'",
                          (1, 4)),
    "window-a-number": ("workbench_checkpoint.json", lambda m: m["progress"].update(window=5), r"progress\.window: ",
                        (1, 4)),
    "window-sums-text": ("workbench_checkpoint.json", lambda m: m["progress"]["window"].update(sums=["a"]),
                         r"progress\.window\.sums\[0\]: ", (1, 4)),
    "count-as-text": ("workbench_checkpoint.json", lambda m: m.update(world_size="1"), r"world_size: .*got '1'",
                      (1, 4)),
    "schedule-missing": ("workbench_checkpoint.json", lambda m: m["scheduler"].pop("last_epoch"),
                         r"scheduler\.last_epoch: Field required", (1, 4)),
    "unknown-key": ("workbench_checkpoint.json", lambda m: m.update(note=1), r"note: Extra inputs", (1, 4)),
    "key-across-lines": ("workbench_checkpoint.json", lambda m: m.update({"a\nb": 1}), r"'a\\nb': Extra inputs",
                         (1, 4)),
    "past-the-epoch": ("workbench_checkpoint.json", lambda m: m["progress"].update(batches_in_epoch=10 ** 9),
                       r"past the end of its epoch \(workbench_checkpoint\.json: progress\.batches_in_epoch: "
                       r"1000000000", (1, 4)),
    "portable-past-the-epoch": ("portable.json", lambda m: m.update(samples_in_epoch=10 ** 9),
                                r"past the end of its epoch \(portable\.json: samples_in_epoch: 1000000000", (2, 2)),
    "epoch-past-the-steps": ("workbench_checkpoint.json", lambda m: m["progress"].update(epoch=10 ** 15),
                             r"progress\.epoch: 1000000000000000, more than its 2 steps", (1, 4)),
    "epoch-its-steps-cannot-finish": ("workbench_checkpoint.json", lambda m: m["progress"].update(epoch=1),
                                      r"progress\.epoch: 1, where its 2 steps end in epoch 0", (1, 4)),
    "tokens-past-the-steps": ("workbench_checkpoint.json", lambda m: m["progress"].update(tokens=10 ** 40),
                              r"progress\.tokens: 10{40}, more than its 2 steps", (1, 4)),
    "flops-past-any-run": ("workbench_checkpoint.json", lambda m: m["progress"].update(flops=1e300),
                           r"progress\.flops: .*less than or equal", (1, 4)),
    "schedule-count-as-text": ("workbench_checkpoint.json", lambda m: m["scheduler"].update(_step_count="x"),
                               r"scheduler\._step_count: .*got 'x'", (1, 4)),
    "schedule-unknown-key": ("workbench_checkpoint.json", lambda m: m["scheduler"].update(lr_lambdas=[1]),
                             r"scheduler\.lr_lambdas: Extra inputs", (1, 4)),
    "schedule-rates-per-group": ("workbench_checkpoint.json", lambda m: m["scheduler"].update(_last_lr=[0.1, 0.2]),
                                 r"scheduler: _last_lr holds 2 rates for 1 groups", (1, 4)),
    "portable-epoch-past-its-steps": ("portable.json", lambda m: m["progress"].update(epoch=2),
                                       r"portable\.json: progress\.epoch: 2, where", (2, 2)),
    "portable-schedule-text": ("portable.json", lambda m: m["scheduler"].update(_is_initial="no"),
                               r"portable\.json: scheduler\._is_initial", (2, 2)),
    "portable-negative-step": ("portable.json", lambda m: m["progress"].update(step=-3), r"progress\.step: .*-3",
                               (2, 2)),
    "portable-adam-step": ("portable.json", lambda m: m.update(adam_step=7), r"adam_step: 7, more than its 2 steps",
                           (2, 2)),
    # plausible counters that are not the ones its steps give: they would continue at another place in the data
    # or of the schedule
    "schedule-a-step-back": ("workbench_checkpoint.json", lambda m: m["scheduler"].update(last_epoch=1),
                             r"scheduler\.last_epoch: 1, in the checkpoint of step 2", (1, 4)),
    "schedule-count": ("workbench_checkpoint.json", lambda m: m["scheduler"].update(_step_count=9),
                       r"scheduler\._step_count: 9, in the checkpoint of step 2", (1, 4)),
    "portable-schedule-a-step-back": ("portable.json", lambda m: m["scheduler"].update(last_epoch=1),
                                      r"portable\.json: scheduler\.last_epoch: 1", (2, 2)),
    "skips-that-never-happened": ("workbench_checkpoint.json", lambda m: m["progress"].update(skipped_steps=1),
                                  r"progress\.skipped_steps: 1, where metrics\.jsonl records 0 skipped step",
                                  (1, 4)),
    "portable-skips-that-never-happened": ("portable.json", lambda m: (m["progress"].update(skipped_steps=1),
                                                                       m.update(adam_step=1)),
                                           r"progress\.skipped_steps: 1, where", (2, 2)),
    "no-accumulation": ("workbench_checkpoint.json", lambda m: m.pop("grad_accum"), r"json: grad_accum: missing",
                        (1, 4)),
    "no-progress": ("workbench_checkpoint.json", lambda m: m.pop("progress"), r"json: progress: missing", (1, 4)),
    "no-schedule": ("workbench_checkpoint.json", lambda m: m.pop("scheduler"), r"json: scheduler: missing", (1, 4)),
    "place-at-the-epoch-start": ("workbench_checkpoint.json", lambda m: m["progress"].update(batches_in_epoch=0),
                                 r"progress\.batches_in_epoch: 0, where its 2 steps of 4 micro-batch\(es\) read 8 ",
                                 (1, 4)),
    "place-a-step-back": ("workbench_checkpoint.json", lambda m: m["progress"].update(batches_in_epoch=4),
                          r"progress\.batches_in_epoch: 4, where", (1, 4)),
    "portable-adam-step-behind": ("portable.json", lambda m: m.update(adam_step=1),
                                  r"adam_step: 1, where its 2 steps less 0 skipped made 2 updates", (2, 2)),
    "portable-place-at-the-epoch-start": ("portable.json", lambda m: m.update(samples_in_epoch=0),
                                          r"portable\.json: samples_in_epoch: 0, where workbench_checkpoint\.json "
                                          r"places it 8 samples", (2, 2)),
    "portable-place-not-the-checkpoint's": ("portable.json", lambda m: m["progress"].update(batches_in_epoch=4),
                                            r"portable\.json: progress\.batches_in_epoch: 4, where "
                                            r"workbench_checkpoint\.json holds 8", (2, 2)),
}


def test_a_tampered_checkpoint_record_is_one_line_naming_its_file_and_field(tmp_path):
    """workbench_checkpoint.json and portable.json are read through their schema before anything loads: a wrong
    type, a negative step or a place past the epoch is refused in one line, and the run is left as it was (before,
    a negative step trained extra steps, a place past the epoch skipped the rest of it unseen, a wrong type was a
    traceback)."""
    whole = tmp_path / "whole"
    steps = ["training.max_steps=4", "output.save_every=2"]
    run(whole, *steps, "training.micro_batch_size=1", "training.grad_accum=4")
    for case, (name, change, field, (micro, accum)) in TAMPERED.items():
        target = interrupted_copy(whole, tmp_path / case, 2)
        _edit(RunDir(target).checkpoint(2), name, change)
        before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
        with pytest.raises(WorkbenchError) as err:
            run(target, *steps, f"training.micro_batch_size={micro}", f"training.grad_accum={accum}", resume=True)
        message = str(err.value)
        assert f"checkpoint {RunDir(target).checkpoint(2)}" in message and "\n" not in message, case
        assert re.search(field, message), (case, message)
        assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before, case


def test_a_lora_plus_group_rate_other_than_the_recipe_gives_is_refused(tmp_path):
    """LoRA+'s B group learns lora_plus_ratio times faster than the rest: a checkpoint whose schedule holds another
    rate for it (the first group's is set from the recipe as the run continues, the others were not) is damaged."""
    whole = tmp_path / "whole"
    lora_plus = ["training.max_steps=4", "output.save_every=2", "adapter.lora_plus_ratio=16"]
    run(whole, *lora_plus)
    for name, micro in (("workbench_checkpoint.json", 4), ("portable.json", 2)):
        target = interrupted_copy(whole, tmp_path / name, 2)
        _edit(RunDir(target).checkpoint(2), name, lambda m: m["scheduler"]["base_lrs"].__setitem__(
            1, m["scheduler"]["base_lrs"][1] * 100))
        with pytest.raises(WorkbenchError, match=rf"{re.escape(name)}: scheduler\.base_lrs\[1\]: .*, where the "
                                                 r"recipe's rates give "):
            run(target, *lora_plus, f"training.micro_batch_size={micro}",
                f"training.grad_accum={8 // micro}", resume=True)
    resumed = interrupted_copy(whole, tmp_path / "genuine", 2)  # and the genuine one continues
    assert run(resumed, *lora_plus, resume=True)["steps"] == 4


def test_a_checkpoint_epoch_past_the_recipe_is_refused(tmp_path):
    """Without max_steps the recipe's epochs bound the epoch a checkpoint is in (another would train on another
    shuffle); the tokens are bounded by what its steps can read."""
    from workbench.training.resume import Limits, _check_counters

    meta = {"micro_batch_size": 2, "grad_accum": 2, "world_size": 1}
    _check_counters(tmp_path, "m.json", meta, {"step": 40, "epoch": 1, "batches_in_epoch": 30, "tokens": 40 * 4 * 128},
                    100, Limits(2, 128))
    with pytest.raises(WorkbenchError, match=r"m\.json: progress\.epoch: 2, where the recipe runs 2 epoch"):
        _check_counters(tmp_path, "m.json", meta, {"step": 60, "epoch": 2}, 100, Limits(2, 128))
    with pytest.raises(WorkbenchError, match=r"m\.json: progress\.tokens: 30721, more than its 60 steps can "
                                             r"read \(512 tokens a step at most\)"):
        _check_counters(tmp_path, "m.json", meta, {"step": 60, "epoch": 1, "tokens": 30721}, 100, Limits(2, 128))


# (step, epoch, batches_in_epoch) of a run of 10 rows at micro-batch 2, accumulation 2, one process: 3 steps an
# epoch (4 + 4 + 2 samples), 5 micro-batches; the last step of an epoch reads what is left of it
PLACES_OF_10_ROWS = [(1, 0, 2), (2, 0, 4), (3, 0, 5), (4, 1, 2), (6, 1, 5), (7, 2, 2)]


@pytest.mark.parametrize("step, epoch, place", PLACES_OF_10_ROWS)
def test_the_epoch_and_its_place_are_the_ones_the_step_gives(tmp_path, step, epoch, place):
    """Each counter is derived from the step (and the layout that wrote it); one edited to another plausible
    value (the epoch before, the epoch's start, a step back) would continue on another shuffle or place."""
    from workbench.training.resume import _check_counters

    meta = {"micro_batch_size": 2, "grad_accum": 2, "world_size": 1}
    _check_counters(tmp_path, "m.json", meta, {"step": step, "epoch": epoch, "batches_in_epoch": place}, 10, None)
    for wrong_epoch in {epoch - 1, epoch + 1} - {-1}:
        with pytest.raises(WorkbenchError, match=rf"m\.json: progress\.epoch: {wrong_epoch}, where its {step} steps "
                                                 rf"end in epoch {epoch} "):
            _check_counters(tmp_path, "m.json", meta, {"step": step, "epoch": wrong_epoch, "batches_in_epoch": place},
                            10, None)
    for wrong_place in {0, place - 1, place + 1, place - 2} - {place, -1}:
        with pytest.raises(WorkbenchError, match=rf"m\.json: progress\.batches_in_epoch: {wrong_place}, where its "
                                                 rf"{step} steps of 2 micro-batch\(es\) read {place} of epoch"):
            _check_counters(tmp_path, "m.json", meta, {"step": step, "epoch": epoch, "batches_in_epoch": wrong_place},
                            10, None)


def test_a_streams_counters_are_held_to_what_its_steps_read(tmp_path):
    """A stream's epoch has no known length: in its first epoch every step read its micro-batches but the last
    (which may have ended it short); after that, at least one step per epoch, and a place its steps reach."""
    import math

    from workbench.training.resume import _check_counters

    meta = {"micro_batch_size": 1, "grad_accum": 4, "world_size": 2}
    for progress in ({"step": 3, "epoch": 0, "batches_in_epoch": 12}, {"step": 3, "epoch": 0, "batches_in_epoch": 9},
                     {"step": 3, "epoch": 1, "batches_in_epoch": 8}, {"step": 3, "epoch": 2, "batches_in_epoch": 1}):
        _check_counters(tmp_path, "m.json", meta, progress, math.inf, None)
    for progress, field in (({"step": 3, "epoch": 0, "batches_in_epoch": 8}, "batches_in_epoch: 8"),
                            ({"step": 3, "epoch": 0, "batches_in_epoch": 0}, "batches_in_epoch: 0"),
                            ({"step": 3, "epoch": 1, "batches_in_epoch": 9}, "batches_in_epoch: 9"),
                            ({"step": 3, "epoch": 3, "batches_in_epoch": 1}, "epoch: 3")):
        with pytest.raises(WorkbenchError, match=rf"progress\.{field}, where"):
            _check_counters(tmp_path, "m.json", meta, progress, math.inf, None)


def test_the_checkpoint_schema_reads_every_field_the_loop_saves():
    from workbench.training.checkpoints import ProgressState
    from workbench.training.parts import Progress

    assert set(ProgressState.model_fields) == set(Progress().state_dict())
    ProgressState.model_validate(Progress().state_dict())  # a new run's state, its window empty


def test_the_scheduler_schema_reads_what_the_loop_saves():
    """Every key the schedule's state_dict holds (less its functions) has its field: an unknown one is refused."""
    import torch

    from workbench.training.checkpoints import SchedulerState, _json_scheduler

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    optimizer.step()
    scheduler.step()
    SchedulerState.model_validate(_json_scheduler(scheduler))


def test_a_checkpoint_is_its_runs_and_holds_the_files_it_wrote(tmp_path):
    """A checkpoint copied in from another run, a file swapped in from another step, cut short or gone (the ranks'
    random states, whose loss the engine only logs), a schedule rate other than its schedule gives, and a run
    without its run.json: each refused in one line naming it, before anything is written (each trained on
    silently before: another run's weights, another step's moments, a resume no longer exact, the first step at
    a rate metrics.jsonl did not log, data and base unchecked)."""
    steps = ["training.max_steps=4", "output.save_every=2", "output.keep_last=3"]
    whole, other = tmp_path / "whole", tmp_path / "other"
    run(whole, *steps)
    run(other, *steps, "training.seed=7")
    step_2, step_4 = RunDir(whole).checkpoint(2), RunDir(whole).checkpoint(4)
    assert {"optimizer.bin", "random_states_0.pkl"} <= {p.name for p in step_2.iterdir()}  # the engine's own

    def refused(case: str, tamper, pattern: str, *overrides: str) -> None:
        target = interrupted_copy(whole, tmp_path / case, 2)
        tamper(RunDir(target).checkpoint(2), RunDir(target))
        before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
        with pytest.raises((WorkbenchError, RecipeError)) as err:
            run(target, *steps, *overrides, resume=True)
        assert re.search(pattern, str(err.value)) and "\n" not in str(err.value), (case, str(err.value))
        assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before, case

    def foreign(checkpoint, _):
        shutil.rmtree(checkpoint)
        shutil.copytree(RunDir(other).checkpoint(2), checkpoint)

    refused("foreign", foreign, r"was written by another run \(run id [0-9a-f]{12}, where this run's run\.json "
                                r"records [0-9a-f]{12}\)")

    def foreign_unmarked(checkpoint, run_dir):  # its id and manifest taken out, as an earlier version's would be
        foreign(checkpoint, run_dir)
        meta_path = checkpoint / "workbench_checkpoint.json"
        meta = json.loads(meta_path.read_text())
        del meta["run_id"], meta["files"]
        meta_path.write_text(json.dumps(meta))

    refused("foreign-unmarked", foreign_unmarked, r"is not one this run published \(run\.json names another record "
                                                  r"at step 2")

    def published_as(checkpoints):
        def tamper(checkpoint, run_dir):  # the foreign checkpoint, and run.json's names of its checkpoints rewritten
            foreign_unmarked(checkpoint, run_dir)
            record = run_dir.read_json()
            if checkpoints is None:
                del record["checkpoints"]
            else:
                record["checkpoints"] = checkpoints
            run_dir.run_json.write_text(json.dumps(record))
        return tamper

    # a run that recorded its id publishes every checkpoint: none named, or only a later one, is an edited run.json
    refused("unpublished", published_as(None), r"run\.json names none of its checkpoints \(checkpoints: missing")
    refused("unpublished-empty", published_as([]), r"run\.json names none of its checkpoints")
    refused("published-later", published_as({"1000000": "0" * 64}), r"run\.json names no checkpoint at step 2")
    refused("published-superscript", published_as({"\u00b2": "0" * 64}), r"run\.json is damaged \(checkpoints: "
                                                                        r"expected step numbers")
    refused("published-huge", published_as({"9" * 5000: "0" * 64}), r"run\.json is damaged")
    refused("nul-name", lambda c, _: _edit(c, "workbench_checkpoint.json",
                                           lambda m: m["files"].update({"a\u0000b": [1, "0" * 64]})),
            r"files\.'a\\x00b': names a file outside the checkpoint")
    refused("unlisted", lambda c, _: (c / "extra.bin").write_bytes(b"x"),
            r"files: the folder holds extra\.bin, which the record does not list")
    refused("swapped", lambda c, _: shutil.copy(step_4 / "optimizer.bin", c / "optimizer.bin"),
            r"files\.optimizer\.bin: the file holds other bytes than were written")
    refused("cut-short", lambda c, _: os.truncate(c / "model.safetensors", 100),
            r"files\.model\.safetensors: the file holds other bytes than were written \(100 bytes")
    refused("random-states-gone", lambda c, _: (c / "random_states_0.pkl").unlink(),
            r"files\.random_states_0\.pkl: recorded, and missing from the folder")
    # on the portable path (another split), whose first step takes its rates from the schedule's record
    refused("rate", lambda c, _: _edit(c, "portable.json", lambda m: m["scheduler"].update(_last_lr=[0.3])),
            r"portable\.json: scheduler\._last_lr: \[0\.3\], where its schedule gives \[.*\] at step 2",
            "training.micro_batch_size=2", "training.grad_accum=4")
    refused("no-run-json", lambda c, r: r.run_json.unlink(), r"run\.json is missing; it records the data")

    def stripped(_, run_dir):  # run.json without the hashes the resume is checked against
        record = run_dir.read_json()
        del record["summary"]["train_sha256"]
        run_dir.run_json.write_text(json.dumps(record))

    refused("stripped", stripped, r"run\.json records no train_sha256, which it wrote before its first checkpoint")

    def stripped_all(checkpoint, run_dir):  # and its names of the checkpoints and the base fingerprint too
        stripped(checkpoint, run_dir)
        record = run_dir.read_json()
        del record["checkpoints"], record["summary"]["base_model"]
        run_dir.run_json.write_text(json.dumps(record))

    refused("stripped-all", stripped_all, r"run\.json records no train_sha256")
    secret = tmp_path / "secret.txt"
    secret.write_text("not the checkpoint's")

    def outside(checkpoint, _):  # a record naming a file outside its folder, by name and by link
        (checkpoint / "linked.bin").symlink_to(secret)
        _edit(checkpoint, "workbench_checkpoint.json", lambda m: m["files"].update(
            {"../../../secret.txt": [1, "0" * 64], "linked.bin": [1, "0" * 64]}))

    refused("outside", outside, r"files\.(\.\./\.\./\.\./secret\.txt|linked\.bin): names a file outside the "
                                r"checkpoint")
    # a skipped step counted where metrics.jsonl, which records each, is gone
    refused("no-metrics", lambda c, r: (r.metrics.unlink(), _edit(c, "workbench_checkpoint.json",
                                                                   lambda m: m["progress"].update(skipped_steps=1))),
            r"progress\.skipped_steps: 1, where metrics\.jsonl, which records each skipped step, is missing")


def test_the_exact_path_trains_with_the_recipes_optimizer_settings_whatever_optimizer_bin_holds(tmp_path):
    """optimizer.bin carries its groups' settings, the rate included, which nothing compared with the recipe: the
    first resumed step trained at a rate of 0.3 while metrics.jsonl logged the schedule's. The recipe's settings
    and the schedule's rate are what a resumed run trains with."""
    import torch

    steps = ["training.max_steps=4", "output.save_every=2", "output.keep_last=3"]
    whole = tmp_path / "whole"
    run(whole, *steps)
    target = interrupted_copy(whole, tmp_path / "tampered", 2)
    checkpoint = RunDir(target).checkpoint(2)
    state = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    state["param_groups"][0].update(lr=0.3, weight_decay=5.0, betas=(0.5, 0.5))
    torch.save(state, checkpoint / "optimizer.bin")
    _republish(checkpoint, "optimizer.bin")  # (a tamperer who knows the format)
    run(target, *steps, resume=True)
    assert losses(target) == pytest.approx(losses(whole), rel=1e-6)
