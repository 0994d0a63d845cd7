"""output.trackers: TensorBoard, W&B (offline) and MLflow (a file store) each get what the run itself records:
metrics.jsonl's rows, the recipe as config, run.json's summary. Each is read back with the tracker's own reader."""

import json
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from workbench import RecipeError, train
from workbench.cli import main
from workbench.metrics import read_metrics
from workbench.trackers import check_tracker_packages, prepare_trackers, summary_figures
from workbench.train import _flat

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
