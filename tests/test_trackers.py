"""output.trackers: TensorBoard, W&B (offline) and MLflow (a file store) each get what the run itself records:
metrics.jsonl's rows, the recipe as config, run.json's summary. Each is read back with the tracker's own reader."""

import json
import math
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from workbench import RecipeError, WorkbenchError, train
from workbench.base.metrics import read_metrics
from workbench.distributed.trackers import check_tracker_packages, prepare_trackers, summary_figures
from workbench.frontends.cli import main
from workbench.training.parts import _flat
from workbench.training.preflight import preflight

RESOLVED_BY_THE_RUN = {"model.attn", "distributed.strategy"}  # `auto` in the recipe, concrete in the run's config


@dataclass
class Readback:
    """What a tracker holds for one run: metric name -> {step: value}, the config, and summary/<key> -> value."""

    metrics: dict = field(default_factory=lambda: defaultdict(dict))
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


def _train_with(tracker: str, tiny_recipe):
    """A few steps, a metrics row each, evaluations at steps 0, 2 and 3: the result and the recipe it ran."""
    recipe = tiny_recipe.override("training.max_steps=3", "output.eval_every=2", f"output.trackers=[{tracker}]")
    return train(recipe, progress_bar=False), recipe


def _unset(monkeypatch, *names):
    for name in names:  # set first, so the test's end puts back "unset" too
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _same(found, expected) -> bool:
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        return math.isclose(float(found), expected, rel_tol=1e-6)  # TensorBoard keeps float32, MLflow params text
    return found == expected or str(found) == str(expected)  # True: 1.0 as a metric, "True" as a param


def assert_holds_the_run(back: Readback, result, recipe):
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    logged = defaultdict(dict)
    for row in rows:
        for name, value in row.items():
            if name != "step" and value is not None:
                logged[name][row["step"]] = value
    assert set(logged) >= {"loss", "eval_loss", "lr", "tokens_per_s"} and sorted(logged["eval_loss"]) == [0, 2, 3]
    assert set(back.metrics) == set(logged)
    for name, by_step in logged.items():
        assert back.metrics[name].keys() == by_step.keys(), name
        assert all(_same(back.metrics[name][step], value) for step, value in by_step.items()), name

    expected_config = _flat(recipe.to_dict())
    assert back.config.keys() == expected_config.keys()
    differ = {k for k, v in expected_config.items() if not _same(back.config[k], v)}
    assert differ <= RESOLVED_BY_THE_RUN, {k: (back.config[k], expected_config[k]) for k in differ}

    summary = json.loads((result.run_dir / "run.json").read_text())["summary"]
    figures = summary_figures(summary)
    assert {"summary/tokens_per_s", "summary/peak_memory_mb", "summary/mfu", "summary/final_loss",
            "summary/eval_loss_final", "summary/status"} <= figures.keys()
    assert back.summary.keys() == figures.keys()
    assert all(_same(back.summary[k], v) for k, v in figures.items()), {
        k: (back.summary[k], v) for k, v in figures.items() if not _same(back.summary[k], v)}


# -- TensorBoard --------------------------------------------------------------------------------------


def read_tensorboard(folder: Path) -> Readback:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
    from tensorboard.util.tensor_util import make_ndarray

    back = Readback()
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            values = {e.step: e.value for e in accumulator.Scalars(tag)}
            if tag.startswith("summary/"):
                (back.summary[tag],) = values.values()
            else:
                back.metrics[tag] = values
        for tag in accumulator.Tags()["tensors"]:  # words are text summaries
            (event,) = accumulator.Tensors(tag)
            back.summary[tag.removesuffix("/text_summary")] = make_ndarray(event.tensor_proto).item().decode()
        try:  # the config: a file of its own, beside the metrics
            content = accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        except KeyError:
            continue
        for name, value in HParamsPluginData.FromString(content).session_start_info.hparams.items():
            back.config[name] = getattr(value, value.WhichOneof("kind"))
    return back


