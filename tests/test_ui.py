"""The UI's handlers, without a browser: form ↔ YAML, validation text, path safety, jobs, compare, chat."""

from __future__ import annotations

import csv
import html
import inspect
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import yaml
from matplotlib.figure import Figure

pytest.importorskip("gradio")

from ui import form  # noqa: E402
from workbench.base import charts
from ui.handlers import COLUMNS, TABLE_HEADERS, Handlers, display_table  # noqa: E402
from ui.jobs import JobRegistry  # noqa: E402
from ui.workspace import PathError, Workspace  # noqa: E402
from workbench import Recipe, RecipeError  # noqa: E402
from workbench.rundir.runs import COMPARE_COLUMNS
from workbench.spec.formats import FORMAT_NAMES

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


@pytest.fixture
def root(tmp_path):
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    return tmp_path


@pytest.fixture
def h(root):
    return Handlers(root)


def widgets_for(recipe: Recipe) -> list:
    return form.widgets_from_dict(recipe.to_dict())


def set_field(values: list, key: str, value) -> list:
    values = list(values)
    values[[s.key for s in form.FIELDS].index(key)] = value
    return values


def value_of(values: list, key: str):
    return values[[s.key for s in form.FIELDS].index(key)]


# -- the form, from the schema ------------------------------------------------------------------------


