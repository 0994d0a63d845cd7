"""What each button and field of the UI does: plain functions over the workbench API, tested without a browser.

They return plain values (text, figures, tables, `form.SKIP` for "leave this widget alone"); ui/app.py
wires them to Gradio components. Errors a user can act on come back as a status message, never a traceback.
"""

from __future__ import annotations

import html
import importlib
import json
import math
import os
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pandas as pd

from workbench.base import charts
from workbench.base.errors import RecipeError, WorkbenchError, printable
from workbench.base.metric_names import REWARD_METRIC
from workbench.rundir.runs import COMPARE_COLUMNS, RunDir, compare_rows, load_run
from workbench.spec.objectives import OBJECTIVES
from workbench.spec.strategies import mesh_text

from . import form
from .jobs import objective_of, registry_for, workbench_command
from .workspace import PathError, Workspace

GIB = 2**30
SECTIONS = ["general", *[n for n in form.Recipe.model_fields if n != "name"]]
FALLBACK_DEVICES = ["cpu", "h100", "a100-80gb", "a100-40gb", "l4", "rtx4090"]
THIS_MACHINE = "this machine"
TABLE_HEADERS = {  # compare columns as shown (the CSV keeps the plain names)
    "run": "run", "status": "status", "method": "method", "r": "r", "lr": "lr", "precision": "precision",
    "strategy": "strategy", "world_size": "world size",
    "steps": "steps", "tokens_per_s": "tokens/s", "peak_memory_mb": "peak memory (MB)",
    "predicted_peak_memory_mb": "predicted peak (MB)", "mfu": "MFU (%)", "wall_s": "wall time (s)",
    "final_loss": "final loss", "eval_loss_first": "eval loss (first)", "eval_loss_final": "eval loss (final)",
    "base_eval_loss": "base eval loss", "tuned_eval_loss": "tuned eval loss", "base_contains": "base contains",
    "tuned_contains": "tuned contains", "tuned_exact_match": "tuned exact match",
    "objective": "objective", "reward_margin_final": "reward margin (final)", "reward_final": "reward (final)",
    "generation_share_final": "generation share (final)",
    "reward_accuracy_final": "reward accuracy (final, %)", "eval_reward_margin_final": "eval reward margin (final)",
    "eval_reward_accuracy_final": "eval reward accuracy (final, %)",
}
# preference runs' accuracies, shown as percentages (the CSV keeps the fractions run.json holds)
ACCURACY_COLUMNS = ("reward_accuracy_final", "eval_reward_accuracy_final")


COLUMNS = COMPARE_COLUMNS  # workbench.rundir.runs' own (objective and reward figures included)


def status_html(kind: str, text: str) -> str:
    """A coloured status line: kind is ok, error, info or warn."""
    # run.json, job logs and recipe values are others' text: control characters are shown escaped, not passed on
    body = "<br>".join(html.escape(printable(line)) for line in str(text).splitlines()) or "&nbsp;"
    return f'<div class="wb-status wb-{kind}">{body}</div>'


def error_sections(message: str) -> dict[str, list[str]]:
    """The problems of a RecipeError message (one per line: `recipe: a.b: …`) by top-level section."""
    found: dict[str, list[str]] = {}
    for line in message.splitlines():
        where = line.split(": ", 2)[1] if line.count(": ") >= 2 else ""
        head = where.split(".")[0].strip()
        section = head if head in SECTIONS[1:] else "general"
        found.setdefault(section, []).append(line.removeprefix("recipe: "))
    return found


REPLACE_CONFIRM_S = 60.0  # a second Launch within this time confirms replacing an existing run