@pytest.mark.slow
def test_tensorboard_holds_the_runs_metrics_config_and_summary(tiny_recipe):
    result, recipe = _train_with("tensorboard", tiny_recipe)
    assert list((result.run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert_holds_the_run(read_tensorboard(result.run_dir / "tensorboard"), result, recipe)


# -- W&B, offline ---------------------------------------------------------------------------------------

LOG_BLOCK, LOG_HEADER, FILE_HEADER = 32768, 7, 7  # LevelDB's log format, after W&B's ":W&B" file header
FULL, LAST = 1, 4


def wandb_records(path: Path):
    """The protobuf records of W&B's offline run file (the Python SDK no longer ships a reader for it): LevelDB
    log chunks (crc32c, length, type) in 32 KiB blocks, a record split over blocks in FIRST/MIDDLE/LAST chunks."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending = FILE_HEADER, b""
    while position + LOG_HEADER <= len(data):
        room = LOG_BLOCK - position % LOG_BLOCK
        if room < LOG_HEADER:  # a block's tail too short for a chunk header is padding
            position += room
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        if kind == 0:  # zeros: the end of what was written
            break
        pending += data[position + LOG_HEADER:position + LOG_HEADER + length]
        position += LOG_HEADER + length
        if kind in (FULL, LAST):
            yield Record.FromString(pending)
            pending = b""


def _wandb_key(item) -> str:
    return item.key or ".".join(item.nested_key)  # a name W&B might have read as nested comes as its parts


def read_wandb(folder: Path) -> Readback:
    (log,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    back = Readback()
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            for item in record.history.item:
                back.metrics[_wandb_key(item)][record.history.step.num] = json.loads(item.value_json)
        elif kind in ("config", "run"):
            for item in (record.config if kind == "config" else record.run.config).update:
                back.config[_wandb_key(item)] = json.loads(item.value_json)
        elif kind == "summary":
            back.summary.update({_wandb_key(i): json.loads(i.value_json) for i in record.summary.update
                                 if _wandb_key(i).startswith("summary/")})
    back.metrics = defaultdict(dict, {k: v for k, v in back.metrics.items() if not k.startswith("_")})
    back.config = {k: v for k, v in back.config.items() if not k.startswith("_")}  # W&B's own entries
    return back


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B with no network, no prompt, and every file of its own under tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    _unset(monkeypatch, "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME")


@pytest.mark.slow
def test_wandb_offline_holds_the_runs_metrics_config_and_summary(tiny_recipe, wandb_offline):
    result, recipe = _train_with("wandb", tiny_recipe)
    assert_holds_the_run(read_wandb(result.run_dir), result, recipe)  # in <run>/wandb: WANDB_DIR is unset


# -- MLflow, a file store -----------------------------------------------------------------------------------


def read_mlflow(tracking_uri: str, experiment: str) -> Readback:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    back = Readback(config=dict(run.data.params))
    for key in run.data.metrics:
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        if key.startswith("summary/"):
            (back.summary[key],) = history.values()
        else:
            back.metrics[key] = history
    back.summary.update({k: v for k, v in run.data.tags.items() if k.startswith("summary/")})
    return back


@pytest.mark.slow
def test_mlflow_holds_the_runs_metrics_config_and_summary(tiny_recipe, monkeypatch):
    _unset(monkeypatch, "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS")
    result, recipe = _train_with("mlflow", tiny_recipe)
    store = result.run_dir / "mlruns"
    assert store.is_dir()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when asked
    assert_holds_the_run(read_mlflow(store.resolve().as_uri(), "tiny"), result, recipe)


# -- where the files go, and a missing package ----------------------------------------------------------


def test_tracker_files_go_in_the_run_directory_unless_the_environment_says_otherwise(tmp_path, monkeypatch):
    _unset(monkeypatch, "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE")
    assert prepare_trackers(["tensorboard"], tmp_path) == {} and "MLFLOW_TRACKING_URI" not in os.environ
    assert prepare_trackers(["wandb", "mlflow"], tmp_path) == {"wandb": {"dir": str(tmp_path)}}
    assert os.environ["MLFLOW_TRACKING_URI"] == (tmp_path.resolve() / "mlruns").as_uri()
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///" + str(tmp_path / "mlflow.db"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    assert prepare_trackers(["wandb", "mlflow"], tmp_path) == {}
    assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:///" + str(tmp_path / "mlflow.db")
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "false"


def test_a_tracker_without_its_package_stops_the_run_before_it_starts(tiny_recipe, tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, as where it is not installed
    recipe = tiny_recipe.override("output.trackers=[tensorboard,wandb]")
    message = 'output.trackers: wandb needs the wandb package: pip install "lora-workbench[wandb]"'
    with pytest.raises(RecipeError) as err:
        train(recipe, progress_bar=False)
    assert str(err.value) == message
    assert not recipe.run_dir.exists()  # nothing written
    recipe.save(tmp_path / "r.yaml")
    assert main(["train", str(tmp_path / "r.yaml"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert not recipe.run_dir.exists()


def test_every_missing_tracker_package_is_named_in_one_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RecipeError, match=r'^output.trackers: mlflow needs the mlflow package: pip install '
                                          r'"lora-workbench\[mlflow\]"; wandb needs .*\[wandb\]"$'):
        check_tracker_packages(["mlflow", "tensorboard", "wandb", "mlflow"])


# -- a tracking server that hangs, a stop signal while it does ----------------------------------------------

ENV_FOR_A_SUBPROCESS = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                        "OMP_NUM_THREADS": "1"}


def _mlflow_at(monkeypatch, url: str, timeout_s: str | None = None):
    _unset(monkeypatch, "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS", "MLFLOW_HTTP_REQUEST_TIMEOUT",
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    if timeout_s is not None:
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", timeout_s)


def test_every_mlflow_request_of_a_run_has_a_time_limit_unless_the_user_set_one(tmp_path, monkeypatch):
    from workbench.distributed.trackers import MLFLOW_REQUEST_RETRIES, MLFLOW_REQUEST_TIMEOUT_S

    _mlflow_at(monkeypatch, "http://127.0.0.1:9")
    prepare_trackers(["mlflow"], tmp_path)
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == str(MLFLOW_REQUEST_TIMEOUT_S)
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == str(MLFLOW_REQUEST_RETRIES)
    assert MLFLOW_REQUEST_TIMEOUT_S * (MLFLOW_REQUEST_RETRIES + 1) <= 60  # MLflow's own: 120 s, 7 retries
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "300")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
    prepare_trackers(["mlflow"], tmp_path)
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "300" and os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "7"


def test_an_mlflow_server_that_never_answers_stops_the_run_before_the_model_loads(tiny_recipe, tmp_path,
                                                                                  monkeypatch, capsys):
    from silent_server import SilentServer

    recipe = tiny_recipe.override("output.trackers=[mlflow]")
    recipe.save(tmp_path / "r.yaml")
    with SilentServer() as server:
        _mlflow_at(monkeypatch, server.url, timeout_s="1")
        message = (f"output.trackers: mlflow: the tracking server MLFLOW_TRACKING_URI={server.url} did not answer "
                   "within 1 s")
        started = time.monotonic()
        with pytest.raises(RecipeError, match="^" + re.escape(message)):
            train(recipe, progress_bar=False)
        assert time.monotonic() - started < 20
        assert not recipe.run_dir.exists()
        assert main(["validate", str(tmp_path / "r.yaml"), "--preflight"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {message}")


def test_an_mlflow_server_that_refuses_the_run_is_one_line_naming_it(tiny_recipe, monkeypatch):
    from silent_server import SilentServer

    recipe = tiny_recipe.override("output.trackers=[mlflow]")
    with SilentServer(health=True, status=404) as server:
        _mlflow_at(monkeypatch, server.url)
        with pytest.raises(WorkbenchError) as failed:
            train(recipe, progress_bar=False)
    message = str(failed.value)
    assert message.startswith(f"output.trackers: mlflow did not start (MLFLOW_TRACKING_URI={server.url}): ")
    assert "\n" not in message and "404" in message
    summary = json.loads((recipe.run_dir / "run.json").read_text())["summary"]
    assert summary["status"] == "failed" and summary["error"].endswith(message)


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_an_mlflow_server_hangs_ends_the_run_as_interrupted(tiny_recipe, tmp_path, signame):
    """The reported case: the server answers its health probe, then holds the run's first request. SIGTERM or one
    Ctrl-C ends the command at once (before: both ignored until MLflow gave up, minutes later), run.json saying
    why."""
    import signal
    import subprocess

    from silent_server import SilentServer

    signum = getattr(signal, signame)
    recipe = tiny_recipe.override("output.trackers=[mlflow]")
    recipe.save(tmp_path / "r.yaml")
    with SilentServer(health=True, hold_s=90) as server:
        env = {**os.environ, **ENV_FOR_A_SUBPROCESS, "MLFLOW_TRACKING_URI": server.url,
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "60", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
        for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS"):
            env.pop(name, None)
        proc = subprocess.Popen([sys.executable, "-m", "workbench", "train", str(tmp_path / "r.yaml"),
                                 "--no-progress"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert server.holding.wait(timeout=240), "the run never reached the tracking server"
            proc.send_signal(signum)
            sent = time.monotonic()
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert time.monotonic() - sent < 15
    assert proc.returncode == 128 + signum, err
    last = err.strip().splitlines()[-1]
    assert last == f"interrupted by {signame} while starting output.trackers (mlflow: MLFLOW_TRACKING_URI={server.url})"
    assert "Traceback" not in err
    summary = json.loads((recipe.run_dir / "run.json").read_text())["summary"]
    assert summary["status"] == "interrupted" and summary["error"] == f"Interrupted: {last}"


class _Tracker:
    def __init__(self, name, log):
        self.name, self._log, self.tracker = name, log, object()

    def log(self, values, step):
        self._log(values, step)


def test_a_tracker_that_fails_or_hangs_mid_run_is_left_out_and_the_run_goes_on(monkeypatch):
    """Mid-run, a tracker whose server went away (each request has a time limit) or that is still waiting when a
    stop signal comes is dropped with a warning; the others still get every row, the signal stays for the loop."""
    import signal
    import types

    from workbench.distributed.stopping import StopRequest
    from workbench.distributed.trackers import log_to_trackers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    seen = []

    def gone(values, step):
        raise ConnectionError("API request to /api/2.0/mlflow/runs/log-batch failed: read timed out\nmore")

    def hangs(values, step):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    healthy = _Tracker("tensorboard", lambda values, step: seen.append(step))
    accelerator = types.SimpleNamespace(trackers=[_Tracker("mlflow", gone), healthy])
    with pytest.warns(UserWarning, match=r"^output.trackers: mlflow is left out from here on \(MLFLOW_TRACKING_URI="
                                         r"http://127.0.0.1:9\): API request .* read timed out; metrics.jsonl"):
        log_to_trackers(accelerator, {"loss": 1.0}, 1)
    assert accelerator.trackers == [healthy] and seen == [1]

    accelerator.trackers.insert(0, _Tracker("wandb", hangs))
    with StopRequest() as stop:
        started = time.monotonic()
        with pytest.warns(UserWarning, match=r"wandb is left out .*: interrupted by SIGTERM while logging step 2 to "
                                             r"wandb;"):
            log_to_trackers(accelerator, {"loss": 0.5}, 2)
        assert time.monotonic() - started < 10
        assert stop.signum == signal.SIGTERM  # the loop stops at the step's end, as after any signal
        log_to_trackers(accelerator, {"loss": 0.4}, 3)  # a signal received earlier drops nothing
    assert accelerator.trackers == [healthy] and seen == [1, 2, 3]


# -- W&B without a login --------------------------------------------------------------------------------------


@pytest.fixture
def wandb_logged_out(tmp_path, monkeypatch):
    """W&B online (no WANDB_MODE) with no key anywhere it looks: not in the environment, a netrc or its settings."""
    _unset(monkeypatch, "WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DIR", "WANDB_BASE_URL",
           "WANDB_DISABLED", "WANDB_RUN_ID", "WANDB_RESUME")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    wandb.teardown()  # W&B keeps the settings it first read (an earlier test's WANDB_MODE=offline) per process
    yield
    wandb.teardown()


WANDB_LOGIN = ("output.trackers: wandb is online (WANDB_MODE is not set) and has no API key: run `wandb login`, "
               "set WANDB_API_KEY, or set WANDB_MODE=offline")


def test_wandb_without_a_login_is_refused_by_the_preflight(tiny_recipe, tmp_path, wandb_logged_out, monkeypatch,
                                                            capsys):
    recipe = tiny_recipe.override("output.trackers=[wandb]")
    with pytest.raises(RecipeError, match="^" + re.escape(WANDB_LOGIN)):
        train(recipe, progress_bar=False)
    assert not recipe.run_dir.exists()
    recipe.save(tmp_path / "r.yaml")
    assert main(["validate", str(tmp_path / "r.yaml"), "--preflight"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {WANDB_LOGIN}")

    monkeypatch.setenv("WANDB_MODE", "offline")
    assert preflight(recipe) == []
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert preflight(recipe) == []
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(RecipeError, match=r"wandb is online \(WANDB_MODE=online\) and has no API key"):
        preflight(recipe)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert preflight(recipe) == []


def test_a_tracker_that_fails_to_start_is_one_error_not_two_tracebacks(tiny_recipe, wandb_logged_out,
                                                                       monkeypatch):
    """Were the preflight to miss it: W&B's own refusal, in one line, and no second error on the way out."""
    monkeypatch.setattr("workbench.distributed.trackers.wandb_login_problem", lambda: None)
    recipe = tiny_recipe.override("output.trackers=[wandb]")
    with pytest.raises(WorkbenchError) as failed:
        train(recipe, progress_bar=False)
    message = str(failed.value)
    assert message.startswith("output.trackers: wandb did not start") and "wandb login" in message
    assert "\n" not in message  # and no AttributeError from ending a tracker that never started
    assert json.loads((recipe.run_dir / "run.json").read_text())["summary"]["status"] == "failed"


# -- MLflow at a folder, and its other settings --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("as_uri", [False, True], ids=["folder", "file-uri"])
def test_mlflow_at_a_folder_of_the_users_choice_holds_the_run(tiny_recipe, tmp_path, monkeypatch, as_uri):
    store = tmp_path / "my-store"
    _mlflow_at(monkeypatch, store.as_uri() if as_uri else str(store))
    result, recipe = _train_with("mlflow", tiny_recipe)
    assert not (result.run_dir / "mlruns").exists() and store.is_dir()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert_holds_the_run(read_mlflow(store.as_uri(), "tiny"), result, recipe)


def test_mlflow_settings_that_cannot_work_are_refused_by_the_preflight(tiny_recipe, tmp_path, monkeypatch):
    recipe = tiny_recipe.override("output.trackers=[mlflow]")
    _mlflow_at(monkeypatch, str(tmp_path / "store"))
    assert preflight(recipe) == []

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "")
    with pytest.raises(RecipeError, match=r"^output.trackers: mlflow: MLFLOW_EXPERIMENT_NAME is set but empty"):
        preflight(recipe)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mine")
    assert preflight(recipe) == []

    monkeypatch.setenv("MLFLOW_TAGS", "team=nlp")
    with pytest.raises(RecipeError, match=r"^output.trackers: mlflow: MLFLOW_TAGS must be a JSON object"):
        preflight(recipe)
    monkeypatch.delenv("MLFLOW_TAGS")

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    with pytest.raises(RecipeError, match=r"^output.trackers: mlflow: MLFLOW_TRACKING_URI=.*/store is a folder "
                                          r"\(MLflow's file store\), which MLFLOW_ALLOW_FILE_STORE=false refuses"):
        preflight(recipe)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(RecipeError, match=r"MLFLOW_ALLOW_FILE_STORE=false refuses"):
        preflight(recipe)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")

    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "a-file"))
    with pytest.raises(RecipeError, match=r"MLFLOW_TRACKING_URI=.*a-file is a file, not a folder"):
        preflight(recipe)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # as where it is not installed
    with pytest.raises(RecipeError, match=r"MLFLOW_TRACKING_URI=sqlite:.* needs .*pip install sqlalchemy alembic"):
        preflight(recipe)

    from workbench.distributed.trackers import mlflow_store

    assert mlflow_store("databricks") == ("other", "databricks")  # a name to MLflow, not a folder
    assert mlflow_store("postgresql+psycopg2://u@h/db")[0] == "database"
    assert mlflow_store("file:///srv/mlruns") == ("folder", "/srv/mlruns")
    assert mlflow_store("https://mlflow.example.org")[0] == "server"
