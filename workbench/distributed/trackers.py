"""output.trackers: the run's metrics, config and summary, also sent to TensorBoard, W&B or MLflow.

Accelerate's own trackers do the sending (the training session logs each metrics.jsonl row through `log_to_trackers`).
This module checks their packages and settings before a run starts (no weights loaded yet), points their files
into the run directory unless the user's environment says otherwise, puts a time limit on MLflow's requests,
starts them (a stop signal ends a start that waits on a server), and hands them the run's summary at the end.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import warnings
from pathlib import Path
from urllib.parse import urlparse

from workbench.base.errors import RecipeError, WorkbenchError

# tracker -> the modules Accelerate imports for it (any one will do); the extra that installs it is its name
TRACKER_MODULES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",)}
SUMMARY_PREFIX = "summary/"
# MLflow's requests wait 120 s each and are retried 7 times (minutes before an error); a run's own, unless the
# user set them (MLFLOW_HTTP_REQUEST_TIMEOUT, MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR)
MLFLOW_REQUEST_TIMEOUT_S = 15
MLFLOW_REQUEST_RETRIES = 2
MLFLOW_BACKOFF_FACTOR = 1
MLFLOW_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's SQLAlchemy store


def check_tracker_packages(trackers: list[str]) -> None:
    """One error naming every tracker whose package is missing: Accelerate would otherwise drop it silently."""
    missing = [name for name in dict.fromkeys(trackers) if not any(map(_installed, TRACKER_MODULES[name]))]
    if missing:
        raise RecipeError("output.trackers: " + "; ".join(
            f'{name} needs the {TRACKER_MODULES[name][0]} package: pip install "lora-workbench[{name}]"'
            for name in missing))


def check_trackers(trackers: list[str]) -> None:
    """Each tracker's package, then the settings that would otherwise fail once the model is loaded: W&B online
    without a key; MLflow's tracking URI (a folder MLflow may not use, a database without its packages, a server
    that does not answer), an empty experiment name, tags that are not JSON."""
    check_tracker_packages(trackers)
    if "wandb" in trackers and (problem := wandb_login_problem()):
        raise RecipeError(f"output.trackers: wandb {problem}")
    if "mlflow" in trackers:
        check_mlflow_settings()


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module half-imported or replaced in sys.modules
        return False


# -- W&B ------------------------------------------------------------------------------------------------


def wandb_login_problem() -> str | None:
    """What W&B would refuse once the model is loaded (online, and no key in the environment, a netrc or its settings
    files), or None. W&B's own settings are read as wandb.init reads them; where this W&B version reads them
    differently, the check steps aside and W&B's own error at the start is reported (start_trackers)."""
    mode = (os.environ.get("WANDB_MODE") or "").strip().lower()
    if mode in ("offline", "dryrun", "disabled") or os.environ.get("WANDB_API_KEY") \
            or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    try:
        from wandb.sdk.lib.wbauth import HostUrl, read_netrc_auth
        from wandb.sdk.wandb_settings import Settings

        settings = Settings()
        settings.silent = True  # it would print which settings files it read
        config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or "~/.config/wandb").expanduser()
        settings.settings_system = str(config_dir / "settings")
        settings.update_from_system_settings()  # `wandb offline` and `wandb login` write there
        settings.update_from_env_vars(dict(os.environ))
        if settings.mode in ("offline", "dryrun", "disabled") or settings.api_key:
            return None
        if read_netrc_auth(host=HostUrl(settings.base_url, app_url=settings.app_url)):
            return None
    except Exception:  # noqa: BLE001  (another W&B version: its own check at the start stands)
        return None
    how = f"WANDB_MODE={mode}" if mode else "WANDB_MODE is not set"
    return (f"is online ({how}) and has no API key: run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline "
            "(sync later with `wandb sync`) or WANDB_MODE=disabled")


# -- MLflow -----------------------------------------------------------------------------------------------


def mlflow_store(uri: str | None) -> tuple[str, str]:
    """(kind, where) of an MLflow tracking URI: ("folder", path) for a file store (the run's own when unset),
    ("database", scheme), ("server", url), or ("other", uri)."""
    if not uri:
        return "folder", ""
    if uri in ("databricks", "databricks-uc", "uc"):  # names, not paths, to MLflow
        return "other", uri
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and scheme.isalpha()):  # a path, file://, C:\...
        return "folder", (parsed.path if scheme == "file" else uri)
    if scheme.startswith(MLFLOW_DATABASES):  # as MLflow reads it: postgresql+psycopg2, ...
        return "database", scheme
    if scheme in ("http", "https"):
        return "server", uri
    return "other", uri