class Handlers:
    def __init__(self, root: str | Path, allow_remote_code: bool = False):
        self.ws = Workspace(root)
        self.allow_remote_code = allow_remote_code
        self.jobs = registry_for(self.ws.root, allow_remote_code)
        self._replace_asked: dict[str, float] = {}  # run directory -> when the user was asked to confirm

    def _confirmed(self, what: str) -> bool:
        """Whether replacing `what` was asked for twice within REPLACE_CONFIRM_S; the first ask is remembered."""
        asked = self._replace_asked.pop(what, None)
        if asked is not None and time.time() - asked <= REPLACE_CONFIRM_S:
            return True
        self._replace_asked[what] = time.time()
        return False

    def recipe(self, source: str | dict | form.Recipe) -> form.Recipe:
        """The recipe of YAML text, a mapping or a loaded recipe, validated; PathError unless every file it names
        lies inside the workspace and it runs no model code the server was not started to allow. The one gate
        of every handler that reads a recipe: a handler that skipped it once ran a model's own code."""
        if isinstance(source, str):
            source = form.recipe_from_yaml(source)
        elif isinstance(source, dict):
            source = form.validate(source)
        self.ws.check_recipe_paths(source, self.allow_remote_code)
        return source

    # -- Configure ------------------------------------------------------------------------------

    def check(self, data: dict) -> tuple[str, dict[str, list[str]]]:
        """(status html, {section: problems}) for a recipe mapping, from the CLI's validator."""
        try:
            recipe = self.recipe(data)
        except WorkbenchError as err:
            return status_html("error", str(err)), error_sections(str(err))
        objective = recipe.training.objective_spec
        settings = objective.settings_text(recipe.training.model_dump())
        trains = "" if objective.next_token_loss else f" · {objective.name}" + (f" ({settings})" if settings else "")
        return status_html("ok", f"valid recipe · {recipe.name} · {recipe.adapter.method} on {recipe.model.path}"
                                 f"{trains}"), {}

    def form_changed(self, *values) -> tuple[str, str, dict[str, list[str]]]:
        """Form → YAML: the mapping the form describes, and its validation."""
        data = form.dict_from_widgets(list(values))
        return form.to_yaml(data), *self.check(data)

    def yaml_changed(self, text: str) -> tuple[list, str, dict[str, list[str]]]:
        """YAML → form: widget values (SKIP where a value does not fit its widget) and the validation."""
        try:
            data = form.parse_yaml(text)
        except WorkbenchError as err:
            return [form.SKIP] * len(form.FIELDS), status_html("error", str(err)), error_sections(str(err))
        status, bad = self.check(data)
        try:
            canonical = form.validate(data).to_dict()  # defaults filled in where the YAML leaves keys out
        except WorkbenchError:
            canonical = data
        return form.widgets_from_dict(canonical, fallback=form.default_dict()), status, bad

    def load_recipe(self, relative: str) -> tuple[str, list, str, dict[str, list[str]]]:
        """Load recipes/x.yaml or runs/x/recipe.yaml: (YAML text, widget values, status, bad sections)."""
        try:
            text = self.ws.recipe_file(relative or "").read_text()
        except (WorkbenchError, OSError) as err:
            return form.SKIP, [form.SKIP] * len(form.FIELDS), status_html("error", str(err)), {}
        widgets, status, bad = self.yaml_changed(text)
        if not bad:
            status = status_html("ok", f"loaded {relative}")
        return text, widgets, status, bad

    def save_recipe(self, relative: str, text: str) -> str:
        """Save the YAML as shown, after validation, to a .yaml file inside the workspace."""
        try:
            path = self.ws.saved_recipe_file(relative or "")
            self.recipe(text)
            text = text if text.endswith("\n") else text + "\n"
            where = self.ws.relative(path)
            existing = _read_regular(path, where)  # None: no file there yet
            if existing is not None and existing != text and not self._confirmed(where):
                return status_html("warn", f"{where} exists and differs: press Save again to overwrite it")
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_regular(path, text, where)
        except WorkbenchError as err:
            return status_html("error", f"not saved: {_one_line(err)}")
        except OSError as err:  # a name too long, a file in the way of a folder, a full disk
            return status_html("error", f"not saved: Save as: {relative}: {_os_reason(err)}")
        return status_html("ok", f"saved {where}")

    PREVIEW_MAX_ROWS = 20  # a field of the page: a huge number would render the whole file into the browser
    PREVIEW_TIMEOUT_S = 300.0

    def preview_data(self, text: str, rows, runner=None):
        """(status html, rows html, histogram) of the training data as the model will see it: `workbench data`
        run like a job (the workspace its working folder, a process of its own, a time limit), after the
        recipe's files are checked to lie inside the workspace."""
        from workbench.outputs.preview import DataPreview

        try:
            count = _rows_to_show(rows, self.PREVIEW_MAX_ROWS)
            recipe = self.recipe(text)
            printed = (runner or self._run_preview)(recipe.to_yaml(), count)
            preview = DataPreview.from_json(json.loads(printed))
        except (WorkbenchError, ValueError) as err:
            return status_html("error", str(err)), "", charts.empty("no preview: see the message above")
        stats = preview.stats
        kind = "warn" if stats["lost_answer"] or stats["truncated"] else "ok"
        return status_html(kind, "\n".join(preview.summary_lines())), preview.to_html(summary=False), \
            preview.histogram()

    def _run_preview(self, recipe_yaml: str, rows: int) -> str:
        """`workbench data RECIPE --json` on a copy of the recipe under the UI's folder; its output."""
        folder = self.ws.ui_folder("previews")
        recipe_file = folder / f"{uuid.uuid4().hex}.yaml"
        _write_new(recipe_file, recipe_yaml)
        argv, env = workbench_command(["data", self.ws.relative(recipe_file), "--rows", str(rows), "--json"])
        try:
            done = subprocess.run(argv, cwd=self.ws.root, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=self.PREVIEW_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise WorkbenchError(f"the data preview took more than {self.PREVIEW_TIMEOUT_S:.0f} s and was stopped "
                                 "(is a data file a pipe, or very large?)") from None
        finally:
            recipe_file.unlink(missing_ok=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
            raise WorkbenchError((errors[-1].removeprefix("error: ") if errors else
                                  (done.stderr.strip().splitlines() or ["the data preview failed"])[-1]))
        return done.stdout

    # -- Estimate -------------------------------------------------------------------------------

    @staticmethod
    def device_choices() -> list[str]:
        """THIS_MACHINE (the device a run here would use), cpu, then the estimator's presets."""
        try:
            from workbench.hardware.catalogue import PRESETS
        except ImportError:
            return [THIS_MACHINE, *FALLBACK_DEVICES]
        return [THIS_MACHINE, "cpu", *PRESETS]

    def estimate(self, text: str, world_size: float, nodes: float, device: str | None,
                 device_memory_gib: float | None, price: float | None, estimator=None):
        """(figure, summary html, strategies table) from workbench.estimator.memory.estimate."""
        try:
            recipe = self.ws.local_recipe(self.recipe(text))  # read here: the files the checks looked at
            if estimator is None:
                from workbench.estimator.memory import estimate as estimator
            memory = int(device_memory_gib * GIB) if device_memory_gib else None
            result = estimator(recipe, world_size=int(world_size or 1), nodes=int(nodes or 1),
                               device=None if device in (None, "", THIS_MACHINE) else device,
                               device_memory=memory, price_per_gpu_hour=price or None)
        except ImportError:
            message = "the memory estimator (workbench.estimator.memory) is not installed in this version"
            return charts.empty(message), status_html("warn", message), pd.DataFrame()
        except (WorkbenchError, ValueError) as err:
            return charts.empty("no estimate: see the message above"), status_html("error", str(err)), pd.DataFrame()
        data = result.to_json() if hasattr(result, "to_json") else dict(result)
        capacity = memory or _device_bytes(data)
        dev = data.get("device") if isinstance(data.get("device"), dict) else {}
        label = dev.get("name") or device or "device"
        fig = charts.memory_breakdown(data.get("strategies", []), data.get("recommended"), capacity, label)
        table = pd.DataFrame([{
            "strategy": s["name"], "mesh": mesh_text(s.get("mesh") or {}),
            "per device (GiB)": round(s.get("per_device_bytes", 0) / GIB, 3),
            # what runs of this kind of layout measured against the estimate (workbench/estimator/calibration.py)
            "measured range (GiB)": "–".join(f"{b / GIB:.2f}" for b in s.get("per_device_range") or []) or None,
            "CPU RAM (GiB)": round((s.get("cpu_bytes") or 0) / GIB, 3), "fits": "yes" if s.get("fits") else "no",
            **{f"{k} (GiB)": round((v or 0) / GIB, 3) for k, v in (s.get("breakdown") or {}).items()},
            "max micro-batch": (s.get("limits") or {}).get("micro_batch_size"),
            "max seq len": (s.get("limits") or {}).get("max_seq_len"),
            "max seq len (high end)": (s.get("limits_cautious") or {}).get("max_seq_len"),
        } for s in data.get("strategies", [])])
        return fig, status_html("ok" if data.get("recommended") not in (None, "none") else "warn",
                                "\n".join(_estimate_lines(data, capacity))), table

    # -- Train ----------------------------------------------------------------------------------

    def launch(self, text: str, nproc: float, replace: bool = False) -> tuple[str | None, str]:
        """(job name, status html): validate the YAML and start the CLI in a subprocess. A run directory that
        already holds a run is replaced only with `replace` ticked and a second Launch to confirm."""
        try:
            recipe = self.recipe(text)
            run_path = self.ws.resolve(str(recipe.run_dir), what="output.dir")
            job = self.jobs.status(recipe.name)
            if job is not None and job.state in ("running", "stopping"):
                return None, status_html("error", f"not launched: job {recipe.name} is still running: stop it first")
            existing = run_path.is_dir() and any(run_path.iterdir())
            where = self.ws.relative(run_path)
            if existing and not replace:
                return None, status_html("error", f"not launched: {where} already holds a run ({_run_line(run_path)}); "
                                                  "tick 'replace the existing run' to delete it and start again, "
                                                  "or give the recipe another name")
            if existing and not self._confirmed(where):
                return None, status_html("warn", f"{where} holds a run ({_run_line(run_path)}) that will be "
                                                 "DELETED: press Launch again to confirm")
            job = self.jobs.start(recipe, nproc=1 if nproc is None else int(nproc), replace=existing)
        except WorkbenchError as err:
            return None, status_html("error", f"not launched: {err}")
        return job.name, status_html("info", f"launched {job.name}: workbench {' '.join(job.command)}")

    def stop(self, name: str | None) -> str:
        if not name:
            return status_html("warn", "no job selected")
        return status_html("info", self.jobs.stop(name))

    def resume(self, name: str | None) -> str:
        if not name:
            return status_html("warn", "no job selected")
        try:
            job = self.jobs.resume(name)
        except WorkbenchError as err:
            return status_html("error", f"not resumed: {err}")
        return status_html("info", f"resumed {job.name}: workbench {' '.join(job.command)}")

    def buttons(self, name: str | None) -> tuple[bool, bool]:
        """(Stop enabled, Resume enabled) for the job's state: Stop while it runs, Resume once it stopped
        short of its end."""
        status = self.jobs.status(name) if name else None
        if status is None:
            return False, False
        running = status.state in ("running", "stopping")
        return running, status.state in ("interrupted", "failed", "exited", "died")

    def job_view(self, name: str | None, seen: str | None = None):
        """(status html, progress html, log tail, loss figure, tokens/s figure, preference figure, signature) of
        a job.

        The preference figure (reward margin and accuracy over the steps) is drawn for a preference run
        (training.objective dpo/orpo/kto) and is None for any other, which the page hides. The figures are SKIP
        when the metrics have not changed since `seen`.
        """
        status = self.jobs.status(name) if name else None
        if status is None:
            idle = charts.empty("no job yet: launch one") if seen != "none" else form.SKIP
            return (status_html("info", "no job selected"), _progress(0, None), "", idle, idle,
                    None if seen != "none" else form.SKIP, "none")
        signature = f"{name}:{status.state}:{len(status.metrics)}"
        figures = (form.SKIP, form.SKIP, form.SKIP)
        preference = OBJECTIVES[status.objective].logs_rewards or charts.is_preference(status.metrics)
        rewarded = OBJECTIVES[status.objective].samples_answers or charts.is_rewarded(status.metrics)
        if signature != seen:
            series = {name: status.metrics}
            third = (charts.preference_chart(status.metrics, title=f"Reward margin and accuracy ({status.objective})")
                     if preference else charts.reward_chart(status.metrics, title=f"Reward and answer length "
                                                                                  f"({status.objective})")
                     if rewarded else None)
            figures = (charts.curves(series, "loss", "Loss", "loss", eval_key="eval_loss"),
                       charts.curves(series, "tokens_per_s", "Throughput", "tokens/s"), third)
        rows = [r for r in status.metrics if _finite(r.get("tokens_per_s")) is not None]
        facts = [f"{name}", status.state, f"step {status.steps} / {status.total_steps or '?'}"]
        if rows:
            facts.append(f"{rows[-1]['tokens_per_s']:,.0f} tokens/s")
        if preference:
            facts += _preference_facts(status.metrics)
        elif rewarded and _last(status.metrics, REWARD_METRIC) is not None:
            facts.append(f"reward {_last(status.metrics, REWARD_METRIC):.3f}")
        if status.summary.get("wall_s") is not None:
            facts.append(f"wall {status.summary['wall_s']:.1f} s")
        if status.pid:
            facts.append(f"pid {status.pid}")
        if status.state == "failed" and status.summary.get("error"):
            facts.append(status.summary["error"])
        kind = {"completed": "ok", "failed": "error", "exited": "error", "interrupted": "warn"}.get(status.state, "info")
        return (status_html(kind, " · ".join(facts)), _progress(status.steps, status.total_steps),
                self.jobs.log_tail(name), *figures, signature)

    # -- Compare --------------------------------------------------------------------------------

    def compare_rows(self, names: list[str] | None) -> tuple[list[dict], dict[str, list[dict]]]:
        """workbench.rundir.runs' compare rows, each with the run's objective and (preference runs) reward figures."""
        runs = [load_run(self.ws.run_dir(n)) for n in names or []]
        # a run still training has no final figures in run.json yet: its last logged ones stand in
        rows = [{**row, **{k: v for k, v in logged_preference_figures(run).items() if _finite(row.get(k)) is None}}
                for run, row in zip(runs, compare_rows(runs))]
        return rows, {r.name: r.metrics for r in runs}

    def compare(self, names: list[str] | None):
        """(table, memory figure, throughput figure, loss figure, status html) for the chosen runs."""
        try:
            rows, series = self.compare_rows(names)
        except WorkbenchError as err:
            blank = charts.empty("choose runs")
            return pd.DataFrame(), blank, blank, blank, status_html("error", str(err))
        if not rows:
            blank = charts.empty("choose one or more runs")
            return pd.DataFrame(columns=[TABLE_HEADERS[c] for c in COLUMNS]), blank, blank, blank, status_html(
                "info", "choose one or more runs")
        memory, speed, losses = charts.compare_axes(rows, series)  # the figures of workbench.plot_compare
        return display_table(rows), memory, speed, losses, status_html("ok", f"{len(rows)} run(s) compared")

    def export_csv(self, names: list[str] | None) -> tuple[str | None, str]:
        """(path of a CSV under <root>/.workbench-ui/exports, status html) with the plain compare columns."""
        try:
            rows, _ = self.compare_rows(names)
        except WorkbenchError as err:
            return None, status_html("error", str(err))
        if not rows:
            return None, status_html("warn", "choose runs to export")
        try:
            folder = self.ws.ui_folder("exports")
            path = folder / f"compare-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}.csv"
            _write_new(path, pd.DataFrame(rows, columns=COLUMNS).to_csv(index=False))
        except (WorkbenchError, OSError) as err:
            return None, status_html("error", f"not exported: {_one_line(err)}")
        return str(path), status_html("ok", f"exported {len(rows)} run(s) to {self.ws.relative(path)}")

    # -- Chat -----------------------------------------------------------------------------------

    def chat(self, name: str | None, prompt: str, max_new_tokens: float = 64) -> tuple[str, str, str]:
        """(base answer, tuned answer, status html) for the same prompt."""
        if not name or not (prompt or "").strip():
            return "", "", status_html("warn", "choose a run and write a prompt")
        from workbench.spec.recipe import Recipe

        inference = importlib.import_module("workbench.model.inference")

        try:
            run_dir = self.ws.run_dir(name)
            # it names the model to load: checked, then loaded as checked (schema-read, paths in the workspace)
            recipe = self.ws.local_recipe(self.recipe(Recipe.load(run_dir / "recipe.yaml")))
            tokens = int(max_new_tokens or 64)
            base = inference.generate(run_dir, prompt, base=True, max_new_tokens=tokens, recipe=recipe)
            tuned = inference.generate(run_dir, prompt, base=False, max_new_tokens=tokens, recipe=recipe)
        except (WorkbenchError, OSError, ValueError) as err:  # e.g. a run without an adapter, a missing model
            return "", "", status_html("error", _one_line(err))
        except Exception as err:  # a model or adapter the libraries cannot load: a message, not a crash
            return "", "", status_html("error", f"{name}: the model could not be loaded or run "
                                                f"({type(err).__name__}: {_one_line(err)})")
        if not tuned.strip():
            return base, tuned, status_html("warn", f"{name}'s tuned model answered with nothing (it stopped at once)")
        return base, tuned, status_html("ok", f"answered with {name}'s base model and its adapter")


def _os_reason(err: OSError) -> str:
    return "the name is too long" if err.errno == 36 else (err.strerror or str(err)).lower()


def _not_regular(mode: int, where: str) -> PathError:
    kind = "a folder" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode) else \
        "a pipe" if stat.S_ISFIFO(mode) else "not a regular file"
    return PathError(f"Save as: {where} is {kind}, not a recipe file; refused")


def _read_regular(path: Path, where: str) -> str | None:
    """The text of a regular file at `path` (None when nothing is there); a folder, link, pipe or device is refused
    before it is opened (a pipe would block the server)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(mode):
        raise _not_regular(mode, where)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):  # swapped in between
            raise _not_regular(os.fstat(handle.fileno()).st_mode, where)
        return handle.read().decode("utf-8", errors="replace")


def _write_regular(path: Path, text: str, where: str) -> None:
    """Write `text` to a new or regular file, never through a link, into a pipe or onto a device."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    with os.fdopen(fd, "wb") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(mode, where)
        handle.truncate(0)
        handle.write(text.encode("utf-8"))


def _write_new(path: Path, text: str) -> None:
    """Write a file the UI names itself, never through a link or into a file that is already there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)


def _one_line(err: BaseException, most: int = 400) -> str:
    """An exception's message, first line only and cut short (a library's may list hundreds of names)."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return text if len(text) <= most else text[:most] + "…"


