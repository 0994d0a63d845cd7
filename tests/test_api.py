"""The Python API: what `import workbench as wb` offers, what it returns, and the executed example notebook."""

import inspect
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.figure import Figure

import workbench as wb
from workbench.rundir.runs import COMPARE_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = {"DataError", "Estimate", "ModelError", "Recipe", "RecipeError", "Run", "TrainResult", "WorkbenchError",
          "compare", "estimate", "evaluate", "export", "generate", "launch", "list_runs", "load_run", "merge",
          "plot_compare", "preview_data", "push", "ray_train", "train"}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    recipe = wb.Recipe.load(ROOT / "recipes/tiny.yaml").override(
        f"output.dir={root}/{{name}}", "output.save_every=null", "output.eval_every=null", "output.log_every=1",
        "training.max_steps=4", "training.threads=1")
    return [wb.train(recipe.override(f"name=r{r}", f"adapter.r={r}"), progress_bar=False) for r in (2, 8)]


def test_the_public_api_is_listed_typed_and_documented():
    assert set(wb.__all__) == PUBLIC
    for name in wb.__all__:
        obj = getattr(wb, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
        if inspect.isfunction(obj):
            signature = inspect.signature(obj)
            assert signature.return_annotation is not inspect.Signature.empty, f"{name} has no return type"
            untyped = [p for p in signature.parameters.values() if p.annotation is inspect.Parameter.empty]
            assert not untyped, f"{name}: untyped parameters {untyped}"


def test_importing_the_package_is_instant_and_changes_nothing():
    """`import workbench` loads no heavy library and installs no warning filter; each name loads on first use
    (with the libraries' import-time notes silenced for that import only), and `wb.train` stays the function
    once the training modules have been imported."""
    import subprocess
    import sys

    code = """if True:
        import sys, warnings, types
        before = list(warnings.filters)
        import workbench as wb
        assert not {"torch", "transformers", "pydantic"} & set(sys.modules), sorted(sys.modules)
        assert warnings.filters == before, "import"
        wb.Recipe, wb.estimate
        assert warnings.filters == before, "first use"
        import workbench.training.entry
        from workbench.training import TrainingSession
        assert isinstance(wb.train, types.FunctionType) and wb.train.__module__ == "workbench.training.entry", wb.train
        assert "train" in dir(wb) and wb.__all__ == sorted(wb.__all__)
        assert wb.rundir.runs.RunDir and callable(wb.base.heap.return_large_blocks)  # floors load on first use too
        assert not any(hasattr(wb, name) for name in ("sys", "types", "annotations", "no_such_name"))
        print("ok")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_train_returns_metrics_as_a_dataframe_and_shows_itself(two_runs):
    result = two_runs[1]
    assert isinstance(result, wb.TrainResult) and isinstance(result.metrics, pd.DataFrame)
    steps = result.metrics.dropna(subset=["loss"])["step"].tolist()
    assert steps == [1, 2, 3, 4] and result.metrics.dropna(subset=["eval_loss"])["step"].tolist() == [0, 4]
    html = result._repr_html_()
    assert "run r8" in html and "tokens/s" in html and f"{result.summary['steps']}" in html
    figure = result.plot()
    assert isinstance(figure, Figure) and len(figure.axes) == 2 and figure.axes[0].lines


def test_compare_has_the_ui_columns_and_accepts_every_kind_of_run(two_runs):
    a, b = two_runs
    table = wb.compare([a, wb.load_run(b.run_dir)])
    assert list(table.columns) == COMPARE_COLUMNS and table["run"].tolist() == ["r2", "r8"]
    assert (table["tokens_per_s"] > 0).all() and table["predicted_peak_memory_mb"].notna().all()
    assert wb.compare(str(a.run_dir))["run"].tolist() == ["r2"]  # one directory, as a path string
    assert wb.compare([]).columns.tolist() == COMPARE_COLUMNS  # empty, but the same columns


def test_plot_compare_draws_memory_throughput_and_losses(two_runs):
    figure = wb.plot_compare(two_runs)
    memory, speed, losses = figure.axes
    assert len(memory.patches) == 4 and len(speed.patches) == 2  # measured + predicted per run; one bar each
    assert [line.get_label() for line in losses.lines] == ["r2", "r2 (eval)", "r8", "r8 (eval)"]


def test_run_objects_read_back_the_same_figures(two_runs):
    run = wb.load_run(two_runs[0].run_dir)
    assert run.summary == two_runs[0].summary
    assert run.history["loss"].dropna().tolist() == two_runs[0].metrics["loss"].dropna().tolist()
    assert isinstance(run.plot(), Figure) and "run r2" in run._repr_html_()
    with pytest.raises(wb.WorkbenchError, match="not a run directory"):
        wb.load_run(ROOT / "recipes")


def test_estimate_is_a_table_and_a_plot():
    recipe = wb.Recipe.load(ROOT / "recipes/tiny.yaml")
    est = wb.estimate(recipe, world_size=2, device="cpu")
    frame = est.to_dataframe()
    assert {"ddp", "fsdp", "zero3"} <= set(frame.index) and frame.loc["ddp", "fits"]
    assert est.recommended in frame.index and "recommended <b>" in est._repr_html_()
    figure = est.plot()
    assert isinstance(figure, Figure) and figure.axes[0].patches
    with pytest.raises(ValueError, match="world_size"):
        wb.estimate(recipe, world_size=0)


def test_recipes_are_built_in_python_too():
    recipe = wb.Recipe(name="mine", model={"path": "builtin:tiny"}, data={"train": "recipes/data/tiny_chat.jsonl"})
    assert recipe.adapter.method == "lora" and recipe.override("adapter.r=4").adapter.r == 4
    with pytest.raises(wb.RecipeError, match="adapter.rr"):
        recipe.override("adapter.rr=4")


def test_launch_refuses_a_bad_recipe_before_starting_processes(tmp_path):
    with pytest.raises(wb.RecipeError, match="--nproc"):
        wb.launch(ROOT / "recipes/tiny.yaml", nproc=0)


@pytest.mark.slow
def test_launch_runs_several_processes_and_returns_their_result(tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    recipe = wb.Recipe.load(ROOT / "recipes/tiny.yaml").override(
        f"output.dir={tmp_path}/{{name}}", "training.max_steps=3", "data.eval=null", "output.save_every=null",
        "distributed.strategy=ddp")
    result = wb.launch(recipe, nproc=2, master=f"127.0.0.1:{port}", timeout=400)
    assert result.summary["status"] == "completed" and result.summary["world_size"] == 2
    assert result.summary["distributed_type"] == "MULTI_CPU" and len(result.metrics) >= 1
    assert (Path(result.run_dir) / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_the_example_notebook_runs_end_to_end(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(ROOT / "examples/quickstart.ipynb", as_version=4)
    parameters = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    parameters.source = f"OUT = {str(tmp_path / 'runs')!r}"
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()

    outputs = {i: cell.get("outputs", []) for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"}
    assert not [o for out in outputs.values() for o in out if o.output_type == "error"]
    by_source = {notebook.cells[i].source: out for i, out in outputs.items()}

    def html(source_start):
        out = next(v for k, v in by_source.items() if k.startswith(source_start))
        return "".join(o.get("data", {}).get("text/html", "") for o in out)

    def has_image(source_start):
        out = next(v for k, v in by_source.items() if k.startswith(source_start))
        return any("image/png" in o.get("data", {}) for o in out)

    assert "recommended <b>" in html("estimate = wb.estimate")
    assert has_image("estimate.plot()") and has_image("results[16].plot()") and has_image("wb.plot_compare")
    assert "run tiny-r16" in html("results = {}")
    table = html("table = wb.compare")
    assert "tiny-r4" in table and "tiny-r16" in table
    for name in ("tiny-r4", "tiny-r16"):
        run = wb.load_run(tmp_path / "runs" / name)
        assert run.summary["status"] == "completed" and run.summary["eval_loss_final"] < run.summary["eval_loss_first"]
    # no library noise anywhere: warnings and log lines would show up as stderr
    noise = [o.text for out in outputs.values() for o in out if o.output_type == "stream" and o.name == "stderr"]
    assert not noise, noise


def test_api_calls_leave_the_process_as_they_found_it(tmp_path):
    """wb.train, merge, generate, evaluate and preview_data quiet the libraries and set torch's threads for their
    own work only: warning filters, log levels, progress bars, environment variables, thread count and logger
    filters are the same after each call (after one that raises, and after two overlapping in threads) as before."""
    import json
    import os
    import subprocess
    import sys

    code = """if True:
        import json, logging, os, sys, warnings
        import datasets, torch, transformers
        import workbench as wb
        import workbench.base.quiet

        def state():
            return {"filters": [repr(f) for f in warnings.filters], "env": dict(os.environ),
                    "threads": torch.get_num_threads(),
                    "transformers": [transformers.utils.logging.get_verbosity(),
                                     transformers.utils.logging.is_progress_bar_enabled()],
                    "datasets": [datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()],
                    "loggers": [len(logging.getLogger(n).filters) for n in workbench.base.quiet._QUIETED_LOGGERS]}

        def both(call):
            import threading
            threads = [threading.Thread(target=call) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        torch.set_num_threads(2)
        out = sys.argv[1]
        recipe = wb.Recipe.load("recipes/tiny.yaml").override(
            f"output.dir={out}/{{name}}", "training.max_steps=2", "training.threads=1", "output.save_every=null",
            "output.eval_every=null", "output.sample_prompts=[]")
        changed = {}
        calls = {
            "train": lambda: wb.train(recipe, progress_bar=False),
            "merge": lambda: wb.merge(recipe.run_dir, f"{out}/merged"),
            "generate": lambda: wb.generate(recipe.run_dir, "Hello", max_new_tokens=2),
            "evaluate": lambda: wb.evaluate(recipe.run_dir, max_new_tokens=2),
            "train (raises)": lambda: wb.train(recipe.override("data.train=no/such.jsonl", "name=bad")),
            "preview_data, two threads at once": lambda: both(lambda: wb.preview_data(recipe, rows=1)),
        }
        for name, call in calls.items():
            before = state()
            try:
                call()
            except wb.WorkbenchError:
                assert name.endswith("(raises)"), name
            after = state()
            changed[name] = sorted(k for k in before if after[k] != before[k])
        print(json.dumps(changed))
    """
    env = {k: v for k, v in os.environ.items() if k not in ("GRADIO_ANALYTICS_ENABLED", "HF_HUB_DISABLE_TELEMETRY")}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    changed = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(changed) == {"train", "merge", "generate", "evaluate", "train (raises)",
                            "preview_data, two threads at once"}
    assert all(not keys for keys in changed.values()), changed


def test_library_notes_are_dropped_at_their_source_and_nothing_else():
    """The notes of libraries the user never asked for (bitsandbytes asking `kernels` for a hub kernel, offline)
    are dropped by a filter on the logger that emits them, while a module loads or a command runs; the same
    loggers' other records, the user's own loggers and warnings, and every note after the call still show."""
    import subprocess
    import sys

    code = """if True:
        import logging, warnings
        from workbench.base.quiet import _harmless_logs_dropped
        kernels = logging.getLogger("kernels._internals.hf_hub")
        with _harmless_logs_dropped():
            import bitsandbytes  # on a CPU with AVX-512 BF16 this logs both notes below when `kernels` is there
            kernels.warning("Skipping publisher trust check for 'kernels-community/x' because offline.")
            logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward: x")
            kernels.warning("another note of kernels")
            logging.getLogger("mine").warning("the user's own log line")
            warnings.warn("the user's own warning")
        kernels.warning("Skipping publisher trust check for 'kernels-community/y' after the call")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernels-community/x" not in done.stderr and "gemm_4bit_forward" not in done.stderr, done.stderr
    for shown in ("another note of kernels", "the user's own log line", "the user's own warning",
                  "kernels-community/y' after the call"):
        assert shown in done.stderr, (shown, done.stderr)
