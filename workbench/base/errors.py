"""Errors a user can act on. The CLI prints their message on one line and exits with `exit_code`."""

import re
from contextlib import contextmanager

# C0 and C1 control characters and DEL: a terminal reads ESC, CSI (0x9b) and OSC sequences as commands (retitle,
# clear, move the cursor) and CR as "overwrite this line", so text from a recipe, a data file or a run folder shown
# raw could rewrite what the user sees. Newlines and tabs are layout (a message of several problems has a line each).
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if chr(c) not in "\n\t"}


def printable(text: object) -> str:
    """`text` with control characters (other than newline and tab) written as \\xNN, safe to show on a terminal."""
    return str(text).translate(_CONTROL)


_EVERY_CONTROL = {**_CONTROL, **{c: f"\\x{c:02x}" for c in (0x09, 0x0A)}}


def escaped(value: object) -> str:
    """`value` (a path, a name: the user's text quoted inside a message) with every control character written as
    \\xNN, line breaks and tabs included: a file named with a newline must not split a one-line error in two.
    Escape the value as the message is built, never the finished message (a message may list problems a line each)."""
    return str(value).translate(_EVERY_CONTROL)


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


class WriteError(WorkbenchError):
    """A file or folder could not be written (a full disk, a file size limit, no permission); names the path."""

    def __init__(self, path: object, cause: str):
        super().__init__(f"{path}: cannot write ({cause})")
        self.cause = cause


# the system's words inside safetensors' message: `I/O error: File too large (os error 27)` (0.8) or
# `IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })` (earlier releases)
_OS_MESSAGE = re.compile(r'(?:I/O error: |message: ")([^"]+?)(?: \(os error \d+\)|")')


@contextmanager
def reported_as_write_error(path: object):
    """Errors of a write to `path` as one WriteError naming it. safetensors reports a failed write (a full disk,
    `ulimit -f`) as its own SafetensorError, which is no OSError, and torch.save as a RuntimeError of its stream
    writer: both would otherwise end the command with a traceback."""
    try:
        yield
    except (WriteError, ConnectionError, TimeoutError):  # a peer lost in a collective of the save is no write's fault
        raise
    except OSError as err:
        raise WriteError(path, err.strerror or str(err)) from err
    except Exception as err:
        if not _is_write_failure(err):
            raise
        found = _OS_MESSAGE.search(str(err))
        raise WriteError(path, found.group(1) if found else str(err).strip().splitlines()[-1]) from err


def _is_write_failure(err: Exception) -> bool:
    if type(err).__name__ == "SafetensorError":  # safetensors' Rust error (a write, as this is around one)
        return True
    return isinstance(err, RuntimeError) and "PytorchStreamWriter" in str(err)  # torch.save's writer