def test_every_recipe_field_has_a_widget_with_its_default_and_help():
    leaves = set()

    def walk(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                leaves.add(f"{prefix}{k}")

    # qlora and a RoPE scaling: the optional sections are filled in
    walk(Recipe(adapter={"method": "qlora"}, model={"rope_scaling": {"type": "yarn", "factor": 2}}).to_dict())
    specs = {s.key: s for s in form.FIELDS}
    assert leaves <= set(specs)
    assert specs["adapter.method"].kind == "dropdown" and specs["adapter.method"].choices == ["lora", "qlora", "dora", "full"]
    assert specs["data.packing"].kind == "checkbox" and specs["adapter.r"].kind == "int"
    assert specs["training.lr"].kind == "float" and specs["training.lr"].default == 2e-4
    assert specs["quantization.bits"].choices == [4, 8] and specs["quantization.enabled"].kind == "toggle"
    assert specs["output.trackers"].kind == "multiselect" and specs["output.sample_prompts"].kind == "list"
    assert specs["adapter.r"].description == "LoRA rank." and specs["data.max_seq_len"].label == "max_seq_len (tokens)"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_form_and_yaml_round_trip_every_shipped_recipe(path):
    recipe = Recipe.load(path)
    data = form.dict_from_widgets(widgets_for(recipe))
    assert form.validate(data).to_dict() == recipe.to_dict()
    assert form.recipe_from_yaml(form.to_yaml(data)).to_dict() == recipe.to_dict()


def test_the_micro_batch_field_takes_a_number_or_auto():
    assert {s.key: s for s in form.FIELDS}["training.micro_batch_size"].kind == "text"  # not a comma list
    auto = Recipe.load(ROOT / "recipes/tiny.yaml", ["training.micro_batch_size=auto", "training.grad_accum=1",
                                                    "training.batch_size=8"])
    data = form.dict_from_widgets(widgets_for(auto))
    assert form.validate(data).to_dict() == auto.to_dict()
    typed = form.validate(form.dict_from_widgets(set_field(widgets_for(Recipe.load(ROOT / "recipes/tiny.yaml")),
                                                           "training.micro_batch_size", "6")))
    assert typed.training.micro_batch_size == 6


def test_editing_the_form_updates_the_yaml(h):
    values = widgets_for(Recipe.load(ROOT / "recipes/tiny.yaml"))
    values = set_field(values, "adapter.r", 32)
    values = set_field(values, "adapter.target_modules", "q_proj, v_proj")
    values = set_field(values, "output.sample_prompts", '["Hello, who are you?", "2 + 2?"]')
    values = set_field(values, "training.max_steps", "7")
    text, status, bad = h.form_changed(*values)
    data = yaml.safe_load(text)
    assert data["adapter"]["r"] == 32 and data["adapter"]["target_modules"] == ["q_proj", "v_proj"]
    assert data["output"]["sample_prompts"] == ["Hello, who are you?", "2 + 2?"]
    assert data["training"]["max_steps"] == 7 and data["training"]["threads"] is None
    assert "quantization" not in data  # an optional section that is off stays out
    assert "valid recipe" in status and not bad
    # and back: the YAML fills the form with the same values (prompts with commas as a YAML list)
    back, _, _ = h.yaml_changed(text)
    assert value_of(back, "adapter.target_modules") == "q_proj, v_proj"
    assert value_of(back, "output.sample_prompts") == '["Hello, who are you?", "2 + 2?"]'
    assert value_of(back, "training.max_steps") == "7" and value_of(back, "training.threads") == ""


def test_editing_the_yaml_updates_the_form_with_defaults_for_missing_keys(h):
    values, status, bad = h.yaml_changed("name: mine\nadapter: {method: qlora, r: 4}\ntraining: {lr: 1.0e-4}\n")
    assert value_of(values, "name") == "mine" and value_of(values, "adapter.r") == 4
    assert value_of(values, "adapter.method") == "qlora"
    assert value_of(values, "quantization.enabled") is True and value_of(values, "quantization.bits") == "4"
    assert value_of(values, "training.lr") == 1e-4 and value_of(values, "training.epochs") == 1.0
    assert value_of(values, "model.path") == "builtin:tiny"  # the schema's default
    assert "valid recipe" in status and not bad


def test_validation_errors_are_the_cli_validators_text(h):
    values = set_field(widgets_for(Recipe()), "adapter.r", 0)
    values = set_field(values, "training.threads", "lots")
    _, status, bad = h.form_changed(*values)
    with pytest.raises(RecipeError) as err:
        Recipe.from_dict(form.dict_from_widgets(values), source="recipe")
    for line in str(err.value).splitlines():
        assert line in html.unescape(status)
    assert "recipe: adapter.r: Input should be greater than 0" in status
    assert "training.threads" in status and set(bad) == {"adapter", "training"}
    assert bad["adapter"] == ["adapter.r: Input should be greater than 0"]
    assert "wb-error" in status


def test_yaml_errors_unknown_keys_and_unfit_values(h):
    values, status, bad = h.yaml_changed("adapter:\n  dropuot: 0.1\n")
    assert "unknown key 'dropuot' (did you mean 'dropout'?)" in html.unescape(status) and set(bad) == {"adapter"}
    values, status, _ = h.yaml_changed("adapter: {r: [1, 2]}\n")
    assert value_of(values, "adapter.r") is form.SKIP and "adapter.r" in status  # the widget keeps its value
    values, status, _ = h.yaml_changed("adapter: {r: 4\n")
    assert "invalid YAML" in status and all(v is form.SKIP for v in values)
    _, status, _ = h.yaml_changed("- just\n- a list\n")
    assert "must be a YAML mapping" in status
    _, status, bad = h.yaml_changed("adapter: {method: lora}\nquantization: {bits: 4}\n")
    assert "quantization: only used with adapter.method: qlora or dora" in status and "quantization" in bad


# -- files: load, save, and nothing outside the workspace --------------------------------------------------


def test_load_and_save_recipes_inside_the_workspace(h, root):
    assert "recipes/tiny.yaml" in h.ws.recipe_choices()
    text, values, status, bad = h.load_recipe("recipes/tiny.yaml")
    assert "name: tiny" in text and value_of(values, "adapter.r") == 8 and "loaded" in status and not bad
    status = h.save_recipe("recipes/mine/new.yaml", text.replace("name: tiny", "name: new"))
    assert "saved recipes/mine/new.yaml" in status
    assert Recipe.load(root / "recipes/mine/new.yaml").name == "new"
    status = h.save_recipe("recipes/broken.yaml", "adapter: {r: 0}\n")
    assert "not saved" in status and "adapter.r" in status and not (root / "recipes/broken.yaml").exists()


@pytest.mark.parametrize("path", ["../outside.yaml", "/etc/passwd", "recipes/../../outside.yaml", "~/x.yaml",
                                  "recipes/link/secret.yaml", "recipes/\x00.yaml", ""])
def test_paths_outside_the_workspace_are_refused_everywhere(h, root, tmp_path_factory, path):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.yaml").write_text("name: top-secret-content\n")
    (root / "recipes/link").symlink_to(outside)  # a symlink inside the root that leads out of it
    text, _, status, _ = h.load_recipe(path)
    assert "wb-error" in status and text is form.SKIP and "top-secret-content" not in status
    assert "not saved" in h.save_recipe(path, "name: x\n")
    assert not (root.parent / "outside.yaml").exists() and not list(outside.glob("*.yaml"))[1:]
    with pytest.raises(PathError):
        h.ws.run_dir(path or "..")


def test_run_names_and_recipe_fields_cannot_leave_the_workspace(h, root):
    for name in ("..", "../..", "/etc", "x/../../y"):
        with pytest.raises(PathError):
            h.ws.run_dir(name)
        assert "wb-error" in h.compare([name])[-1]
        assert "wb-error" in h.chat(name, "hi")[-1]
        assert h.export_csv([name])[0] is None
    tiny = (root / "recipes/tiny.yaml").read_text()
    for override in ("output.dir=../escape/{name}", "data.train=/etc/passwd", "data.eval=../../e.jsonl",
                     "data.train=[recipes/data/tiny_chat.jsonl, {path: /etc/passwd, format: text}]",
                     "model.path=/opt/models/x", "data.chat_template=/etc/passwd", "data.chat_template=../t.jinja"):
        text = Recipe.from_dict(yaml.safe_load(tiny)).override(override).to_yaml()
        name, status = h.launch(text, 1)
        assert name is None and "outside the workspace" in status, override
        assert "outside the workspace" in h.form_changed(*form.widgets_from_dict(yaml.safe_load(text)))[1]
    assert not (root.parent / "escape").exists() and h.jobs.names() == []


def test_the_form_shows_and_reads_back_a_mix_of_sources(h, root):
    sources = [{"path": "recipes/data/tiny_chat.jsonl", "format": None, "weight": 2.0},
               {"path": "recipes/data/identity_train.jsonl", "format": "chat", "weight": 0.5}]
    data = Recipe.load(root / "recipes/tiny.yaml").override(data__train=sources).to_dict()
    values = form.widgets_from_dict(data)
    assert value_of(values, "data.train") == ("[{path: recipes/data/tiny_chat.jsonl, format: null, weight: 2.0}, "
                                              "{path: recipes/data/identity_train.jsonl, format: chat, weight: 0.5}]")
    assert form.dict_from_widgets(values)["data"]["train"] == sources
    one = form.widgets_from_dict(Recipe.load(root / "recipes/tiny.yaml").override(data__train="d/a,b.jsonl").to_dict())
    assert form.dict_from_widgets(one)["data"]["train"] == "d/a,b.jsonl"  # one file whose name holds a comma
    assert "valid recipe" in h.form_changed(*values)[1]


def test_a_chat_template_file_outside_the_workspace_is_never_read(h, root, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.jinja").write_text("{{ top_secret_content }\n")  # would not parse: its error would quote it
    (root / "recipes/link.jinja").symlink_to(outside / "secret.jinja")
    tiny = Recipe.load(root / "recipes/tiny.yaml")
    for value in (str(outside / "secret.jinja"), "recipes/link.jinja"):
        text = tiny.override(f"data.chat_template={value}").to_yaml()
        for status in (h.preview_data(text, 1)[0], h.launch(text, 1)[1], h.check(yaml.safe_load(text))[0]):
            assert "outside the workspace" in status and "top_secret" not in status, (value, status)
    text = tiny.override("data.chat_template=chatml").to_yaml()  # a registered name is no file
    assert "valid recipe" in h.check(yaml.safe_load(text))[0]


def test_several_processes_go_through_workbench_launch(root, monkeypatch):
    import subprocess

    started = []

    class FakeProcess:
        pid = 999_999
        returncode = 0

        def __init__(self, argv, **kwargs):
            started.append((argv, kwargs))

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeProcess)
    h = Handlers(root)
    name, status = h.launch(tiny_text("multi"), 2)
    argv, kwargs = started[-1]
    # -P and PYTHONSAFEPATH: the workspace (the working directory) is never on the import path
    assert name == "multi" and argv[1:] == ["-P", "-m", "workbench", "launch", ".workbench-ui/jobs/multi/recipe.yaml",
                                            "--nproc", "2"]
    assert kwargs["cwd"] == root.resolve() and kwargs["start_new_session"] and "shell" not in kwargs
    assert kwargs["env"]["PYTHONSAFEPATH"] == "1"
    assert "resumed multi" in h.resume("multi")
    assert started[-1][0][4:] == ["launch", ".workbench-ui/jobs/multi/recipe.yaml", "--nproc", "2", "--resume"]
    assert "not launched" in h.launch(tiny_text("multi"), 0)[1]


def test_ui_dir_and_job_names_are_safe(root):
    registry = JobRegistry(Workspace(root))
    for name in ("..", "../x", "/tmp"):
        assert registry.status(name) is None
        assert "not running" in registry.stop(name)


# -- compare, CSV, estimate, charts ---------------------------------------------------------------------


def fake_run(root: Path, name: str, **summary) -> None:
    run = root / "runs" / name
    run.mkdir(parents=True)
    s = {"status": "completed", "strategy": "single", "world_size": 1, "steps": 4, "tokens_per_s": 1234.5,
         "peak_memory_mb": 512.25, "predicted_peak_memory_mb": 600.0, "mfu": 0.0123, "wall_s": 9.5,
         "final_loss": 1.23456, "eval_loss_first": 2.0, "eval_loss_final": 1.5, **summary}
    (run / "run.json").write_text(json.dumps({"env": {}, "summary": s}))
    (run / "recipe.yaml").write_text(Recipe(name=name).to_yaml())
    rows = [{"step": 0, "eval_loss": 2.0}, *({"step": i, "loss": 3.0 / i, "tokens_per_s": 1000.0 + i} for i in range(1, 5)),
            {"step": 4, "eval_loss": 1.5}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_compare_table_charts_and_csv_export(h, root):
    fake_run(root, "a")
    fake_run(root, "b", tokens_per_s=2000.0, mfu=None, predicted_peak_memory_mb=None)
    assert h.ws.run_choices() == ["a", "b"]
    table, memory, speed, losses, status = h.compare(["a", "b"])
    assert list(table.columns) == [TABLE_HEADERS[c] for c in COLUMNS] and set(COMPARE_COLUMNS) <= set(COLUMNS)
    assert {"method", "strategy", "world size", "tokens/s", "peak memory (MB)", "predicted peak (MB)", "MFU (%)",
            "wall time (s)", "final loss", "eval loss (final)"} <= set(table.columns)
    assert table["run"].tolist() == ["a", "b"] and table["MFU (%)"].tolist()[0] == 1.23
    assert table["tokens/s"].tolist() == [1234.5, 2000.0] and table["method"].tolist() == ["lora", "lora"]
    assert all(isinstance(f, Figure) for f in (memory, speed, losses)) and "2 run(s)" in status
    assert [line.get_label() for line in losses.axes[0].lines] == ["a", "a (eval)", "b", "b (eval)"]

    path, status = h.export_csv(["a", "b"])
    path = Path(path)
    assert path.parent == root.resolve() / ".workbench-ui" / "exports" and "exported 2 run(s)" in status
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == COLUMNS and [r["run"] for r in rows] == ["a", "b"]
    assert float(rows[0]["tokens_per_s"]) == 1234.5 and rows[1]["mfu"] == ""
    assert display_table([]).empty and h.compare([])[-1].count("choose") == 1


class FakeEstimate:
    def to_json(self):
        gib = 2**30

        def strategy(name, weights, fits):
            parts = {"weights": weights * gib, "adapter": gib // 10, "gradients": gib // 10, "optimizer": gib // 5,
                     "activations": 3 * gib, "other": gib // 2}
            return {"name": name, "per_device_bytes": sum(parts.values()), "cpu_bytes": 2 * gib, "fits": fits,
                    "breakdown": parts}

        return {"model": {"params": 8_000_000_000, "trainable_params": 42_000_000},
                "strategies": [strategy("ddp", 16, False), strategy("fsdp", 4, True)], "recommended": "fsdp",
                "device": {"name": "l4", "memory_bytes": 24 * gib, "count": 4},
                "throughput": {"tokens_per_s": 4000.0, "epoch_hours": 2.5, "gpu_hours": 10.0, "cost": 25.0},
                "notes": ["a note"]}


def test_estimate_chart_from_the_estimators_json_contract(h):
    seen = {}

    def fake(recipe, **kwargs):
        seen.update(kwargs, recipe=recipe)
        return FakeEstimate()

    text = (ROOT / "recipes/tiny.yaml").read_text()
    fig, status, table = h.estimate(text, 4, 1, "l4", None, 2.5, estimator=fake)
    assert seen["world_size"] == 4 and seen["device"] == "l4" and seen["price_per_gpu_hour"] == 2.5
    assert seen["recipe"].name == "tiny" and seen["device_memory"] is None
    assert "Recommended strategy: fsdp" in status and "4 × l4 with 24.0 GiB" in status and "a note" in status
    assert "2.5 h" in status and "$25.00" in status
    assert table["strategy"].tolist() == ["ddp", "fsdp"] and table["fits"].tolist() == ["no", "yes"]
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ddp", "★ fsdp"]
    assert any(list(line.get_ydata()) == [24.0, 24.0] for line in ax.lines)  # the device-memory line, in GiB
    assert {t.get_label() for t in ax.containers} >= {"weights", "activations", "other"}
    # a memory override in GiB is passed on in bytes; "this machine" means the estimator's own detection
    h.estimate(text, 1, 1, "this machine", 16, None, estimator=fake)
    assert seen["device_memory"] == 16 * 2**30 and seen["device"] is None
    _, status, _ = h.estimate("adapter: {r: 0}", 1, 1, "l4", None, None, estimator=fake)
    assert "adapter.r" in status


def test_estimate_with_the_real_estimator(h):
    pytest.importorskip("workbench.estimator.memory")
    fig, status, table = h.estimate((ROOT / "recipes/tiny.yaml").read_text(), 1, 1, "h100", None, None)
    assert "Recommended strategy:" in status and len(table) >= 3 and fig.axes
    assert (table["max micro-batch"] >= 1).all() and (table["max seq len"] >= 8).all()  # the planner's figures
    _, status, _ = h.estimate((ROOT / "recipes/tiny.yaml").read_text(), 3, 2, "h100", None, None)
    assert "wb-error" in status  # 3 devices cannot be split over 2 nodes
    _, _, table = h.estimate((ROOT / "recipes/tiny.yaml").read_text(), 4, 2, "h100", None, None)
    meshes = dict(zip(table["strategy"], table["mesh"]))  # each layout's device mesh beside its memory
    assert meshes["fsdp_hybrid"] == "dp_replicate=2 x dp_shard=2" and meshes["tp"] == "tp=4"


def test_charts_draw_empty_states():
    assert charts.curves({"x": []}, "loss", "Loss", "loss").axes[0].texts
    assert charts.memory_breakdown([], None, None).axes[0].texts
    assert charts.run_bars([{"run": "a", "tokens_per_s": None}], [("tokens_per_s", "t")], "T", "t").axes[0].texts


# -- the app itself ---------------------------------------------------------------------------------------


def test_app_builds_with_a_widget_per_field_and_safe_defaults(root):
    import inspect

    from ui import app

    demo = app.build_app(root)
    ids = {getattr(b, "elem_id", None) for b in demo.blocks.values()}
    assert {"f-" + s.key.replace(".", "-") for s in form.FIELDS} <= ids
    assert {"recipe-yaml", "estimate-plot", "launch-btn", "compare-table", "chat-tuned"} <= ids
    assert demo.analytics_enabled is False
    params = inspect.signature(app.launch).parameters
    assert params["host"].default == "127.0.0.1" and params["auth"].default is None
    assert app.parse_auth("ann:s3:cret") == ("ann", "s3:cret") and app.parse_auth(None) is None
    with pytest.raises(ValueError):
        app.parse_auth("no-colon")


# -- jobs: real tiny runs through the CLI --------------------------------------------------------------------


def tiny_text(name: str, *overrides: str) -> str:
    recipe = Recipe.load(ROOT / "recipes/tiny.yaml").override(f"name={name}", "training.threads=1", *overrides)
    return recipe.to_yaml()


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A workspace with one tiny run launched from the UI and run to completion."""
    root = tmp_path_factory.mktemp("jobs")
    shutil.copytree(ROOT / "recipes", root / "recipes")
    h = Handlers(root)
    name, status = h.launch(tiny_text("ui-job"), 1)
    assert name == "ui-job", status
    assert h.jobs.wait(name, timeout=240) == 0, h.jobs.log_tail(name)
    return h, root


@pytest.mark.slow
def test_a_launched_job_runs_to_completion_and_is_watched(finished):
    h, root = finished
    job = json.loads((root / ".workbench-ui/jobs/ui-job/job.json").read_text())
    assert job["command"] == ["train", ".workbench-ui/jobs/ui-job/recipe.yaml", "--no-progress"]
    status, progress, log, loss, speed, preference, signature = h.job_view("ui-job")
    assert "completed" in status and "step 20 / 20" in status and "20 / 20 steps" in progress
    assert "$ workbench train" in log and "final train loss" in log
    assert loss.axes and speed.axes and preference is None  # an SFT run: no preference plot
    assert h.job_view("ui-job", signature)[3] is form.SKIP  # unchanged metrics: no redraw
    assert "ui-job" in h.ws.run_choices(with_adapter=True) and "runs/ui-job/recipe.yaml" in h.ws.recipe_choices()
    table, *_ = h.compare(["ui-job"])
    assert table["status"].tolist() == ["completed"] and table["steps"].tolist() == [20]
    assert "ui-job is not running" in h.stop("ui-job")
    # a fresh page (or a restarted server) finds the job on disk
    assert JobRegistry(Workspace(root)).names() == ["ui-job"]
    assert JobRegistry(Workspace(root)).status("ui-job").state == "completed"


@pytest.mark.slow
def test_chat_answers_with_the_base_model_and_the_adapter(finished):
    h, _ = finished
    base, tuned, status = h.chat("ui-job", "What is 2 + 3?", 8)
    assert isinstance(base, str) and isinstance(tuned, str) and "answered" in status
    assert "choose a run" in h.chat(None, "hi")[-1]


@pytest.mark.slow
def test_stop_sends_sigint_and_resume_continues(root):
    h = Handlers(root)
    text = tiny_text("long", "training.max_steps=3000", "output.log_every=1", "output.save_every=3",
                     "output.eval_every=null", "data.eval=null")
    name, status = h.launch(text, 1)
    assert name == "long", status
    metrics = root / "runs/long/metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 4, 120, "training steps")
    assert "still running" in h.launch(text, 1)[1]
    # another server process sees the running job through its pid, not through a Popen object
    assert JobRegistry(Workspace(root)).status("long").state == "running"
    assert "sent SIGINT" in h.stop("long")
    assert h.jobs.status("long").state in ("stopping", "interrupted")
    assert h.jobs.wait("long", timeout=60) not in (None, 0)
    stopped = h.jobs.status("long")
    assert stopped.state == "interrupted" and stopped.pid is None and stopped.steps >= 3

    status = h.resume("long")
    assert "resumed long" in status and "--resume" in status
    wait_for(lambda: "resumed from" in h.jobs.log_tail("long") or h.jobs.status("long").state != "running",
             120, "the resumed run to load its checkpoint")
    assert "resumed from" in h.jobs.log_tail("long"), h.jobs.log_tail("long")
    assert "sent SIGINT" in h.stop("long")
    assert h.jobs.wait("long", timeout=60) not in (None, 0)
    log = h.jobs.log_tail("long")
    assert "$ workbench train .workbench-ui/jobs/long/recipe.yaml --no-progress" in log
    assert "$ workbench train runs/long/recipe.yaml --resume --no-progress" in log


def test_every_plot_of_the_page_renders_the_charts_figures(tmp_path):
    """Each plot component accepts the charts' figures as matplotlib images (not a Gradio type error)."""
    from ui.app import build_app

    plots = [block for block in build_app(tmp_path).blocks.values() if type(block).__name__ == "FigurePlot"]
    assert len(plots) >= 6
    assert {plot.get_block_name() for plot in plots} == {"plot"}  # the page draws them with Gradio's own Plot
    for plot in plots:
        data = plot.postprocess(charts.empty("nothing yet"))
        assert data.type == "matplotlib" and data.plot.startswith("data:image/png;base64,")


# -- preference training: objective dpo/orpo in the form, reward figures in Train and Compare ------------------


def test_format_and_objective_choices_come_from_the_registry_and_the_schema():
    specs = {s.key: s for s in form.FIELDS}
    assert specs["data.format"].kind == "dropdown" and specs["data.format"].choices == list(FORMAT_NAMES)
    assert "preference" in FORMAT_NAMES
    objective = specs["training.objective"]
    assert objective.kind == "dropdown" and objective.default == "sft"
    assert objective.choices == ["sft", "dpo", "orpo", "kto", "reward", "grpo"]
    for key in ("training.dpo_beta", "training.orpo_lambda", "training.kto_beta"):
        assert specs[key].kind == "float" and specs[key].default == 0.1 and not specs[key].optional
    # no list of formats of its own anywhere in ui/: the form reads the schema, which reads the registry
    import re

    for path in (ROOT / "ui").glob("*.py"):
        source = path.read_text()
        for name in ("alpaca", "preference", "completion", "unpaired"):
            assert not re.search(rf"""["']{name}["']""", source), (path.name, name)


def dpo_widgets() -> list:
    return widgets_for(Recipe.load(ROOT / "recipes/tiny-dpo.yaml"))


def test_the_form_builds_a_dpo_or_orpo_recipe_that_validates(h):
    values = set_field(widgets_for(Recipe.load(ROOT / "recipes/tiny.yaml")), "training.objective", "dpo")
    _, status, bad = h.form_changed(*values)  # chat data cannot train dpo: the compatibility rule says what to set
    assert set(bad) == {"data"} and "set data.format: preference" in status
    values = set_field(values, "data.format", "preference")
    values = set_field(values, "data.train", "recipes/data/preference_train.jsonl")
    values = set_field(values, "data.eval", "recipes/data/preference_eval.jsonl")
    values = set_field(values, "training.dpo_beta", 0.25)
    text, status, bad = h.form_changed(*values)
    assert not bad and "valid recipe" in status and "dpo (beta = 0.25)" in status
    recipe = form.recipe_from_yaml(text)
    assert recipe.training.objective == "dpo" and recipe.training.dpo_beta == 0.25
    assert recipe.data.format == "preference"
    back, _, _ = h.yaml_changed(text)  # and back into the form
    assert value_of(back, "training.objective") == "dpo" and value_of(back, "training.dpo_beta") == 0.25
    assert value_of(back, "data.format") == "preference"
    values = set_field(set_field(values, "training.objective", "orpo"), "training.orpo_lambda", "0.5")
    text, status, bad = h.form_changed(*values)
    assert not bad and "orpo (lambda = 0.5)" in status and form.recipe_from_yaml(text).training.orpo_lambda == 0.5
    # dpo needs an adapter to switch off for its reference model
    values = set_field(set_field(values, "training.objective", "dpo"), "adapter.method", "full")
    _, status, bad = h.form_changed(*values)
    assert set(bad) == {"training"} and "training.objective: dpo compares against the base model" in status


def test_the_form_builds_a_kto_recipe_that_validates(h):
    values = set_field(widgets_for(Recipe.load(ROOT / "recipes/tiny.yaml")), "training.objective", "kto")
    _, status, bad = h.form_changed(*values)
    assert set(bad) == {"data"} and "set data.format: unpaired" in status
    values = set_field(values, "data.format", "unpaired")
    values = set_field(values, "data.train", "recipes/data/unpaired_train.jsonl")
    values = set_field(values, "data.eval", "recipes/data/unpaired_eval.jsonl")
    values = set_field(set_field(values, "training.kto_beta", 0.2), "training.kto_undesirable_weight", 1.5)
    text, status, bad = h.form_changed(*values)
    assert not bad and "kto (beta = 0.2, desirable weight = 1, undesirable weight = 1.5)" in status, status
    recipe = form.recipe_from_yaml(text)
    assert (recipe.training.objective, recipe.training.kto_beta, recipe.data.format) == ("kto", 0.2, "unpaired")
    # unpaired rows cannot train the preference objectives: the rule names the objective
    _, status, bad = h.form_changed(*set_field(values, "training.objective", "dpo"))
    assert set(bad) == {"training"} and "does not learn from data.format unpaired rows" in status


def test_the_form_builds_a_reward_model_recipe_that_validates(h):
    values = set_field(widgets_for(Recipe.load(ROOT / "recipes/tiny.yaml")), "training.objective", "reward")
    _, status, bad = h.form_changed(*values)
    assert set(bad) == {"data"} and "set data.format: preference" in status
    values = set_field(values, "data.format", "preference")
    values = set_field(values, "data.train", "recipes/data/preference_train.jsonl")
    values = set_field(values, "data.eval", "recipes/data/preference_eval.jsonl")
    text, status, bad = h.form_changed(*set_field(values, "training.reward_center_coefficient", 0.01))
    assert not bad and "reward (centring coefficient = 0.01)" in status, status
    assert form.recipe_from_yaml(text).training.scores_sequences
    _, status, bad = h.form_changed(*set_field(values, "adapter.method", "full"))
    assert set(bad) == {"training"} and "training.objective: reward trains an adapter" in status


@pytest.mark.parametrize("value", [-1, "-1", "abc", 0, "", None, "nan", "inf", "1e400", [0.1]])
@pytest.mark.parametrize("key", ["training.dpo_beta", "training.orpo_lambda"])
def test_an_invalid_preference_strength_is_one_clear_error(h, key, value):
    _, status, bad = h.form_changed(*set_field(dpo_widgets(), key, value))
    assert list(bad) == ["training"] and len(bad["training"]) == 1
    assert bad["training"][0].startswith(f"{key}: ")
    text = html.unescape(status)
    assert "wb-error" in status and text.count("recipe: ") == 1 and f"recipe: {key}: " in text


def preference_rows(steps: int = 4) -> list[dict]:
    """metrics.jsonl rows of a preference run (the keys the training session writes), with an eval at both ends."""
    def figures(step: int, prefix: str = "") -> dict:
        return {f"{prefix}rewards_chosen": 0.1 * step, f"{prefix}rewards_rejected": -0.1 * step,
                f"{prefix}reward_margin": 0.2 * step, f"{prefix}reward_accuracy": min(1.0, 0.5 + 0.1 * step),
                f"{prefix}logps_chosen": -140.0 + step, f"{prefix}logps_rejected": -130.0 - step}

    return [{"step": 0, "eval_loss": 0.693147, **figures(0, "eval_")},
            *({"step": i, "epoch": 0, "loss": 0.69 - 0.03 * i, "tokens_per_s": 900.0 + i, **figures(i)}
              for i in range(1, steps + 1)),
            {"step": steps, "eval_loss": 0.52, **figures(steps + 1, "eval_")}]


def fake_preference_run(root: Path, name: str, objective: str = "dpo", **summary) -> None:
    run = root / "runs" / name
    run.mkdir(parents=True)
    s = {"status": "completed", "strategy": "single", "world_size": 1, "steps": 4, "total_steps": 4,
         "tokens_per_s": 900.0, "final_loss": 0.57, "eval_loss_first": 0.693147, "eval_loss_final": 0.52,
         "objective": objective, "eval_reward_margin_final": 1.171652, "eval_reward_accuracy_final": 0.75, **summary}
    (run / "run.json").write_text(json.dumps({"env": {}, "summary": s}))
    recipe = Recipe.load(ROOT / "recipes/tiny-dpo.yaml").override(f"name={name}", f"training.objective={objective}")
    (run / "recipe.yaml").write_text(recipe.to_yaml())
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in preference_rows()) + "\n")


def fake_job(root: Path, name: str) -> None:
    """A job record for a finished run, as if this workspace's UI had launched it (its process is gone)."""
    folder = root / ".workbench-ui" / "jobs" / name
    folder.mkdir(parents=True)
    (folder / "job.json").write_text(json.dumps({
        "name": name, "run_dir": f"runs/{name}", "command": ["train", f"runs/{name}/recipe.yaml", "--no-progress"],
        "pid": 0, "started": time.time() - 60, "log": f".workbench-ui/jobs/{name}/train.log"}))


def labels(figure: Figure) -> list[str]:
    return [line.get_label() for ax in figure.axes for line in ax.lines if not line.get_label().startswith("_")]


def test_the_preference_chart_draws_margin_and_accuracy_over_the_steps():
    import pandas as pd

    rows = preference_rows()
    for frame in (rows, pd.DataFrame(rows)):  # metrics rows, or a run's history DataFrame
        figure = charts.preference_chart(frame)
        assert labels(figure) == ["margin", "margin (eval)", "accuracy", "accuracy (eval)"]
        margin, accuracy = figure.axes
        assert list(margin.lines[0].get_xdata()) == [1, 2, 3, 4]  # train rows only, no gaps at the eval rows
        assert list(margin.lines[1].get_ydata()) == pytest.approx([0.0, 1.0])  # eval at step 0 and 4
        assert accuracy.get_ylim()[1] <= 1.05
    assert charts.is_preference(rows) and not charts.is_preference([{"step": 1, "loss": 2.0}])
    sft = [{"step": 1, "loss": 2.0, "tokens_per_s": 10.0}, {"step": 1, "eval_loss": 2.1}]
    assert charts.preference_chart(sft).axes[0].texts and not labels(charts.preference_chart(sft))  # an empty state
    hostile = [5, None, "x", {"step": "1", "reward_margin": 1.0}, {"step": 2, "reward_margin": "big"},
               {"step": 3, "reward_margin": float("nan")}, {"step": 4, "reward_margin": True}]
    assert charts.preference_chart(hostile).axes[0].texts  # nothing drawable: the empty state, no error
    # the API's run figure grows a third panel for a preference run only
    assert len(charts.run_figure("p", rows).axes) == 4 and len(charts.run_figure("s", sft).axes) == 2


def test_the_train_tab_shows_the_preference_plot_for_a_preference_run_only(h, root):
    fake_preference_run(root, "pref")
    fake_job(root, "pref")
    fake_run(root, "plain")
    fake_job(root, "plain")
    status, progress, _, loss, speed, preference, signature = h.job_view("pref")
    assert "completed" in status and "4 / 4 steps" in progress
    assert "reward margin 0.800" in status and "reward accuracy 90%" in status
    assert isinstance(preference, Figure) and "dpo" in preference.axes[0].get_title(loc="left")
    assert labels(preference) == ["margin", "margin (eval)", "accuracy", "accuracy (eval)"]
    assert h.job_view("pref", signature)[5] is form.SKIP  # unchanged metrics: no redraw
    status, _, _, loss, speed, preference, _ = h.job_view("plain")
    assert preference is None and loss.axes and "reward" not in status  # an SFT run: the page hides the plot
    assert h.job_view(None)[5] is None
    # a preference run that has not logged yet: its recipe says dpo, so the plot shows its empty state
    (root / "runs/pref/metrics.jsonl").write_text("")
    (root / "runs/pref/run.json").write_text(json.dumps({"summary": {"status": "running"}}))
    preference = h.job_view("pref")[5]
    assert isinstance(preference, Figure) and preference.axes[0].texts and not labels(preference)


def test_the_train_tab_plots_a_grpo_runs_reward_and_answer_length(h, root):
    run = root / "runs" / "rl"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"env": {}, "summary": {
        "status": "completed", "steps": 2, "total_steps": 2, "objective": "grpo", "reward_final": 0.75}}))
    recipe = Recipe.load(ROOT / "recipes/tiny-grpo.yaml").override("name=rl")
    (run / "recipe.yaml").write_text(recipe.to_yaml())
    rows = [{"step": step, "loss": 0.0, "tokens_per_s": 100.0, "reward": reward, "rewards/exact_answer/mean": reward,
             "completions/mean_length": 9.0 + step} for step, reward in ((1, 0.25), (2, 0.75))]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    fake_job(root, "rl")
    status, _, _, _, _, third, _ = h.job_view("rl")
    assert "reward 0.750" in status and "grpo" in third.axes[0].get_title(loc="left")
    assert labels(third) == ["reward", "exact_answer", "answer length"]
    table, *_ = h.compare(["rl"])
    assert table["reward (final)"].tolist() == [0.75]


