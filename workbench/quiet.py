"""Keep the output to what the user asked for: silence known-harmless notes of the libraries below."""

from __future__ import annotations

import importlib
import logging
import os
import warnings

_HARMLESS = (
    "Failed to load CPU gemm_4bit_forward",  # bitsandbytes: an optional hub kernel (never installed here)
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


def import_quietly(module: str):
    """Import a module with the libraries' import-time notes silenced for this import only: the filters are
    restored afterwards, so a notebook's own warning settings stay as they were."""
    with warnings.catch_warnings():
        quiet_warnings()
        import tqdm.auto  # noqa: F401  (the libraries import it later, and it warns once, on first import)

        return importlib.import_module(module)


def quiet_libraries() -> None:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    for name in ("bitsandbytes.backends.cpu.ops", "DeepSpeed"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropHarmless) for f in logger.filters):  # called once per command
            logger.addFilter(_DropHarmless())
    quiet_warnings()
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass
