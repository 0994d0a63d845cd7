"""output.trackers: the run's metrics, config and summary, also sent to TensorBoard, W&B or MLflow.

Accelerate's own trackers do the sending (train.py logs each metrics.jsonl row through `accelerator.log`).
This module checks their packages before a run starts, points their files into the run directory unless
the user's environment says otherwise, and hands them the run's summary at the end.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

from .errors import RecipeError

# tracker -> the modules Accelerate imports for it (any one will do); the extra that installs it is its name
TRACKER_MODULES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",)}
SUMMARY_PREFIX = "summary/"


def check_tracker_packages(trackers: list[str]) -> None:
    """One error naming every tracker whose package is missing: Accelerate would otherwise drop it silently."""
    missing = [name for name in dict.fromkeys(trackers) if not any(map(_installed, TRACKER_MODULES[name]))]
    if missing:
        raise RecipeError("output.trackers: " + "; ".join(
            f'{name} needs the {TRACKER_MODULES[name][0]} package: pip install "lora-workbench[{name}]"'
            for name in missing))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module half-imported or replaced in sys.modules
        return False


def tensorboard_dir(run_dir: str | Path) -> Path:
    """Accelerate's logging_dir: TensorBoard writes <run>/tensorboard/<name>/."""
    return Path(run_dir) / "tensorboard"


def prepare_trackers(trackers: list[str], run_dir: Path) -> dict:
    """Accelerate's `init_kwargs` that keep each tracker's files inside the run directory, unless WANDB_DIR or
    MLFLOW_TRACKING_URI say where they go. Sets MLflow's tracking URI in the environment, as MLflow reads it
    from there (the Python API puts the environment back when train returns)."""
    init_kwargs = {}
    if "wandb" in trackers and not os.environ.get("WANDB_DIR"):
        init_kwargs["wandb"] = {"dir": str(run_dir)}  # W&B writes <dir>/wandb/; WANDB_MODE stays W&B's own
        os.environ.setdefault("WANDB_CACHE_DIR", str(Path(run_dir).resolve() / "wandb" / "cache"))  # its debug logs
    if "mlflow" in trackers and not os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_TRACKING_URI"] = (Path(run_dir).resolve() / "mlruns").as_uri()
        # MLflow 3 refuses a file store unless asked: it is the one store mlflow-skinny runs without a database
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no look-up abroad, no file in ~/.config
    return init_kwargs


def summary_figures(summary: dict) -> dict:
    """The summary's single values (numbers and words; lists and mappings stay in run.json), as summary/<key>."""
    return {SUMMARY_PREFIX + key: value for key, value in summary.items()
            if isinstance(value, (int, float, str)) and not (isinstance(value, float) and not math.isfinite(value))}


def log_summary(accelerator, summary: dict, step: int) -> None:
    """The run's final figures, where each tracker keeps such things: W&B's run summary; MLflow's metrics at the
    last step (words as tags); TensorBoard has no summary, so a last row of scalars (words as text)."""
    figures = summary_figures(summary)
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            tracker.tracker.summary.update(figures)
        elif tracker.name == "mlflow":
            import mlflow

            tracker.log({k: v for k, v in figures.items() if not isinstance(v, str)}, step=step)
            mlflow.set_tags({k: v for k, v in figures.items() if isinstance(v, str)})
        else:
            tracker.log(figures, step=step)
