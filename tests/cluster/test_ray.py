"""Ray Train for real: a local Ray with two CPU workers runs the recipe (`workbench ray`); a worker killed mid-run
makes Ray restart the group, which resumes from the last checkpoint and ends with the adapter and the losses of an
uninterrupted two-process torchrun run. Skipped, saying why, where Ray is not installed."""

import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest

from workbench.base.errors import WorkbenchError
from workbench.rundir.runs import RunDir
from workbench.spec.recipe import Recipe, _sections_in, path_fields

from .helpers import COMMON, RECIPE, adapter, assert_same_adapter, finish, free_port, logged_step, losses, start, \
    summary, wait_for

STEPS = 48  # room for a restart and a stop mid-run: the stop request is read about once a second, and a step takes ~0.1 s
RUN = [*COMMON, f"training.max_steps={STEPS}", "output.save_every=2", "distributed.strategy=ddp"]


def ray_workers() -> list[int]:
    """Processes Ray runs as training workers (Ray names them ray::RayTrainWorker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"RayTrainWorker" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_a_ray_run_survives_a_killed_worker_and_a_sigterm_and_ends_as_an_uninterrupted_one(tmp_path):
    """--overwrite replaces a completed run once (a restarted group resumes, not replaces); a killed worker is
    restarted and resumes; a SIGTERM to the driver (a scheduler's `kill PID`, Kubernetes' stop of PID 1) makes the
    workers checkpoint and the driver exit 143; the same command then completes the run."""
    pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (pip install 'lora-workbench[ray]')")
    torchrun = tmp_path / "torchrun"
    code, out = finish(start([sys.executable, "-m", "workbench", "launch", RECIPE, "--nproc", "2", "--master",
                              f"127.0.0.1:{free_port()}", f"output.dir={torchrun}", *RUN]))
    assert code == 0, out[-3000:]

    run_dir = tmp_path / "ray"
    shutil.copytree(torchrun, run_dir)  # a completed run, which only --overwrite trains again
    command = [sys.executable, "-m", "workbench", "ray", RECIPE, "--workers", "2", "--max-failures", "1",
               f"output.dir={run_dir}", *RUN]
    # step 20's checkpoint held for 20 s: however fast the steps run, the stop sent after step 6 lands mid-run
    process = start([*command, "--overwrite"], env={"LORA_WORKBENCH_CHECKPOINT_PAUSE": "20:20"})
    wait_for(lambda: logged_step(run_dir) >= 3 and ray_workers(), process, what="step 3 under Ray")
    os.kill(max(ray_workers()), signal.SIGKILL)  # one worker gone without a word: Ray restarts the group
    wait_for(lambda: logged_step(run_dir) >= 6, process, what="step 6 after the restart")
    os.kill(process.pid, signal.SIGTERM)
    code, out = finish(process, timeout=300)
    assert code == 128 + signal.SIGTERM, out[-4000:]
    assert "resumed from" in out, out[-4000:]  # the restarted group continued the checkpoint
    assert summary(run_dir)["status"] == "interrupted"
    stopped_at = RunDir(run_dir).latest_checkpoint()[0]  # the checkpoint the stop took
    assert 6 <= stopped_at < STEPS

    code, out = finish(start(command), timeout=300)
    assert code == 0, out[-4000:]
    s = summary(run_dir)
    assert s["status"] == "completed" and s["steps"] == STEPS and s["world_size"] == 2
    assert [step for step, _ in losses(run_dir)] == list(range(1, STEPS + 1))  # no step lost or logged twice
    assert [loss for _, loss in losses(run_dir)] == pytest.approx([loss for _, loss in losses(torchrun)], abs=1e-6)
    assert_same_adapter(adapter(run_dir), adapter(torchrun), atol=1e-6)


def test_paths_are_made_absolute_before_workers_start(tmp_path):
    from workbench.frontends.ray import anchored

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    recipe = Recipe.load(RECIPE, ["data.train=data/train.jsonl", "data.eval=null", "output.dir=runs/{name}"])
    fixed = anchored(recipe, tmp_path)
    assert fixed.data.train == str(tmp_path / "data" / "train.jsonl")
    assert fixed.output.dir == str(tmp_path / "runs" / "{name}")
    assert fixed.model.path == recipe.model.path  # builtin:tiny stays a builtin
    hub = anchored(recipe.override("data.train=someone/a-dataset"), tmp_path)
    assert hub.data.train == "someone/a-dataset"  # no such local file: a hub id stays one
    mix = anchored(recipe.override("data.train=[data/train.jsonl, {path: someone/a-dataset, weight: 2}]"), tmp_path)
    assert [(s.path, s.weight) for s in mix.data.train] == [(str(tmp_path / "data" / "train.jsonl"), 1.0),
                                                             ("someone/a-dataset", 2.0)]


# a relative value that exists under the submitting folder, for each path field of the recipe
RELATIVE = {"model.path": "models/base", "data.train": "data/train.jsonl", "data.train[].path": "data/more.jsonl",
            "data.eval": "data/eval.jsonl", "data.chat_template": "templates/chat.jinja",
            "distributed.deepspeed.config_file": "ds/zero.json", "output.dir": "runs/{name}"}


def field_value(recipe: Recipe, name: str):
    value = recipe
    for part in name.split("."):
        value = getattr(value, part.removesuffix("[]"))
        value = value[0] if part.endswith("[]") else value
    return value


@pytest.mark.parametrize("name", sorted(path_fields()))
def test_every_path_field_of_the_recipe_is_anchored(name, tmp_path):
    from workbench.frontends.ray import anchored

    assert name in RELATIVE, f"{name}: a path field with no relative value in this test"
    value = RELATIVE[name]
    (tmp_path / value).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / value).write_text("{}\n")
    override = f"{name.removesuffix('[].path')}=[{{path: {value}}}]" if "[]" in name else f"{name}={value}"
    recipe = Recipe.load(RECIPE, ["data.eval=null", override])
    assert field_value(recipe, name) == value
    assert field_value(anchored(recipe, tmp_path), name) == str(tmp_path / value)


def test_a_registered_chat_template_stays_a_name_beside_a_file_of_that_name(tmp_path):
    from workbench.frontends.ray import anchored

    (tmp_path / "chatml").write_text("not this one")
    recipe = Recipe.load(RECIPE, ["data.chat_template=chatml"])
    assert anchored(recipe, tmp_path).data.chat_template == "chatml"


def test_every_field_that_names_a_file_or_folder_is_marked_as_a_path():
    """A field whose name or description speaks of a file, folder or directory and that takes text must carry
    recipe.path_mark: else `workbench ray` would leave it relative to the workers' folder."""
    def text_fields(model, prefix=""):
        for name, field in model.model_fields.items():
            if "str" in str(field.annotation):
                yield prefix + name, name, field.description or ""
            for nested, listed in _sections_in(field.annotation):
                yield from text_fields(nested, f"{prefix}{name}{'[]' if listed else ''}.")

    speaks = re.compile(r"\b(file|folder|dir|directory|path)\b|_(file|dir|path)$|^path$")
    named = {full for full, name, description in text_fields(Recipe)
             if speaks.search(name) or speaks.search(description)}
    assert {"data.eval", "output.dir", "data.chat_template"} <= named  # the search sees the schema
    assert named - set(path_fields()) == set()


def test_a_missing_data_file_is_one_line_before_ray_starts(tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lora-workbench[ray]')")
    from workbench.frontends.ray import ray_train

    with pytest.raises(WorkbenchError, match=r"^data.train: file .*missing.jsonl not found"):
        ray_train(Recipe.load(RECIPE, ["data.train=recipes/data/missing.jsonl"]))
    assert not ray.is_initialized()


def test_without_ray_one_line_says_what_to_install(monkeypatch):
    import builtins

    from workbench.frontends import ray as entry

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(WorkbenchError, match=r"ray_train needs Ray Train: pip install 'lora-workbench\[ray\]'"):
        entry.ray_train(Recipe.load(RECIPE))
