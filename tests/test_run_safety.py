"""A run directory means what its files say: one writer at a time, nothing replaced before the new run is
checked, resume only continues the same run, adapters written whole. Each test reproduces a loss first."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench import load_run, train
from workbench.base.errors import DataError, RecipeError, WorkbenchError, WriteError
from workbench.model.inference import load_for_inference
from workbench.rundir.runs import RunDir, in_use, write_json_atomic

ROOT = Path(__file__).resolve().parents[1]


def chat_rows(path: Path, count: int, offset: int = 0) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"what is {i} + {offset}?"},
                          {"role": "assistant", "content": str(i + offset)}]} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_resume_and_overwrite_together_are_refused(tiny_recipe):
    with pytest.raises(WorkbenchError, match="contradict"):
        train(tiny_recipe, resume=True, overwrite=True, progress_bar=False)
    assert not tiny_recipe.run_dir.exists()


def test_overwrite_keeps_the_old_run_until_the_new_data_is_checked(tiny_recipe, tmp_path):
    done = train(tiny_recipe.override("training.max_steps=2"), progress_bar=False)
    before = {p: p.read_bytes() for p in done.run_dir.rglob("*") if p.is_file()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n{\"messages\": 3}\n")
    with pytest.raises(DataError):
        train(tiny_recipe.override(f"data.train={bad}"), overwrite=True, progress_bar=False)
    after = {p: p.read_bytes() for p in done.run_dir.rglob("*") if p.is_file()}
    assert after == before  # not one byte of the earlier run changed
    assert load_run(done.run_dir).summary["status"] == "completed"


def test_resume_of_a_completed_run_is_refused_and_changes_nothing(tiny_recipe):
    done = train(tiny_recipe.override("training.max_steps=2", "output.save_every=1"), progress_bar=False)
    adapter = (done.run_dir / "adapter" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(WorkbenchError, match="has completed; nothing to resume"):
        train(tiny_recipe.override("training.max_steps=2", "output.save_every=1"), resume=True, progress_bar=False)
    assert (done.run_dir / "adapter" / "adapter_model.safetensors").read_bytes() == adapter


def test_resume_auto_on_a_completed_run_refuses_another_recipe_as_resume_does(tiny_recipe, tmp_path, capsys):
    from workbench.frontends.cli import main

    recipe = tiny_recipe.override("training.max_steps=2")
    done = train(recipe, progress_bar=False)
    run = RunDir(done.run_dir)
    kept = {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()}
    other = chat_rows(tmp_path / "other.jsonl", 24)
    changed = (f"data.train={other}", "adapter.r=4", "training.max_steps=100")
    with pytest.raises(RecipeError) as err:
        train(recipe.override(*changed), resume="auto", progress_bar=False)
    message = str(err.value)
    assert message.startswith("--resume: the recipe differs from the run's own") and "\n" not in message
    assert "adapter.r: 8 -> 4" in message and "training.max_steps: 2 -> 100" in message
    assert "data.train" in message and "other.jsonl" in message
    # the same refusal from the command line (its exit code), and by the recipe's own training.resume: auto
    code = main(["train", str(run.recipe), "--no-progress", *changed, "--resume", "auto"])
    assert code == RecipeError.exit_code and "adapter.r: 8 -> 4" in capsys.readouterr().err
    with pytest.raises(RecipeError, match="adapter.r: 8 -> 4"):
        train(recipe.override(*changed, "training.resume=auto"), progress_bar=False)
    assert {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()} == kept  # not one byte changed
    # its own recipe (and a change a resume may make) still finds the run done and returns it as it is
    again = train(recipe.override("output.log_every=5"), resume="auto", progress_bar=False)
    assert "the run has completed; nothing to resume" in capsys.readouterr().out
    assert again.summary == done.summary


def test_resume_auto_finds_a_completed_run_done_only_for_the_run_it_is(tiny_recipe, tmp_path, capsys):
    """A completed run is done for its own recipe and data alone: a new lr (which a resume may take) or a data file
    rewritten in place (same path, other content) would have trained another adapter, and is refused naming it."""
    data, template = chat_rows(tmp_path / "train.jsonl", 24), tmp_path / "chatml.jinja"
    from workbench.spec.chat_templates import TEMPLATES

    template.write_text(TEMPLATES["chatml"].source)
    recipe = tiny_recipe.override("training.max_steps=2", f"data.train={data}", f"data.chat_template={template}")
    done = train(recipe, progress_bar=False)
    run = RunDir(done.run_dir)
    kept = {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()}
    with pytest.raises(RecipeError, match=r"^--resume: the recipe differs .*completed: training\.lr: .* -> 1e-05\. "):
        train(recipe.override("training.lr=1e-5"), resume="auto", progress_bar=False)
    # none of these can change what it trained: a requeued job given a memory budget or a fit check is done too
    again = train(recipe.override("training.threads=3", "distributed.device_memory=64GiB", "training.fit_check=true"),
                  resume="auto", progress_bar=False)
    assert again.summary == done.summary
    for path, edit in ((data, lambda text: text.replace("what", "WHAT")),
                       (template, lambda text: text + "{# edited #}")):
        original = path.read_text()
        path.write_text(edit(original))
        with pytest.raises(RecipeError) as err:
            train(recipe, resume="auto", progress_bar=False)
        field = "data.train" if path == data else "data.chat_template"
        assert f"completed: {field}: the file's content changed since the run" in str(err.value)
        assert "\n" not in str(err.value)
        path.write_text(original)
    assert {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()} == kept  # not one byte changed
    assert train(recipe, resume="auto", progress_bar=False).summary == done.summary


def _rewrite_a_weight_in_place(folder: Path) -> None:
    """What saving a merge over the base does: the same file, same size and names, other values."""
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, str(weights), metadata={"format": "pt"})


def test_a_run_on_a_base_model_rewritten_in_place_is_neither_done_nor_resumed(tiny_recipe, tiny_path, tmp_path):
    """The adapter means something only on the weights it was trained against: a model.path folder whose weights
    were rewritten in place (same path, same file names) is refused by `--resume auto` on the completed run and
    by a resume of an unfinished one, naming model.path; a copy of the same files (new mtimes) still passes."""
    import shutil

    folder = tmp_path / "base"
    shutil.copytree(tiny_path, folder)
    recipe = tiny_recipe.override(f"model.path={folder}", "training.max_steps=4", "output.save_every=2")
    done = train(recipe, progress_bar=False)
    run = RunDir(done.run_dir)
    assert run.read_json()["summary"]["base_model"]["content"]
    for item in folder.iterdir():  # the same bytes, copied again: other mtimes
        shutil.copy(item, item.with_name(item.name + ".copy"))
        os.replace(item.with_name(item.name + ".copy"), item)
    assert train(recipe, resume="auto", progress_bar=False).summary == done.summary
    kept = {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()}
    _rewrite_a_weight_in_place(folder)
    with pytest.raises(RecipeError) as err:
        train(recipe, resume="auto", progress_bar=False)
    assert "completed: model.path: the base model's files" in str(err.value) and "\n" not in str(err.value)
    assert {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()} == kept
    # an unfinished run on it: the resume is refused too, before anything is written
    shutil.rmtree(run.checkpoint(4))
    shutil.rmtree(run.adapter)
    run.update_json(summary={"status": "running"})
    kept = {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()}
    with pytest.raises(WorkbenchError, match=r"^--resume: the base model in model\.path \(.*base\) changed since"):
        train(recipe, resume=True, progress_bar=False)
    assert {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()} == kept


def test_a_run_on_a_builtin_model_whose_cached_files_were_rewritten_is_neither_resumed_nor_done(tiny_recipe,
                                                                                               tmp_path, monkeypatch):
    """A builtin model is an ordinary folder under the cache once built, and a file there can be rewritten like any
    other: the run builds it before it fingerprints it, and a resume (or `--resume auto` of the completed run) on
    other bytes is refused naming model.path. Looking at a model not built yet builds nothing."""
    from workbench.model import base_fingerprint

    cache = tmp_path / "cache"
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(cache))
    assert base_fingerprint.fingerprint("builtin:tiny") is None and not (cache / "models").exists()
    recipe = tiny_recipe.override("model.path=builtin:tiny", "training.max_steps=2", "output.save_every=1")
    done = train(recipe, progress_bar=False)
    run = RunDir(done.run_dir)
    assert run.read_json()["summary"]["base_model"]["content"]
    _rewrite_a_weight_in_place(cache / "models" / "tiny-v1")
    with pytest.raises(RecipeError, match=r"completed: model\.path: the base model's files in builtin:tiny"):
        train(recipe, resume="auto", progress_bar=False)
    shutil.rmtree(run.checkpoint(2))  # as a crash after step 1's checkpoint leaves it
    shutil.rmtree(run.adapter)
    run.update_json(summary={"status": "running"})
    kept = {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()}
    with pytest.raises(WorkbenchError, match=r"^--resume: the base model in model\.path \(builtin:tiny\) changed"):
        train(recipe, resume=True, progress_bar=False)
    assert {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()} == kept


def test_the_base_model_fingerprint_holds_every_byte(tmp_path, monkeypatch):
    """A rewrite of 64 KiB anywhere in a large file changes the digest (however the bytes are read); a copy of the
    same bytes, or a second look, does not; builtins and hub ids have none."""
    from workbench.model import base_fingerprint

    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    folder.mkdir()
    big = folder / "model.safetensors"
    big.write_bytes(bytes(range(256)) * (40 * 4096))  # 40 MiB
    (folder / "config.json").write_text("{}")
    recorded = base_fingerprint.fingerprint(str(folder))
    assert not base_fingerprint.changed(recorded, str(folder))
    size = big.stat().st_size
    for where in (0, 2 * 1024 * 1024, size // 2, size - 100):  # the header, early, the middle, the end
        data = bytearray(big.read_bytes())
        data[where:where + 64 * 1024] = bytes(64 * 1024)
        big.write_bytes(bytes(data))
        assert base_fingerprint.changed(recorded, str(folder)), where
        big.write_bytes(bytes(range(256)) * (40 * 4096))
    assert not base_fingerprint.changed(recorded, str(folder))  # rewritten with its own bytes: other mtime, same
    (folder / "extra.json").write_text("{}")
    assert base_fingerprint.changed(recorded, str(folder))
    assert base_fingerprint.fingerprint("builtin:tiny") is None and base_fingerprint.fingerprint("owner/name") is None
    (folder / "extra.json").unlink()
    recorded = base_fingerprint.fingerprint(str(folder))
    # what from_pretrained never reads: a subfolder (however many files), a FIFO (never opened: no hang)
    (folder / "checkpoints").mkdir()
    for i in range(50):
        (folder / "checkpoints" / f"{i}.bin").write_bytes(b"x")
    os.mkfifo(folder / "pipe")
    assert not base_fingerprint.changed(recorded, str(folder))
    # a rewrite that keeps the size and sets the time back: its ctime and inode still moved
    stamp = big.stat()
    os.utime(big, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    replaced = folder / "replacement"
    replaced.write_bytes(bytes(reversed(big.read_bytes())))
    os.utime(replaced, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    os.replace(replaced, big)
    assert big.stat().st_size == stamp.st_size and big.stat().st_mtime_ns == stamp.st_mtime_ns
    assert base_fingerprint.changed(recorded, str(folder))
    # a file swapped for another and swapped back (as during a run's load): its stat moved, whatever it holds
    before = base_fingerprint.stat_digest(str(folder))
    copy = folder / "copy"
    copy.write_bytes(big.read_bytes())
    os.replace(copy, big)
    assert base_fingerprint.stat_digest(str(folder)) != before
    # shards a weights index names in a subfolder are read by the loader: they are fingerprinted too
    (folder / "w").mkdir()
    (folder / "w" / "model-1.safetensors").write_bytes(b"shard")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": "w/model-1.safetensors", "b": '
                                                         '"../outside.safetensors"}}')
    recorded = base_fingerprint.fingerprint(str(folder))
    (folder / "w" / "model-1.safetensors").write_bytes(b"other")
    assert base_fingerprint.changed(recorded, str(folder))


def interrupted_run(tiny_recipe):
    """A run that saved step 2 of 4 and then died (as kill -9 leaves it: status running, no adapter)."""
    recipe = tiny_recipe.override("training.max_steps=4", "output.save_every=2")
    done = train(recipe, progress_bar=False)
    run = RunDir(done.run_dir)
    import shutil

    shutil.rmtree(run.checkpoint(4))
    shutil.rmtree(run.adapter)
    run.update_json(summary={"status": "running"})
    return recipe, run


def test_resume_refuses_a_changed_recipe_naming_every_change(tiny_recipe):
    recipe, run = interrupted_run(tiny_recipe)
    saved = run.recipe.read_text()
    with pytest.raises(RecipeError) as err:
        train(recipe.override("data.max_seq_len=64", "adapter.r=4", "training.max_steps=9"), resume=True,
              progress_bar=False)
    message = str(err.value)
    assert "data.max_seq_len: 128 -> 64" in message and "adapter.r: 8 -> 4" in message
    assert "training.max_steps: 4 -> 9" in message
    assert run.recipe.read_text() == saved and run.read_json()["summary"]["status"] == "running"
    # without the run's own recipe nothing says what may change: refused, and nothing written
    run.recipe.unlink()
    with pytest.raises(RecipeError, match=r"^--resume: the run's own recipe .*recipe.yaml is missing"):
        train(recipe.override("adapter.r=4"), resume=True, progress_bar=False)
    assert not run.recipe.exists() and run.read_json()["summary"]["status"] == "running"


def test_a_refused_change_inside_the_data_mix_names_the_source_and_field_in_one_bounded_line(tiny_recipe, tmp_path):
    from workbench.training.resume import LISTED_CHANGES, check_resume

    # long paths first, so that a message showing the whole list cut to length would hide the weight that changed
    sources = [{"path": f"{tmp_path}/{'nested/' * 10}source-{i}.jsonl", "weight": 1} for i in range(20)]
    recipe = tiny_recipe.override(data__train=sources)
    run = RunDir(recipe.run_dir)
    run.path.mkdir(parents=True)
    recipe.save(run.recipe)
    heavier = [{**source, "weight": 3} if i == 1 else source for i, source in enumerate(sources)]
    with pytest.raises(RecipeError) as err:
        check_resume(recipe.override(data__train=heavier), run)
    message = str(err.value)
    assert "data.train[1].weight: 1.0 -> 3.0" in message and "data.train[0]" not in message
    # every weight changed: the first ones named, the rest counted, on one line of bounded length
    every = [{**source, "weight": 2} for source in sources]
    with pytest.raises(RecipeError) as err:
        check_resume(recipe.override(data__train=every, adapter__r=4), run)
    message = str(err.value)
    assert "adapter.r: 8 -> 4" in message and "data.train[10].weight: 1.0 -> 2.0" in message
    assert f"and {20 + 1 - LISTED_CHANGES} more" in message and "data.train[19]" not in message
    assert "\n" not in message and len(message) < 2000


def test_resume_allows_safe_changes_and_records_them(tiny_recipe):
    recipe, run = interrupted_run(tiny_recipe)
    result = train(recipe.override("output.log_every=2"), resume=True, progress_bar=False)
    assert result.summary["status"] == "completed" and result.summary["steps"] == 4
    (record,) = result.summary["resume_changes"]
    assert record == {"from_step": 2, "changes": {"output.log_every": [1, 2]}}


@pytest.mark.parametrize("rows", [24, 84])  # other rows; more rows (the checkpoint's place then lies elsewhere)
def test_resume_refuses_data_that_changed_since_the_start(tiny_recipe, tmp_path, rows):
    """Named as the data that changed, before any checkpoint is judged by it (a place in an epoch of other data
    must not read as a damaged checkpoint, whose advice is to delete it)."""
    data = chat_rows(tmp_path / "d.jsonl", 24)
    recipe, run = interrupted_run(tiny_recipe.override(f"data.train={data}"))
    chat_rows(data, rows, offset=5)  # same path, other rows
    with pytest.raises(WorkbenchError, match="^--resume: data.train changed since the run started"):
        train(recipe, resume=True, progress_bar=False)
    assert run.read_json()["summary"]["status"] == "running"


def test_resume_refuses_a_chat_template_that_changed_since_the_start(tiny_recipe, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}")
    recipe, run = interrupted_run(tiny_recipe.override(f"data.chat_template={template}"))
    template.write_text("{% for m in messages %}{{ m['role'] }} says {{ m['content'] }}<|im_end|>{% endfor %}")
    with pytest.raises(WorkbenchError, match=r"the chat template \(data.chat_template, or the tokenizer's own\) "
                                             "changed since the run started"):
        train(recipe, resume=True, progress_bar=False)
    assert run.read_json()["summary"]["status"] == "running"


def test_the_data_cache_never_serves_stale_rows(tiny_recipe, tmp_path):
    """datasets keys local files by path and mtime: same path, same mtime, other content must retrain."""
    data = chat_rows(tmp_path / "d.jsonl", 40)
    os.utime(data, (1577836800, 1577836800))
    recipe = tiny_recipe.override(f"data.train={data}", "training.max_steps=1")
    first = train(recipe, progress_bar=False).summary
    chat_rows(data, 120, offset=7)
    os.utime(data, (1577836800, 1577836800))
    second = train(recipe, overwrite=True, progress_bar=False).summary
    assert (first["train_samples"], second["train_samples"]) == (40, 120)
    assert first["train_sha256"] != second["train_sha256"]


def test_an_adapter_is_written_whole_or_not_at_all(tiny_recipe, monkeypatch):
    from peft import PeftModel

    def disk_full(self, path, **kwargs):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "README.md").write_text("partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PeftModel, "save_pretrained", disk_full)
    with pytest.raises(WriteError, match="adapter: cannot write .No space left on device"):
        train(tiny_recipe.override("training.max_steps=1"), progress_bar=False)
    assert not (tiny_recipe.run_dir / "adapter").exists()  # no adapter/ holding only a README
    with pytest.raises(WorkbenchError, match="has no adapter"):
        load_for_inference(tiny_recipe.run_dir)


def test_a_damaged_adapter_is_one_line(tiny_recipe):
    done = train(tiny_recipe.override("training.max_steps=1"), progress_bar=False)
    (done.run_dir / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(WorkbenchError, match="damaged adapter .adapter_model.safetensors missing"):
        load_for_inference(done.run_dir)


def test_nan_is_written_as_null(tmp_path):
    write_json_atomic(tmp_path / "run.json", {"summary": {"final_loss": float("nan"), "x": [float("inf"), 1.0]}})
    assert json.loads((tmp_path / "run.json").read_text()) == {"summary": {"final_loss": None, "x": [None, 1.0]}}


def cli(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "workbench", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs)


@pytest.mark.slow
def test_two_runs_cannot_share_a_folder_and_kill_9_leaves_no_stale_lock(tmp_path):
    run_dir = tmp_path / "race"
    common = ["recipes/tiny.yaml", "--no-progress", f"output.dir={run_dir}", "training.threads=1",
              "output.log_every=1", "training.max_steps=400", "output.save_every=1", "data.eval=null"]
    first = cli("train", *common)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.1)
        assert in_use(run_dir)
        second = subprocess.run([sys.executable, "-m", "workbench", "train", *common, "--overwrite"], cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 1 and "in use by another running process" in second.stderr
        assert first.poll() is None and (run_dir / "metrics.jsonl").exists()  # the first run goes on
        while not RunDir(run_dir).complete_checkpoints() and first.poll() is None:
            time.sleep(0.1)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert not in_use(run_dir)  # the kernel dropped the lock with its holder
    assert load_run(run_dir).summary["status"] == "died"  # `running` with no live owner
    # resuming after kill -9 (the lock gone with its holder) is covered end to end by tests/test_crash.py


def test_overwrite_refuses_a_folder_that_holds_no_run(tiny_recipe):
    tiny_recipe.run_dir.mkdir(parents=True)
    (tiny_recipe.run_dir / "thesis.txt").write_text("years of work")
    with pytest.raises(RecipeError, match="holds no run"):
        train(tiny_recipe, overwrite=True, progress_bar=False)
    assert (tiny_recipe.run_dir / "thesis.txt").read_text() == "years of work"


def test_a_replacement_that_cannot_move_everything_aside_puts_it_all_back(tiny_recipe, monkeypatch):
    done = train(tiny_recipe.override("training.max_steps=1"), progress_bar=False)
    before = sorted(p.relative_to(done.run_dir) for p in done.run_dir.rglob("*"))
    real_rename, calls = os.rename, []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == 3 and ".replaced-" in str(dst):
            raise PermissionError(1, "Operation not permitted", str(src))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    contents = {p: p.read_bytes() for p in done.run_dir.rglob("*") if p.is_file()}
    with pytest.raises(WorkbenchError, match="cannot replace the earlier run .* left as it was"):
        train(tiny_recipe.override("training.max_steps=1"), overwrite=True, progress_bar=False)
    assert sorted(p.relative_to(done.run_dir) for p in done.run_dir.rglob("*")) == before
    assert {p: p.read_bytes() for p in done.run_dir.rglob("*") if p.is_file()} == contents


@pytest.mark.parametrize("out", ["runs/{name.upper}", "runs/{name!r}", "runs/{name:>9}", "runs/{}"])
def test_only_a_plain_name_placeholder(out):
    from workbench import Recipe

    with pytest.raises(RecipeError, match="output.dir"):
        Recipe.from_dict({"output": {"dir": out}})


def test_damaged_run_files_are_one_line_errors_and_do_not_break_the_table(tiny_recipe, tmp_path):
    from workbench import compare, list_runs

    done = train(tiny_recipe.override("training.max_steps=2", "output.save_every=1"), progress_bar=False)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "run.json").write_text(json.dumps({"summary": {"status": "completed"}, "env": 5, "evaluation": [1]}))
    (odd / "recipe.yaml").write_text("adapter: lora\n")
    table = compare([done.run_dir, odd])
    assert table["method"].iloc[0] == "lora" and table["method"].isna().iloc[1]
    (done.run_dir / "run.json").write_text('{"summary": {"status": "runn')
    with pytest.raises(WorkbenchError, match="run.json: unreadable"):
        train(tiny_recipe.override("training.max_steps=2", "output.save_every=1"), resume=True, progress_bar=False)
    with pytest.warns(UserWarning, match="skipped"):
        assert [r.name for r in list_runs(tmp_path)] == ["odd"]


def test_the_cli_summary_prints_missing_figures_as_n_a(capsys):
    from workbench.frontends.cli import _print_summary

    _print_summary(Path("runs/x"), {"status": "completed", "steps": 4, "world_size": 1, "strategy": "single",
                                    "wall_s": 1.0, "tokens": 10, "tokens_per_s": None, "peak_memory_mb": 1.0,
                                    "peak_memory_kind": "cpu_peak_rss", "mfu": None, "final_loss": None,
                                    "eval_loss_first": 1.0, "eval_loss_final": None})
    out = capsys.readouterr().out
    assert "n/a tokens/s" in out and "eval loss 1.0000 -> n/a" in out


@pytest.mark.parametrize("argv, message", [
    (["launch", "recipes/tiny.yaml", "--nproc", "2", "--master", "127.0.0.1:99999"], "port from 1 to 65535"),
    (["launch", "recipes/tiny.yaml", "--nproc", "4096"], "one process per"),
    (["train", "recipes/tiny.yaml", "--resum"], "unrecognized arguments: --resum"),
    (["train", "recipes/tiny.yaml", "--resume", "--overwrite"], "contradict"),
    (["train", "recipes/tiny.yaml", "adapter.r=true"], "adapter.r"),
    (["validate", "recipes/tiny.yaml", "output.dir=runs/{foo}"], "placeholder"),
    (["generate", "builtin:tiny", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["chat", "builtin:tiny", "--temperature", "nan"], "--temperature"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    from workbench.frontends.cli import main

    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own refusals
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 or code == 1, err
    assert message in err and "Traceback" not in err


def test_chat_help_works(capsys):
    from workbench.frontends.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["chat", "--help"])
    assert exit.value.code == 0 and "--temperature" in capsys.readouterr().out


def test_a_resume_may_lower_the_peak_lr_and_the_schedule_follows(tiny_recipe):
    recipe, run = interrupted_run(tiny_recipe)
    before = {r["step"]: r["lr"] for r in map(json.loads, run.metrics.read_text().splitlines()) if "lr" in r}
    result = train(recipe.override("training.lr=0.0015"), resume=True, progress_bar=False)
    after = {r["step"]: r["lr"] for r in map(json.loads, run.metrics.read_text().splitlines()) if "lr" in r}
    assert after[1] == before[1] and after[2] == before[2]  # the steps before the checkpoint stay as they were
    assert after[3] == pytest.approx(before[3] / 2)  # the same schedule, scaled to the new peak
    assert result.summary["resume_changes"][0]["changes"] == {"training.lr": [0.003, 0.0015]}


def test_a_resumed_run_sums_up_like_an_uninterrupted_one(tiny_recipe):
    """Checkpoints in the middle of a metrics window: the resumed run's tokens, losses and eval match."""
    recipe = tiny_recipe.override("training.max_steps=8", "output.save_every=3", "output.keep_last=3",
                                  "output.log_every=4", "output.eval_every=4", "data.eval=recipes/data/tiny_chat_eval.jsonl")
    whole = train(recipe, progress_bar=False).summary
    crashed = recipe.override(f"output.dir={recipe.run_dir.parent}/crashed")
    import shutil

    shutil.copytree(recipe.run_dir, crashed.run_dir)
    run = RunDir(crashed.run_dir)
    for step, path in run.complete_checkpoints():
        if step > 3:
            shutil.rmtree(path)
    shutil.rmtree(run.adapter)
    run.update_json(summary={"status": "running"})
    resumed = train(crashed, resume=True, progress_bar=False).summary
    for key in ("tokens", "steps", "eval_loss_first", "eval_loss_final"):
        assert resumed[key] == whole[key], key
    assert resumed["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-6)


def test_a_rank_above_the_models_width_is_warned_about():
    from workbench import Recipe
    from workbench.model.loading import load_config
    from workbench.training.preflight import preflight

    recipe = Recipe.load("recipes/tiny.yaml", ["adapter.r=100000"])
    (warning,) = preflight(recipe, None, load_config(recipe.model))
    assert "adapter.r=100000 is larger than the model's width (128)" in warning
    assert preflight(Recipe.load("recipes/tiny.yaml"), None, load_config(recipe.model)) == []


def users_own_files(run_dir: Path) -> dict:
    """What a user keeps in a run directory beside the run: notes, and an export of it."""
    (run_dir / "NOTES.txt").write_text("lr 3e-3 diverged on the long rows; try 1e-3")
    (run_dir / "gguf").mkdir()
    (run_dir / "gguf" / "tiny-q8_0.gguf").write_bytes(b"GGUF exported from the earlier run")
    (run_dir / "gguf" / "Modelfile").write_text("FROM ./tiny-q8_0.gguf\n")
    return {p.relative_to(run_dir): p.read_bytes() for p in [run_dir / "NOTES.txt", *(run_dir / "gguf").iterdir()]}


def test_overwrite_replaces_only_the_runs_own_files_and_names_what_it_kept(tiny_recipe):
    recipe = tiny_recipe.override("training.max_steps=2", "output.save_every=1")
    done = train(recipe, progress_bar=False)
    mine = users_own_files(done.run_dir)
    old_adapter = (done.run_dir / "adapter" / "adapter_model.safetensors").read_bytes()
    with pytest.warns(UserWarning, match=r"kept .*: NOTES\.txt, gguf/$"):
        again = train(recipe.override("training.max_steps=1", "output.save_every=null"), overwrite=True,
                      progress_bar=False)
    assert {p: (done.run_dir / p).read_bytes() for p in mine} == mine
    assert again.summary["status"] == "completed" and again.summary["steps"] == 1
    assert (done.run_dir / "adapter" / "adapter_model.safetensors").read_bytes() != old_adapter
    assert sorted(p.name for p in done.run_dir.iterdir()) == ["NOTES.txt", "adapter", "gguf", "metrics.jsonl",
                                                              "recipe.yaml", "run.json"]  # old checkpoints gone


KILL_AT = r"""
import json, os, shutil, sys
from pathlib import Path
from workbench.rundir.runs import RunDir

source, work = Path(sys.argv[1]), Path(sys.argv[2])
states = []
for k in range(1, 100):  # a kill -9 before the k-th step that changes the folder
    run_dir = work / f"kill-{k}"
    shutil.copytree(source, run_dir, symlinks=True)
    pid = os.fork()
    if pid == 0:
        calls = [0]

        def killed_before(function):
            def call(*args, **kwargs):
                calls[0] += 1
                if calls[0] == k:
                    os._exit(9)  # no cleanup of any kind, as kill -9
                return function(*args, **kwargs)
            return call

        for name in ("rename", "replace", "mkdir", "unlink", "rmdir"):
            setattr(os, name, killed_before(getattr(os, name)))
        shutil.rmtree = killed_before(shutil.rmtree)
        shutil.copy2 = killed_before(shutil.copy2)
        run = RunDir(run_dir)
        run.claim(resume=False, overwrite=True)
        run.clear()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    states.append(str(run_dir))
    if os.waitstatus_to_exitcode(status) == 0:
        break
print(json.dumps(states))
"""


@pytest.mark.parametrize("earlier", ["completed", "interrupted"])
def test_a_kill_9_at_any_point_of_an_overwrite_leaves_a_run_that_reads_resumes_and_replaces_cleanly(tiny_recipe,
                                                                                                tmp_path, earlier):
    from workbench.training.preflight import check_output_dir
    from workbench.training.resume import claim
    from workbench.rundir.runs import RUN_ENTRIES, is_leftover

    if earlier == "completed":
        recipe = tiny_recipe.override("training.max_steps=2", "output.save_every=1", "output.keep_last=2")
        run_dir = train(recipe, progress_bar=False).run_dir
    else:  # died after saving step 2 of 4: its checkpoint is what a resume would continue from
        recipe, interrupted = interrupted_run(tiny_recipe)
        run_dir = interrupted.path
    mine = users_own_files(run_dir)
    old = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    work = tmp_path / "kills"
    work.mkdir()
    script = subprocess.run([sys.executable, "-c", KILL_AT, str(run_dir), str(work)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert script.returncode == 0, script.stderr[-3000:]
    states = [Path(p) for p in json.loads(script.stdout.strip().splitlines()[-1])]
    assert len(states) > 5  # the last one finished; each earlier one was killed at a later point
    for state in states:
        assert {p: (state / p).read_bytes() for p in mine} == mine, state  # the user's files, always
        for aside in state.glob(".replaced-*"):  # what a kill left aside is the earlier run's, nothing else
            assert all(p.name in (*RUN_ENTRIES, "run.json") or is_leftover(p.name) for p in aside.iterdir()), aside
        run = load_run(state)  # always a run directory that reads
        latest = RunDir(state).latest_checkpoint()
        if (state / "run.json").read_bytes() == old[Path("run.json")]:  # the earlier run, whole
            for name, data in old.items():  # (its checkpoints all there, or all gone aside)
                if name.parts[0] != "checkpoints" or latest is not None:
                    assert (state / name).read_bytes() == data, (state, name)
        else:  # the new run's record: it died starting, and nothing of the old run can be resumed
            assert run.summary["status"] == "died" and latest is None, state
        resumed = RunDir(state)
        if earlier == "interrupted" and latest is not None:
            claim(resumed, resume=True, overwrite=False)  # the interrupted run as it was: it can continue
        else:
            with pytest.raises(WorkbenchError, match="nothing to resume|no complete checkpoint"):
                claim(resumed, resume=True, overwrite=False)
        resumed.release()
        check_output_dir(recipe.override(f"output.dir={state}"))  # an --overwrite is accepted ...
        again = RunDir(state)
        again.claim(resume=False, overwrite=True)
        with pytest.warns(UserWarning, match="kept"):
            again.clear()  # ... and leaves the user's files and a new run's record, nothing else
        again.release()
        assert sorted(p.name for p in state.iterdir()) == ["NOTES.txt", "gguf", "run.json"], state
    middle = states[len(states) // 2]
    with pytest.warns(UserWarning, match=r"kept .*: NOTES\.txt, gguf/$"):
        result = train(recipe.override(f"output.dir={middle}", "training.max_steps=1"), overwrite=True,
                       progress_bar=False)
    assert result.summary["status"] == "completed" and {p: (middle / p).read_bytes() for p in mine} == mine


def test_overwrite_refuses_a_run_json_another_tool_wrote(tiny_recipe):
    folder = tiny_recipe.run_dir
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "weights.bin").write_bytes(b"another tool's model")
    (folder / "recipe.yaml").write_text("lr: 1e-3\n")
    (folder / "notes.txt").write_text("mine")
    (folder / "run.json").write_text(json.dumps({"experiment": "other tool"}))
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    with pytest.raises(WorkbenchError, match=rf"^{folder / 'run.json'}: not a workbench run record") as err:
        train(tiny_recipe.override("training.max_steps=1"), overwrite=True, progress_bar=False)
    assert "\n" not in str(err.value)
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_overwrite_removes_the_exact_leftovers_it_writes_and_no_look_alike_of_the_users(tiny_recipe, tmp_path):
    folder = tiny_recipe.run_dir
    folder.mkdir(parents=True)
    write_json_atomic(folder / "run.json", {"env": {}, "summary": {"status": "completed"}})
    leftovers = [".tmp-adapter", ".old-adapter", ".tmp-model", ".old-model", ".replaced-123-ab_cd9yz",
                 ".run.json.tmp", "metrics.tmp", ".workbench-write-test-k2j_x81q"]
    users = [".tmp-mynotes", ".old-ideas.txt", ".replaced-by-v2", ".run.json.bak", ".workbench-write-test-notes"]
    for name in leftovers + users:
        (folder / name).write_text(name)
    run = RunDir(folder)
    run.claim(resume=False, overwrite=True)
    try:
        with pytest.warns(UserWarning, match="kept"):
            kept = run.clear()
    finally:
        run.release()
    assert sorted(kept) == sorted(users)
    assert sorted(p.name for p in folder.iterdir()) == sorted([*users, "run.json"])
    assert all((folder / name).read_text() == name for name in users)


def test_micro_batch_auto_resumes_with_the_split_its_run_took(tiny_recipe):
    """training.micro_batch_size auto splits training.batch_size once, when the run starts; the run keeps the split
    as numbers, so a resume on a machine whose memory would choose another continues exactly, and a completed run
    is done for the same auto recipe and refused for another batch_size."""
    import shutil

    from workbench.estimator.memory import estimate

    auto = tiny_recipe.override("training.micro_batch_size=auto", "training.grad_accum=1", "training.batch_size=8",
                                "training.max_steps=4", "output.save_every=2", "output.keep_last=2",
                                "training.fit_check=false")
    whole = train(auto, progress_bar=False)
    choice = whole.summary["batch_choice"]
    assert choice["micro_batch_size"] * choice["grad_accum"] == 8
    # where this run's estimate would split it otherwise: the estimator's row says which split a budget takes
    small = "distributed.device_memory=300MiB"
    assert estimate(auto.override(small)).strategies[0]["micro_batch_split"] != [choice["micro_batch_size"],
                                                                                 choice["grad_accum"]]
    crashed = auto.override(f"output.dir={whole.run_dir.parent}/crashed")
    shutil.copytree(whole.run_dir, crashed.run_dir)
    shutil.rmtree(crashed.run_dir / "checkpoints" / "step-4")
    shutil.rmtree(crashed.run_dir / "adapter")
    RunDir(crashed.run_dir).update_json(summary={"status": "running"})
    resumed = train(crashed.override(small), resume=True, progress_bar=False)
    assert resumed.summary["steps"] == 4
    weights = [(run / "adapter" / "adapter_model.safetensors").read_bytes() for run in (whole.run_dir,
                                                                                        resumed.run_dir)]
    assert weights[0] == weights[1]
    assert whole.metrics["loss"].dropna().tolist() == resumed.metrics["loss"].dropna().tolist()
    # a completed run: done for its own auto recipe; another batch_size trains another adapter
    assert train(auto, resume="auto", progress_bar=False).summary == whole.summary
    with pytest.raises(RecipeError, match=r"completed: training\.batch_size: 8 -> 4"):
        train(auto.override("training.batch_size=4"), resume="auto", progress_bar=False)
