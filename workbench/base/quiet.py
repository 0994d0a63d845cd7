"""Keep the output to what the user asked for: silence known-harmless notes of the libraries below."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import threading
import warnings
from contextlib import contextmanager

_HARMLESS = (
    # bitsandbytes, imported on a CPU with AVX-512 BF16, asks the `kernels` package (a dependency of transformers)
    # for an optional hub kernel: offline, or without it, it falls back to its own and logs both notes
    "Failed to load CPU gemm_4bit_forward",
    "Skipping publisher trust check for 'kernels-community/",
    "Setting accelerator to CPU",  # DeepSpeed probing for a GPU on a CPU machine
)


class _DropHarmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in _HARMLESS)


def quiet_warnings() -> None:
    """Warning filters for known-harmless notes (libraries warn as they are imported): set for the command
    line, and inside `warnings.catch_warnings()` when the Python API loads a module."""
    # tqdm in a notebook without ipywidgets: it falls back to a text bar, which is all we use
    warnings.filterwarnings("ignore", message="IProgress not found")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft|accelerate)\b")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


_QUIETED_LOGGERS = ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub", "DeepSpeed")


_imports = threading.RLock()  # catch_warnings saves and restores the process's one list of filters


def import_quietly(module: str):
    """Import a module with the libraries' import-time notes silenced for this import only: the warning and
    logger filters are restored afterwards, so a notebook's own settings stay as they were. One import at a
    time: two threads first touching `workbench.x` at once would each restore the filters the other set."""
    with _imports, warnings.catch_warnings(), _harmless_logs_dropped():
        quiet_warnings()
        import tqdm.auto  # noqa: F401  (the libraries import it later, and it warns once, on first import)

        return importlib.import_module(module)


@contextmanager
def _harmless_logs_dropped():
    loggers = [logging.getLogger(name) for name in _QUIETED_LOGGERS]
    added = [logger for logger in loggers if not any(isinstance(f, _DropHarmless) for f in logger.filters)]
    drop = _DropHarmless()
    for logger in added:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in added:
            logger.removeFilter(drop)


def quiet_libraries(loads_models: bool = True) -> None:
    """For the command line's process (and, inside `process_as_found`, for one API call). `loads_models`: the
    caller goes on to load peft, so bitsandbytes is imported first, without waiting on the hub (a command that
    loads no model skips that import's seconds)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    for name in _QUIETED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropHarmless) for f in logger.filters):  # called once per command
            logger.addFilter(_DropHarmless())
    quiet_warnings()
    if loads_models:
        import_bitsandbytes_offline()
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass


def import_bitsandbytes_offline() -> None:
    """Import bitsandbytes (peft imports it) with the hub offline for that import alone. On a CPU with AVX-512 BF16
    its import asks the hub, through `kernels`, for an optional kernel, with no deadline: behind a firewall that
    drops packets every command that loads peft (push, merge, train) would hang there for minutes. Offline, a
    kernel already in the local cache still loads; otherwise bitsandbytes uses its own. The switch (the hub
    library's constant, read at each request, and the variable) is put back at once."""
    if "bitsandbytes" in sys.modules:
        return
    try:
        from huggingface_hub import constants
    except ImportError:
        return
    flag, variable = constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")
    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # optional, and its import fails on odd CUDA setups: peft's own import then says so
        pass
    finally:
        constants.HF_HUB_OFFLINE = flag
        if variable is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = variable


_calls = threading.Lock()
_depth = 0  # API calls in progress in this process (a UI or a notebook may run several in threads)
_found: dict | None = None


@contextmanager
def process_as_found():
    """What an API call changes in the process (warning filters, the libraries' log levels and progress bars,
    environment variables, torch's thread count, logger filters) is put back when it returns or raises: a
    notebook's process is left as the call found it. Calls that overlap (threads) share one snapshot, taken
    when the first starts and put back when the last ends. The command line sets them for its process."""
    global _depth, _found
    with _calls:
        if _depth == 0:
            _found = _process_settings()
        _depth += 1
    try:
        yield
    finally:
        with _calls:
            _depth -= 1
            if _depth == 0:
                _restore_process_settings(_found)
                _found = None


def _process_settings() -> dict:
    import torch

    return {"environment": dict(os.environ), "threads": torch.get_num_threads(),
            "warnings": warnings.filters[:],
            "loggers": {name: list(logging.getLogger(name).filters) for name in _QUIETED_LOGGERS},
            "libraries": _library_settings()}


def _restore_process_settings(found: dict) -> None:
    import torch

    for name in set(os.environ) - set(found["environment"]):
        del os.environ[name]
    os.environ.update({k: v for k, v in found["environment"].items() if os.environ.get(k) != v})
    if torch.get_num_threads() != found["threads"]:
        torch.set_num_threads(found["threads"])
    warnings.filters[:] = found["warnings"]
    getattr(warnings, "_filters_mutated", lambda: None)()  # the C module caches the filters' version
    for name, filters in found["loggers"].items():
        logging.getLogger(name).filters[:] = filters
    _restore_library_settings(found["libraries"])


def leaves_the_process_as_found(function):
    """Decorates a public API function with `process_as_found`."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        with process_as_found():
            return function(*args, **kwargs)
    return call


def _library_settings() -> dict:
    settings = {}
    try:
        import transformers

        settings["transformers"] = (transformers.utils.logging.get_verbosity(),
                                    transformers.utils.logging.is_progress_bar_enabled())
    except ImportError:
        pass
    try:
        import datasets

        settings["datasets"] = (datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled())
    except (ImportError, AttributeError):
        pass
    return settings


def _restore_library_settings(settings: dict) -> None:
    if "transformers" in settings:
        import transformers

        verbosity, bars = settings["transformers"]
        transformers.utils.logging.set_verbosity(verbosity)
        (transformers.utils.logging.enable_progress_bar if bars else transformers.utils.logging.disable_progress_bar)()
    if "datasets" in settings:
        import datasets

        verbosity, bars = settings["datasets"]
        datasets.logging.set_verbosity(verbosity)
        (datasets.enable_progress_bars if bars else datasets.disable_progress_bars)()