def test_compare_shows_the_objective_and_final_reward_margin_and_accuracy(h, root):
    fake_run(root, "a-sft")
    fake_preference_run(root, "b-dpo")
    fake_preference_run(root, "c-orpo", objective="orpo", eval_reward_margin_final=None,
                        eval_reward_accuracy_final="hostile")  # no summary figures: the last eval row's
    table, *_, status = h.compare(["a-sft", "b-dpo", "c-orpo"])
    assert "3 run(s)" in status
    assert table["objective"].tolist() == ["sft", "dpo", "orpo"]
    columns = ["reward margin (final)", "reward accuracy (final, %)", "eval reward margin (final)",
               "eval reward accuracy (final, %)"]
    assert set(columns) <= set(table.columns)
    assert table[columns].iloc[0].isna().all()  # blank for the SFT run
    assert table[columns].iloc[1].tolist() == pytest.approx([0.8, 90.0, 1.1717, 75.0])
    assert table[columns].iloc[2].tolist() == pytest.approx([0.8, 90.0, 1.0, 100.0])
    path, _ = h.export_csv(["a-sft", "b-dpo"])
    rows = list(csv.DictReader(Path(path).open()))
    assert [r["objective"] for r in rows] == ["sft", "dpo"] and rows[0]["eval_reward_margin_final"] == ""
    assert float(rows[1]["eval_reward_accuracy_final"]) == 0.75  # the CSV keeps fractions, as run.json does


