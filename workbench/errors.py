"""Errors a user can act on. The CLI prints their message on one line and exits with `exit_code`."""


class WorkbenchError(Exception):
    exit_code = 1


class RecipeError(WorkbenchError, ValueError):
    """A recipe, an override or a flag is invalid; the message names the field."""

    exit_code = 2


class DataError(WorkbenchError, ValueError):
    """A data file or row is invalid; the message names the file and line."""

    exit_code = 2


class ModelError(WorkbenchError):
    """A model or tokenizer cannot be found or loaded."""

    exit_code = 2


class NonFiniteError(WorkbenchError):
    """The loss or the gradients became NaN or infinite."""


class Interrupted(WorkbenchError):
    """SIGINT or SIGTERM stopped the run after saving a checkpoint: 130 (SIGINT) or 143 (SIGTERM)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