def _rows_to_show(value, most: int) -> int:
    """The Data preview's "rows to show" field: a whole number from 0 to `most`."""
    try:
        number = float(value if value is not None else 3)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number.is_integer() and 0 <= number <= most) or isinstance(value, bool):
        raise RecipeError(f"rows to show: a whole number from 0 to {most}, got {value!r}")
    return int(number)


def _run_line(run_path: Path) -> str:
    try:
        summary = RunDir(run_path).read_json().get("summary", {})
    except WorkbenchError:
        return "unreadable run.json"
    return f"{summary.get('status', '?')}, {summary.get('steps', 0) or 0} steps"


def display_table(rows: list[dict]) -> pd.DataFrame:
    """The compare rows with readable headers, units and rounding (MFU and reward accuracies in percent)."""
    frame = pd.DataFrame(rows, columns=COLUMNS)
    for col in COLUMNS:  # text read from each run's run.json and recipe.yaml: control characters shown escaped
        frame[col] = frame[col].map(lambda v: printable(v) if isinstance(v, str) else v)
    frame["mfu"] = frame["mfu"].map(lambda v: None if v is None or pd.isna(v) else round(100 * v, 2))
    for col in ("tokens_per_s", "peak_memory_mb", "predicted_peak_memory_mb", "wall_s"):
        frame[col] = frame[col].map(lambda v: None if v is None or pd.isna(v) else round(float(v), 1))
    for col in ("final_loss", "eval_loss_first", "eval_loss_final", "reward_margin_final", "eval_reward_margin_final"):
        frame[col] = frame[col].map(lambda v: None if _finite(v) is None else round(float(v), 4))
    for col in ACCURACY_COLUMNS:
        frame[col] = frame[col].map(lambda v: None if _finite(v) is None else round(100 * float(v), 1))
    return frame.rename(columns=TABLE_HEADERS)