@pytest.mark.slow
def test_a_real_dpo_run_launched_from_the_ui_has_its_reward_figures_shown(root):
    """The names the trainer writes are the names the UI reads: tiny-dpo, from Launch to Compare."""
    h = Handlers(root)
    text = Recipe.load(ROOT / "recipes/tiny-dpo.yaml").override(
        "name=ui-dpo", "training.threads=1", "training.max_steps=4", "output.eval_every=2", "output.log_every=1",
        "output.save_every=4").to_yaml()
    name, status = h.launch(text, 1)
    assert name == "ui-dpo", status
    assert h.jobs.wait(name, timeout=240) == 0, h.jobs.log_tail(name)
    status, _, _, _, _, preference, _ = h.job_view(name)
    assert "completed" in status and "reward margin" in status
    assert labels(preference) == ["margin", "margin (eval)", "accuracy", "accuracy (eval)"]
    table, *_ = h.compare([name])
    assert table["objective"].tolist() == ["dpo"]
    assert table[["eval reward margin (final)", "eval reward accuracy (final, %)"]].notna().all(axis=None)


# -- attacks: each reproduces a loss or an escape first ---------------------------------------------------------


@pytest.mark.parametrize("out", [".", "runs", "recipes", "runs/a/b", "../outside", "runs/{name}/.."])
def test_a_launch_can_only_write_a_folder_directly_under_runs(h, root, out):
    files = sorted(p for p in root.rglob("*"))
    name, status = h.launch(tiny_text("evil", f"output.dir={out}"), 1)
    assert name is None and "output.dir" in status and "refused" in status
    assert sorted(p for p in root.rglob("*")) == files  # nothing deleted, nothing written