def check_mlflow_settings() -> None:
    uri = os.environ.get("MLFLOW_TRACKING_URI") or None
    prefix = "output.trackers: mlflow: "
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if name is not None and not name.strip():
        raise RecipeError(prefix + "MLFLOW_EXPERIMENT_NAME is set but empty; unset it (the experiment is then the "
                          "recipe's name) or name an experiment")
    tags = os.environ.get("MLFLOW_TAGS")
    if tags is not None:
        try:
            parsed = json.loads(tags)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise RecipeError(prefix + f'MLFLOW_TAGS must be a JSON object like {{"team": "nlp"}}, not {tags!r}')
    kind, where = mlflow_store(uri)
    setting = f"MLFLOW_TRACKING_URI={uri}"
    if kind == "folder":
        allow = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
        if allow is not None and allow.strip().lower() not in ("true", "1"):  # MLflow reads true/1/false/0 only
            store = f"{setting} is a folder" if uri else "MLFLOW_TRACKING_URI is unset, so the run uses its own folder"
            raise RecipeError(prefix + f"{store} (MLflow's file store), which MLFLOW_ALLOW_FILE_STORE={allow} refuses; "
                              "unset MLFLOW_ALLOW_FILE_STORE (or set it to true), or use a database: "
                              "MLFLOW_TRACKING_URI=sqlite:///<folder>/mlflow.db")
        if where and Path(where).expanduser().exists() and not Path(where).expanduser().is_dir():
            raise RecipeError(prefix + f"{setting} is a file, not a folder; name a folder, or a database as "
                              f"sqlite:///{where}")
    elif kind == "database":
        missing = [m for m in ("sqlalchemy", "alembic") if not _installed(m)]
        if missing:
            raise RecipeError(prefix + f"{setting} needs MLflow's database packages, which mlflow-skinny leaves "
                              "out: pip install sqlalchemy alembic (or use a folder, or a tracking server)")
    elif kind == "server":
        check_mlflow_server(uri)