def _finite(value) -> float | None:
    """A finite number as a float, None for anything else (a missing figure, NaN, text in a hand-edited file)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _last(rows: list[dict], key: str) -> float | None:
    """The last finite value of `key` in metrics rows."""
    for row in reversed(rows):
        value = _finite(row.get(key)) if isinstance(row, dict) else None
        if value is not None:
            return value
    return None


def logged_preference_figures(run) -> dict:
    """A preference run's last logged reward margin and accuracy (train and eval), for the compare columns that
    run.json's summary does not hold yet (a run still training) or holds in an unreadable form. {} for SFT."""
    if not OBJECTIVES[objective_of(run.summary, run.recipe)].logs_rewards and not charts.is_preference(run.metrics):
        return {}
    return {f"{key}_final": _last(run.metrics, key)
            for key in ("reward_margin", "reward_accuracy", "eval_reward_margin", "eval_reward_accuracy")}


def _preference_facts(rows: list[dict]) -> list[str]:
    """The latest reward margin and accuracy of a preference run, for the job's status line."""
    margin, accuracy = _last(rows, "reward_margin"), _last(rows, "reward_accuracy")
    facts = []
    if margin is not None:
        facts.append(f"reward margin {margin:.3f}")
    if accuracy is not None:
        facts.append(f"reward accuracy {100 * accuracy:.0f}%")
    return facts