def test_an_unknown_placeholder_is_one_clear_error(h):
    status, bad = h.check({**Recipe.load(ROOT / "recipes/tiny.yaml").to_dict(), "output": {"dir": "runs/{foo}"}})
    assert "output.dir" in status and "placeholder" in status and bad


def test_replacing_a_run_needs_the_box_and_a_second_launch(h, root):
    run = root / "runs/keep"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"summary": {"status": "completed", "steps": 2},
                                              "env": {"device": "cpu"}}))  # a record the workbench wrote
    text = tiny_text("keep", "training.max_steps=1")
    name, status = h.launch(text, 1)
    assert name is None and "already holds a run (completed, 2 steps)" in status
    name, status = h.launch(text, 1, True)
    assert name is None and "DELETED: press Launch again to confirm" in status
    assert (run / "run.json").exists()
    name, status = h.launch(text, 1, True)
    assert name == "keep" and "--overwrite" in status
    assert h.jobs.wait("keep", timeout=240) == 0, h.jobs.log_tail("keep")


def test_save_writes_only_recipes_whose_paths_stay_inside(h, root, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.jsonl").write_text("{}\n")
    (root / "runs/x").mkdir(parents=True)
    assert "inside the run directory runs/x" in h.save_recipe("runs/x/recipe.yaml", tiny_text("x"))
    assert not (root / "runs/x/recipe.yaml").exists()
    evil = tiny_text("x", f"data.train={outside}/secret.jsonl")
    assert "outside the workspace" in h.save_recipe("recipes/evil.yaml", evil)
    assert not (root / "recipes/evil.yaml").exists()
    assert "saved recipes/fine.yaml" in h.save_recipe("recipes/fine.yaml", tiny_text("fine"))


def test_resume_runs_only_a_recipe_that_passes_the_launch_checks(h, root, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.jsonl").write_text((ROOT / "recipes/data/tiny_chat.jsonl").read_text())
    name, status = h.launch(tiny_text("edited", "training.max_steps=2", "output.save_every=1"), 1)
    assert h.jobs.wait(name, timeout=240) == 0, h.jobs.log_tail(name)
    recipe = root / "runs/edited/recipe.yaml"
    data = yaml.safe_load(recipe.read_text())
    data["data"]["train"] = f"{outside}/secret.jsonl"
    recipe.write_text(yaml.safe_dump(data))
    assert "not resumed" in (status := h.resume("edited")) and "outside the workspace" in status
    data["data"]["train"], data["output"]["dir"] = "recipes/data/tiny_chat.jsonl", str(outside / "runout")
    recipe.write_text(yaml.safe_dump(data))
    assert "not resumed" in (status := h.resume("edited")) and "output.dir" in status
    assert not (outside / "runout").exists()


def test_remote_code_needs_the_servers_flag(root):
    text = tiny_text("remote", "model.trust_remote_code=true")
    assert "trust_remote_code" in Handlers(root).launch(text, 1)[1]
    assert "--allow-remote-code" in Handlers(root).check(yaml.safe_load(text))[0]
    assert "trust_remote_code" not in Handlers(root, allow_remote_code=True).check(yaml.safe_load(text))[0]


def test_code_rewards_need_the_servers_flag_too(root):
    """A GRPO recipe naming a reward `module:function` (with its own opt-in set) was valid in the UI: Launch would
    import any installed module on the server and call it with the user's data."""
    recipe = Recipe.load(ROOT / "recipes/tiny-grpo.yaml").override("name=rl")
    data = yaml.safe_load(recipe.to_yaml())
    data["training"]["grpo"].update(rewards=["antigravity:geohash"], allow_code_rewards=True)
    text = yaml.safe_dump(data)
    status = Handlers(root).launch(text, 1)[1]
    assert "code reward (antigravity:geohash)" in status and "--allow-remote-code" in status
    assert not (root / "runs" / "rl").exists() and "antigravity" not in sys.modules
    assert "code reward" not in Handlers(root, allow_remote_code=True).check(yaml.safe_load(text))[0]


def test_jobs_run_the_installed_workbench_not_one_planted_in_the_workspace(h, root):
    planted = root / "workbench"
    planted.mkdir()
    (planted / "__init__.py").write_text("raise SystemExit('PLANTED CODE RAN')\n")
    (planted / "__main__.py").write_text("raise SystemExit('PLANTED CODE RAN')\n")
    name, status = h.launch(tiny_text("safe", "training.max_steps=1"), 1)
    assert h.jobs.wait(name, timeout=240) == 0, h.jobs.log_tail(name)
    assert "PLANTED" not in h.jobs.log_tail(name)


def test_chat_refuses_a_run_whose_recipe_points_outside(h, root, tmp_path_factory):
    run = root / "runs/evil"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "recipe.yaml").write_text(tiny_text("evil", f"model.path={tmp_path_factory.mktemp('m')}"))
    base, tuned, status = h.chat("evil", "hi")
    assert (base, tuned) == ("", "") and "outside the workspace" in status


@pytest.mark.slow
def test_stop_during_loading_is_not_lost(h):
    """SIGINT while the libraries and the model load: the job exits (130) instead of training on, even when
    the server was started with SIGINT ignored (`cmd &` in a script), which its jobs inherit."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        name, status = h.launch(tiny_text("early", "training.max_steps=3000"), 1)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert name == "early", status
    time.sleep(1)  # past the interpreter's own start-up, into the imports (the CLI takes SIGINT back first)
    assert "sent SIGINT" in h.stop(name)
    assert h.jobs.wait(name, timeout=120) == 130, h.jobs.log_tail(name)
    assert h.jobs.status(name).state != "completed"


def test_stop_escalates_sigint_sigterm_then_sigkill(h, monkeypatch):
    """A job that ignores SIGINT and SIGTERM (wedged in a collective, say) still stops: the third Stop kills it."""
    import subprocess
    import sys

    from ui.jobs import Job

    code = "import signal, time; signal.signal(2, signal.SIG_IGN); signal.signal(15, signal.SIG_IGN); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code, "workbench"], start_new_session=True)
    h.jobs._procs["wedged"] = proc
    h.jobs._folder("wedged").mkdir(parents=True)
    h.jobs._write(Job("wedged", "runs/wedged", ["train"], proc.pid, time.time(), "x.log"))
    time.sleep(0.5)  # let it install its handlers
    assert "sent SIGINT" in h.stop("wedged")
    assert "sent SIGTERM" in h.stop("wedged")
    assert "Stop again after" in h.stop("wedged") and proc.poll() is None  # within the grace: only explains
    monkeypatch.setattr("ui.jobs.STOP_GRACE_S", 0.0)
    assert "sent SIGKILL" in h.stop("wedged")
    assert proc.wait(timeout=10) == -9


def test_stop_and_resume_are_enabled_by_the_jobs_state(h, monkeypatch):
    from types import SimpleNamespace

    assert h.buttons(None) == (False, False)
    for state, expected in {"running": (True, False), "stopping": (True, False), "completed": (False, False),
                            "interrupted": (False, True), "failed": (False, True)}.items():
        monkeypatch.setattr(h.jobs, "status", lambda name, s=state: SimpleNamespace(state=s))
        assert h.buttons("x") == expected, state


# -- found by a second attack --------------------------------------------------------------------------------


def test_a_launch_never_writes_through_symlinks_planted_in_the_job_records(h, root, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "bashrc").write_text("precious\n")
    (outside / "notes.yaml").write_text("precious\n")
    folder = root / ".workbench-ui/jobs/victim"
    folder.mkdir(parents=True)
    (folder / "train.log").symlink_to(outside / "bashrc")
    (folder / "recipe.yaml").symlink_to(outside / "notes.yaml")
    (folder / "job.json").symlink_to(outside / "notes.yaml")
    name, status = h.launch(tiny_text("victim", "training.max_steps=1"), 1)
    assert name == "victim", status
    assert h.jobs.wait(name, timeout=240) == 0, h.jobs.log_tail(name)
    assert (outside / "bashrc").read_text() == "precious\n" and (outside / "notes.yaml").read_text() == "precious\n"
    assert not (folder / "train.log").is_symlink() and "step 1/1" in h.jobs.log_tail(name)


def test_stop_signals_only_the_process_a_job_record_really_names(h, root):
    import os
    import signal

    from ui.jobs import Job

    h.jobs._folder("evil").mkdir(parents=True)
    for pid in (0, 1, os.getpid(), -5):  # pid 0: this server's own process group
        h.jobs._write(Job("evil", "runs/victim", ["train", "x"], pid, time.time(), "x.log"))
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            assert "not running" in h.stop("evil"), pid
        finally:
            signal.signal(signal.SIGINT, previous)


def test_symlinked_runs_or_recipes_folders_do_not_widen_the_rules(h, root):
    (root / "runs").symlink_to(root)  # runs/ -> the workspace itself
    status, bad = h.check(yaml.safe_load(tiny_text("recipes")))
    assert "output.dir" in status and bad
    (root / "runs").unlink()
    run = root / "runs/victim"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text("r: 8\n")
    shutil.move(str(root / "recipes"), str(root / "real-recipes"))
    (root / "recipes").symlink_to(run)
    assert "not saved" in h.save_recipe("recipes/recipe.yaml", tiny_text("x"))
    assert (run / "recipe.yaml").read_text() == "r: 8\n"


def test_save_asks_before_replacing_a_recipe(h, root):
    before = (root / "recipes/quickstart.yaml").read_text()
    assert "press Save again" in h.save_recipe("recipes/quickstart.yaml", tiny_text("other"))
    assert (root / "recipes/quickstart.yaml").read_text() == before
    assert "saved recipes/quickstart.yaml" in h.save_recipe("recipes/quickstart.yaml", tiny_text("other"))


def test_chat_and_compare_refuse_run_files_that_link_outside(h, root, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.yaml").write_text("api_token: sk-SECRET\n")
    run = root / "runs/victim"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "recipe.yaml").symlink_to(outside / "secret.yaml")
    base, tuned, status = h.chat("victim", "hi", 8)
    assert "symbolic link" in status and "sk-SECRET" not in status
    assert "symbolic link" in h.compare(["victim"])[-1]


# -- found by a third attack (issue 34) ------------------------------------------------------------------------


@pytest.fixture
def evil_model(tmp_path_factory):
    """A model folder outside the workspace whose config.json makes transformers import its evil.py, which leaves
    a mark: loading it with trust_remote_code runs that file."""
    folder = tmp_path_factory.mktemp("evil")
    config = {"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"import pathlib\n\npathlib.Path({str(folder / 'RAN')!r}).touch()\n\n"
                                    "from transformers import PretrainedConfig\n\n\n"
                                    "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    return folder


# (where the model lies, trust_remote_code, what the refusal names)
EVIL_CASES = {"outside-with-code": ("outside", True, "trust_remote_code"),
              "outside": ("outside", False, "outside the workspace"),
              "inside-with-code": ("models/evil", True, "trust_remote_code")}


def evil_text(root: Path, evil_model: Path, case: str) -> str:
    where, code, _ = EVIL_CASES[case]
    if where != "outside":
        shutil.copytree(evil_model, root / where)
    path = evil_model if where == "outside" else where
    return tiny_text("evil", f"model.path={path}", f"model.trust_remote_code={str(code).lower()}")


def recipe_handlers() -> list[str]:
    """Every handler that takes recipe text."""
    return [name for name, fn in inspect.getmembers(Handlers, inspect.isfunction)
            if not name.startswith("_") and "text" in inspect.signature(fn).parameters]


HANDLER_ARGS = {"relative": "recipes/evil.yaml", "rows": 3, "world_size": 1, "nodes": 1, "device": "cpu",
                "device_memory_gib": None, "price": None, "nproc": 1, "replace": False}


@pytest.mark.parametrize("case", EVIL_CASES)
@pytest.mark.parametrize("handler", recipe_handlers())
def test_every_handler_that_takes_a_recipe_refuses_remote_code_and_outside_models(h, root, evil_model, handler, case):
    fn = getattr(h, handler)
    text = evil_text(root, evil_model, case)
    args = {name: text if name == "text" else HANDLER_ARGS[name]  # a new parameter: give it a value here
            for name, p in inspect.signature(fn).parameters.items() if p.default is inspect.Parameter.empty}
    out = fn(**args)
    assert EVIL_CASES[case][2] in str(out) and "wb-error" in str(out), out
    assert not (evil_model / "RAN").exists() and not (root / "recipes/evil.yaml").exists()


@pytest.mark.parametrize("case", EVIL_CASES)
def test_every_event_of_the_page_that_reads_a_recipe_goes_through_the_gate(root, evil_model, case):
    """Each event fed the YAML box, the form or the recipe dropdown is called as the page would call it."""
    from ui import app

    demo = app.build_app(root)
    text = evil_text(root, evil_model, case)
    (root / "recipes/evil.yaml").write_text(text)
    fields = form.widgets_from_dict(yaml.safe_load(text))
    shown = {"recipe-yaml": text, "recipe-choice": "recipes/evil.yaml",
             **{"f-" + s.key.replace(".", "-"): v for s, v in zip(form.FIELDS, fields)}}
    called = []
    for event in demo.fns.values():
        ids = [getattr(c, "elem_id", None) for c in event.inputs]
        if not set(ids) & set(shown):
            continue
        out = event.fn(*(shown.get(i, c.value) for c, i in zip(event.inputs, ids)))
        called.append(event.name)
        assert EVIL_CASES[case][2] in str(out) and "wb-error" in str(out), event.name
    assert not (evil_model / "RAN").exists()
    assert {"estimate", "preview_data", "on_launch", "on_form", "on_yaml", "on_load", "<lambda>"} <= set(called)


@pytest.mark.parametrize("case", EVIL_CASES)
def test_chat_refuses_a_run_recipe_with_remote_code_or_an_outside_model(h, root, evil_model, case):
    run = root / "runs/evil"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "recipe.yaml").write_text(evil_text(root, evil_model, case))
    assert EVIL_CASES[case][2] in h.chat("evil", "hi")[-1]
    assert not (evil_model / "RAN").exists()


def test_a_model_named_relative_to_where_the_server_runs_is_not_loaded_from_there(h, root, evil_model, monkeypatch):
    """Estimate and Chat load the model in the server's process, which looks a relative name up from the folder
    it was started in: a folder there, outside the workspace, is refused."""
    monkeypatch.chdir(evil_model.parent)
    _, status, _ = h.estimate(tiny_text("x", f"model.path={evil_model.name}"), 1, 1, "cpu", None, None)
    assert "outside the workspace" in status and "wb-error" in status
    assert "outside the workspace" in h.launch(tiny_text("x", f"model.path={evil_model.name}"), 1)[1]


def test_save_says_what_is_wrong_with_the_path(h, root):
    (root / "runs/x").mkdir(parents=True)
    for path in ("recipes/../runs/x/recipe.yaml", "runs/x/recipe.yaml"):
        status = h.save_recipe(path, tiny_text("x"))
        assert "Save as: " in status and "inside the run directory runs/x" in status, path
        assert "symbolic link" not in status
    status = h.save_recipe("recipes/../notes/x.yaml", tiny_text("x"))
    assert "Save as: " in status and "not under recipes/" in status and "symbolic link" not in status
    (root / "recipes/link").symlink_to(root / "runs/x")
    status = h.save_recipe("recipes/link/recipe.yaml", tiny_text("x"))
    assert "Save as: " in status and "symbolic link" in status
    assert not list(root.glob("runs/x/*")) and not (root / "notes").exists()


# -- found by a fourth review ----------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["no", "false", "off", "0", "n"])
def test_chat_never_runs_model_code_a_run_recipe_refuses_in_words(h, root, evil_model, spelling):
    """The gate reads "no" as False through the schema; the loader must read the same recipe the same way."""
    shutil.copytree(evil_model, root / "models/evil")
    run = root / "runs/x"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    for path in (root / "models/evil", "models/evil"):
        (run / "recipe.yaml").write_text(f"name: x\nmodel:\n  path: {path}\n  trust_remote_code: '{spelling}'\n")
        base, tuned, status = h.chat("x", "hi", 4)
        assert "wb-error" in status and not (evil_model / "RAN").exists(), path  # the copy marks there too


def test_estimate_and_chat_read_the_files_the_gate_checked_in_the_workspace(h, root, tmp_path_factory, monkeypatch):
    """The gate checks a relative data.train or model.path inside the workspace; the server, started elsewhere,
    must read that same file (not one of the same name beside the folder it runs in)."""
    elsewhere = tmp_path_factory.mktemp("server-cwd")
    (elsewhere / "data").mkdir()
    (elsewhere / "data/secret.jsonl").write_text('{"text": "' + "s" * 4000 + '"}\n')
    monkeypatch.chdir(elsewhere)
    seen = []

    def spy(recipe, **kwargs):
        seen.append(recipe)
        return {"strategies": [], "recommended": None}

    _, status, _ = h.estimate(tiny_text("x", "data.train=data/secret.jsonl"), 1, 1, "cpu", None, None, estimator=spy)
    assert not seen and "data.train" in status and "outside the workspace" in status and "wb-error" in status
    (root / "data").mkdir()
    shutil.copy(ROOT / "recipes/data/tiny_chat.jsonl", root / "data/secret.jsonl")
    h.estimate(tiny_text("x", "data.train=data/secret.jsonl"), 1, 1, "cpu", None, None, estimator=spy)
    assert seen[-1].data.train == str(root / "data/secret.jsonl")
    # Chat loads the model its run's recipe names, as the gate checked it
    shutil.copytree(ROOT / "recipes", root / "models/m", dirs_exist_ok=True)  # a folder: its name is what counts
    run = root / "runs/x"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "recipe.yaml").write_text(tiny_text("x", "model.path=models/m"))
    asked = []
    import importlib

    monkeypatch.setattr(importlib.import_module("workbench.model.inference"), "generate", lambda *a, **k: asked.append(k.get("recipe")) or "ok")
    assert "answered" in h.chat("x", "hi", 4)[-1]
    assert [r.model.path for r in asked] == [str(root / "models/m")] * 2


@pytest.mark.parametrize("error", [KeyError("peft_type"), RuntimeError("size mismatch for lora_A\nshape [8, 64]"),
                                   AttributeError("'EvilConfig' object has no attribute 'x'")])
def test_chat_shows_a_damaged_adapter_as_one_message(h, root, monkeypatch, error):
    import importlib

    run = root / "runs/x"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "recipe.yaml").write_text(tiny_text("x"))

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(importlib.import_module("workbench.model.inference"), "generate", broken)
    base, tuned, status = h.chat("x", "hi", 4)
    assert (base, tuned) == ("", "") and "wb-error" in status and type(error).__name__ in status
    assert "<br>" not in status


@pytest.mark.parametrize("linked", [".workbench-ui", ".workbench-ui/exports", ".workbench-ui/previews"])
def test_the_uis_own_folder_linked_elsewhere_is_refused(h, root, tmp_path_factory, linked):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (root / linked).parent.mkdir(parents=True, exist_ok=True)
    (root / linked).symlink_to(elsewhere)
    fake_run(root, "a", status="completed", steps=1)
    path, status = h.export_csv(["a"])
    if "previews" not in linked:
        assert path is None and "wb-error" in status and "symbolic link" in status, status
    status = h.preview_data(tiny_text("x"), 1)[0]
    if "exports" not in linked:
        assert "wb-error" in status and "symbolic link" in status, status
    if linked == ".workbench-ui":
        name, status = h.launch(tiny_text("x"), 1)
        assert name is None and "wb-error" in status and "outside the workspace" in status, status
    assert not list(elsewhere.rglob("*"))


@pytest.mark.parametrize("kind", ["folder", "long", "fifo", "link"])
def test_save_refuses_what_is_no_regular_file_in_one_message(h, root, kind):
    import os

    target = {"folder": "recipes/dir.yaml", "long": f"recipes/{'n' * 300}.yaml", "fifo": "recipes/pipe.yaml",
              "link": "recipes/link.yaml"}[kind]
    if kind == "folder":
        (root / target).mkdir()
    elif kind == "fifo":
        os.mkfifo(root / target)
    elif kind == "link":
        (root / target).symlink_to(root / "recipes/tiny.yaml")
    status = h.save_recipe(target, tiny_text("x"))  # a FIFO must not block: the test would hang
    assert "wb-error" in status and "not saved" in status, status
    assert "Errno" not in status and "<br>" not in status


def test_text_of_run_files_reaches_the_page_with_its_control_characters_escaped():
    from ui.handlers import status_html

    hostile = "run\x1b]0;pwned\x07\x1b[2J\rfake\x9b"
    shown = [status_html("error", f"failed: {hostile}"),
             display_table([{"run": hostile, "status": "completed"}]).to_csv()]
    for text in shown:
        assert "pwned" in text and not any(c in text for c in "\x1b\x07\r\x9b"), text