def mlflow_request_timeout() -> float:
    """Seconds each MLflow request of a run waits: MLFLOW_HTTP_REQUEST_TIMEOUT, else the run's own."""
    try:
        return float(os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"])
    except (KeyError, ValueError):
        return float(MLFLOW_REQUEST_TIMEOUT_S)


def check_mlflow_server(uri: str) -> None:
    """One request to the tracking server (its health endpoint), waiting as long as one of the run's requests: any
    answer will do. A server that is down or never answers fails here, before the model loads."""
    import requests

    seconds = mlflow_request_timeout()
    problem = None
    try:
        requests.get(uri.rstrip("/") + "/health", timeout=seconds, allow_redirects=False)
    except requests.Timeout:
        problem = f"did not answer within {seconds:g} s (MLFLOW_HTTP_REQUEST_TIMEOUT sets the wait)"
    except requests.RequestException as err:
        problem = f"cannot be reached ({_reason(err)})"
    if problem:
        raise RecipeError(f"output.trackers: mlflow: the tracking server MLFLOW_TRACKING_URI={uri} {problem}; start "
                          "it, point MLFLOW_TRACKING_URI elsewhere, or leave mlflow out of output.trackers")


def _reason(err: BaseException) -> str:
    """The innermost cause's words: 'Connection refused' rather than urllib3's pool and retry wrappers."""
    for _ in range(10):
        inner = err.__cause__ or (err.args[0] if err.args and isinstance(err.args[0], BaseException) else None)
        inner = inner or getattr(err, "reason", None)
        if not isinstance(inner, BaseException) or inner is err:
            break
        err = inner
    text = getattr(err, "strerror", None) or str(err)
    return first_line(text.split("]", 1)[-1].strip() if text.startswith("[Errno") else text)


def first_line(text, limit: int = 400) -> str:
    line = (str(text).strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


# -- where the files go, start and finish -----------------------------------------------------------------


def tensorboard_dir(run_dir: str | Path) -> Path:
    """Accelerate's logging_dir: TensorBoard writes <run>/tensorboard/<name>/."""
    return Path(run_dir) / "tensorboard"


def prepare_trackers(trackers: list[str], run_dir: Path) -> dict:
    """Accelerate's `init_kwargs` that keep each tracker's files inside the run directory, unless WANDB_DIR or
    MLFLOW_TRACKING_URI say where they go. Sets MLflow's tracking URI and request limits in the environment, as
    MLflow reads them from there (the Python API puts the environment back when train returns)."""
    init_kwargs = {}
    if "wandb" in trackers and not os.environ.get("WANDB_DIR"):
        init_kwargs["wandb"] = {"dir": str(run_dir)}  # W&B writes <dir>/wandb/; WANDB_MODE stays W&B's own
        os.environ.setdefault("WANDB_CACHE_DIR", str(Path(run_dir).resolve() / "wandb" / "cache"))  # its debug logs
    if "mlflow" in trackers:
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ["MLFLOW_TRACKING_URI"] = (Path(run_dir).resolve() / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no look-up abroad, no file in ~/.config
        if mlflow_store(os.environ["MLFLOW_TRACKING_URI"])[0] == "folder":
            # MLflow 3 refuses a file store unless asked: the one store mlflow-skinny runs without a database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(MLFLOW_REQUEST_TIMEOUT_S))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(MLFLOW_REQUEST_RETRIES))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", str(MLFLOW_BACKOFF_FACTOR))
    return init_kwargs


def start_trackers(accelerator, name: str, trackers: list[str], run_dir: Path, config: dict, stop) -> None:
    """Start each tracker's run with the recipe as its config. A stop signal while a tracker waits on its server
    ends the run at once (Interrupted); a tracker that fails to start is one error naming it and where it sends."""
    init_kwargs = prepare_trackers(trackers, run_dir)
    try:
        with stop.interruptible("starting output.trackers (" + ", ".join(
                f"{tracker}: {_where_one(tracker)}" for tracker in dict.fromkeys(trackers)) + ")"):
            accelerator.init_trackers(name, config=config, init_kwargs=init_kwargs)
    except BaseException as err:
        if not isinstance(err, Exception) or isinstance(err, WorkbenchError):  # Interrupted, Ctrl-C twice
            accelerator.trackers = []  # nothing more is asked of a server that kept the run waiting
            raise
        failed = _tracker_of(err) or (trackers[0] if len(set(trackers)) == 1 else None)
        finish_trackers(accelerator, quietly=True)  # those that started before one failed
        what = f"{failed} did not start ({_where_one(failed)})" if failed else "did not start"
        raise WorkbenchError(f"output.trackers: {what}: {first_line(err) or type(err).__name__}") from None


def finish_trackers(accelerator, quietly: bool = False) -> None:
    """End the run of each tracker that started (one whose start failed has nothing to end). A tracker that fails
    to finish is a warning: metrics.jsonl and run.json hold everything it was sent."""
    trackers, accelerator.trackers = list(accelerator.trackers), []
    for tracker in trackers:
        try:
            if tracker.tracker is None:
                continue
        except AttributeError:  # never started
            continue
        try:
            tracker.finish()
        except Exception as err:  # noqa: BLE001
            if not quietly:
                warnings.warn(f"output.trackers: {tracker.name} did not finish ({_where_one(tracker.name)}): "
                              f"{first_line(err)}", stacklevel=2)


def _where_one(name: str) -> str:
    """Where a tracker sends, in the setting that says so."""
    if name == "mlflow":
        return f"MLFLOW_TRACKING_URI={os.environ.get('MLFLOW_TRACKING_URI', '')}"
    if name == "wandb":
        mode = os.environ.get("WANDB_MODE")
        return f"WANDB_MODE={mode}" if mode else "online, WANDB_MODE not set"
    return "its folder in the run directory"


def _tracker_of(err: BaseException) -> str | None:
    """The tracker whose code raised err: the first frame of its traceback that runs a tracker's method."""
    from accelerate.tracking import GeneralTracker

    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, GeneralTracker):
            return owner.name
        tb = tb.tb_next
    return None


def summary_figures(summary: dict) -> dict:
    """The summary's single values (numbers and words; lists and mappings stay in run.json), as summary/<key>."""
    return {SUMMARY_PREFIX + key: value for key, value in summary.items()
            if isinstance(value, (int, float, str)) and not (isinstance(value, float) and not math.isfinite(value))}


def log_to_trackers(accelerator, values: dict, step: int) -> None:
    """accelerator.log, one tracker at a time. A tracker that fails (its server gone: each MLflow request has a time
    limit) or that is still waiting when a stop signal comes is left out for the rest of the run, with a warning:
    the run goes on (metrics.jsonl has every row), and stops at the step's end as usual after a signal."""
    _each_tracker(accelerator, f"logging step {step}", lambda tracker: tracker.log(values, step=step))


def log_summary(accelerator, summary: dict, step: int) -> None:
    """The run's final figures, where each tracker keeps such things: W&B's run summary; MLflow's metrics at the
    last step (words as tags); TensorBoard has no summary, so a last row of scalars (words as text)."""
    figures = summary_figures(summary)

    def send(tracker) -> None:
        if tracker.name == "wandb":
            tracker.tracker.summary.update(figures)
        elif tracker.name == "mlflow":
            import mlflow

            tracker.log({k: v for k, v in figures.items() if not isinstance(v, str)}, step=step)
            mlflow.set_tags({k: v for k, v in figures.items() if isinstance(v, str)})
        else:
            tracker.log(figures, step=step)

    _each_tracker(accelerator, "sending the summary", send)


def _each_tracker(accelerator, what: str, send) -> None:
    from contextlib import nullcontext

    from workbench.distributed.stopping import StopRequest

    stop = StopRequest.active
    for tracker in list(accelerator.trackers):
        try:
            with stop.interruptible(f"{what} to {tracker.name}", earlier_counts=False) if stop else nullcontext():
                send(tracker)
        except Exception as err:  # noqa: BLE001  (Interrupted included: the loop stops at the step's end)
            accelerator.trackers.remove(tracker)
            warnings.warn(f"output.trackers: {tracker.name} is left out from here on ({_where_one(tracker.name)}): "
                          f"{first_line(err)}; metrics.jsonl and run.json keep everything", stacklevel=3)