def _estimate_lines(data: dict, capacity: float | None) -> list[str]:
    """The estimate's verdict, model size, throughput/cost and notes, one line each."""
    lines = [f"Recommended strategy: {data.get('recommended') or 'none'}"]
    model = data.get("model") or {}
    if model:
        lines.append(f"model: {model.get('params', 0) / 1e6:,.1f} M parameters, "
                     f"{model.get('trainable_params', 0) / 1e6:,.2f} M trainable")
    dev = data.get("device") if isinstance(data.get("device"), dict) else {}
    if capacity:
        count = f"{dev['count']} × " if dev.get("count") else ""
        lines.append(f"device: {count}{dev.get('name', 'device')} with {capacity / GIB:,.1f} GiB each")
    t = data.get("throughput") or {}
    if t.get("tokens_per_s"):
        line = f"predicted throughput: ~{t['tokens_per_s']:,.0f} tokens/s"
        if t.get("epoch_hours") is not None:
            line += f"; one epoch ≈ {_duration(t['epoch_hours'])} ({_duration(t.get('gpu_hours') or 0)} of device time)"
        if t.get("cost") is not None:
            line += f", ≈ ${t['cost']:,.2f}" if t["cost"] >= 0.01 else ", < $0.01"
        lines.append(line)
    chosen = next((s for s in data.get("strategies") or [] if s.get("name") == data.get("recommended")), None)
    if chosen and chosen.get("spread"):
        spread, (low, high) = chosen["spread"], chosen["per_device_range"]
        lines.append(f"uncertainty: measured peaks of {chosen['name']} runs have been {spread['low']:.2f}–"
                     f"{spread['high']:.2f} × the estimate ({low / GIB:,.1f}–{high / GIB:,.1f} GiB here; "
                     f"{spread['runs']})")
    lines += [f"• {note}" for note in data.get("notes") or []]
    return lines


def _duration(hours: float) -> str:
    seconds = hours * 3600
    return f"{hours:,.1f} h" if hours >= 1 else f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _device_bytes(data: dict) -> float | None:
    """The device memory an estimate was made for, wherever the estimate's JSON keeps it."""
    device = data.get("device")
    if isinstance(device, dict):
        for key in ("memory_bytes", "memory", "device_memory_bytes"):
            if isinstance(device.get(key), (int, float)):
                return float(device[key])
    for key in ("device_memory_bytes", "device_memory"):
        if isinstance(data.get(key), (int, float)):
            return float(data[key])
    return None


def _progress(done: int, total: int | None) -> str:
    fraction = min(1.0, done / total) if total else 0.0
    label = f"{done} / {total} steps" if total else f"{done} steps"
    return (f'<div class="wb-progress"><div class="wb-progress-bar" style="width:{100 * fraction:.1f}%"></div>'
            f'<span>{html.escape(label)}</span></div>')
