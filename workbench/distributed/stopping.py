"""Stopping cleanly: SIGINT/SIGTERM/SIGUSR1 become a request the loop honours between steps.

A scheduler that preempts a job sends SIGTERM (and SIGKILL a little later); a cluster that warns before a time
limit sends SIGUSR1 (SLURM's `--signal=USR1@SECONDS`); Ctrl-C sends SIGINT to every rank. One more signal can be
named (`--stop-signal`, WORKBENCH_STOP_SIGNAL). The handler only records the signal, so a step or a checkpoint write in progress always finishes;
the loop then saves a checkpoint and raises `Interrupted` (exit code 130 or 143). A second Ctrl-C stops at
once; repeated SIGTERMs (torchrun forwards the one it got to ranks that had it already) are ignored.
A launcher gives its ranks a grace period before SIGKILL (torchrun and SLURM: 30 s by default): the
checkpoint written on the way out must fit in it.
Where the process may wait on something outside it (a tracking server while the trackers start), `interruptible`
makes a signal end the wait at once: there is no step boundary to wait for.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from datetime import timedelta

import torch

from workbench.base.errors import Interrupted, RecipeError

FORWARDED_WITHIN_S = 1.0
# What stops a run at the next step boundary, with a checkpoint: the one list every part reads (the loop's
# handlers, the launcher that must survive and pass them on, the CLI's exit codes).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
STOP_SIGNAL_ENV = "WORKBENCH_STOP_SIGNAL"  # one more, by name (USR2, SIGURG, ...): launched ranks inherit it
NEVER_STOP_SIGNALS = ("SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT",
                      "SIGWINCH", "SIGCONT", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGURG", "SIGPIPE")  # or sent in normal use


def parse_signal(text: str, what: str = "--stop-signal") -> int:
    """A signal's number from its name (USR2, SIGUSR2) or number; RecipeError naming `what` otherwise."""
    name = str(text).strip().upper()
    try:
        found = signal.Signals(int(name)) if name.isdigit() else signal.Signals[name if name.startswith("SIG")
                                                                                 else "SIG" + name]
    except (KeyError, ValueError):
        raise RecipeError(f"{what}: {text!r} is not a signal name (e.g. USR1, USR2, TERM)") from None
    if found.name in NEVER_STOP_SIGNALS:
        raise RecipeError(f"{what}: {found.name} cannot stop a run cleanly (it cannot be caught, or a run gets it in "
                          "normal use); choose e.g. USR1 or USR2")
    return int(found)


def stop_signals(env: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """STOP_SIGNALS and the one named in WORKBENCH_STOP_SIGNAL (of `env`, default this process's)."""
    named = (os.environ if env is None else env).get(STOP_SIGNAL_ENV, "").strip()
    extra = parse_signal(named, STOP_SIGNAL_ENV) if named else None
    return STOP_SIGNALS + ((extra,) if extra and extra not in STOP_SIGNALS else ())


def warning_signals(env: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """The stop signals a launcher must survive and pass on to its ranks itself: it dies of them by default
    (torchrun handles SIGINT and SIGTERM on its own)."""
    return tuple(s for s in stop_signals(env) if s not in (signal.SIGINT, signal.SIGTERM))


class StopNow(BaseException):
    """Raised by the signal handler inside `StopRequest.interruptible`; a BaseException, so that the libraries'
    `except Exception` around their network calls lets it through."""


class StopRequest:
    active: "StopRequest | None" = None  # the one whose handlers are installed (signals belong to the process)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._since = 0.0
        self._previous: dict[int, object] = {}
        self._at_once = False
        self._fired: int | None = None  # a signal that came inside `interruptible`
        self._file_checked = float("-inf")

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for signum in stop_signals():
                self._previous[signum] = signal.signal(signum, self._record)
        # in a thread (Ray Train runs the loop in one) nothing is installed: `request` stops it instead
        StopRequest.active = self
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if StopRequest.active is self:
            StopRequest.active = None

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask the loop to stop at the next step boundary, as the signal would: from any thread."""
        if self.signum is None:
            self.signum, self._since = signum, time.monotonic()

    def poll_file(self, path, every_s: float = 1.0) -> None:
        """A request file (`workbench stop`) counts as SIGTERM; looked at no more than once every `every_s`."""
        now = time.monotonic()
        if now - self._file_checked >= every_s:
            self._file_checked = now
            if os.path.exists(path):
                self.request(signal.SIGTERM)

    def _record(self, signum: int, frame) -> None:
        now = time.monotonic()
        # Ctrl-C twice: stop now, without the checkpoint. A copy of the first one that a launcher forwards
        # (torchrun passes on what it got) arrives within moments and does not count as a second.
        if signum == signal.SIGINT and self.signum == signal.SIGINT and now - self._since > FORWARDED_WITHIN_S:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum, self._since = signum, now
        if self._at_once:
            self._fired = signum
            raise StopNow(signum)

    @contextmanager
    def interruptible(self, what: str, earlier_counts: bool = True):
        """A stop signal that comes inside raises Interrupted("interrupted by SIGTERM while <what>") at once,
        whatever the code inside was waiting for; so does one that came before, unless earlier_counts is False
        (the loop still honours that one at the step's end)."""
        self._at_once, self._fired = True, None
        try:
            if earlier_counts and self.signum is not None:
                self._fired = self.signum
                raise StopNow(self.signum)
            yield
        except BaseException:
            if self._fired is None:
                raise
            raise Interrupted(f"interrupted by {signal.Signals(self._fired).name} while {what}",
                              self._fired) from None
        finally:
            self._at_once = False

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


def host_group(timeout_s: float):
    """A gloo group beside a GPU backend, for flags the host holds: all-reducing a CPU tensor never waits for the
    GPU's queue. It gives up after timeout_s like the loop's other collectives (None: the default group is gloo
    already). Every rank must create it at the same point."""
    if torch.distributed.get_backend() == "gloo":
        return None
    return torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


NEVER = 2**53  # larger than any step: ranks agree on the earliest non-finite step through a MAX all-reduce


class NonFiniteWatch:
    """The first step whose loss or gradient norm was NaN/Inf (0: none), kept on the device: reading it is a host
    sync, which on a GPU stalls the host until the step's kernels finish, so the loop reads it only where it
    must decide (see host_reads_every_step)."""

    def __init__(self, device) -> None:
        self.first = torch.zeros((), dtype=torch.long, device=device)

    def observe(self, step: int, loss: torch.Tensor, grad_norm) -> None:
        bad = ~torch.isfinite(loss)
        if isinstance(grad_norm, torch.Tensor):  # DeepSpeed clips inside its engine and returns None
            bad = bad | ~torch.isfinite(grad_norm)
        self.first = torch.where(bad & (self.first == 0), step, self.first)

    def reset(self) -> None:
        self.first.zero_()


def host_reads_every_step(device_type: str, on_nonfinite: str) -> bool:
    """A CPU reads its own memory (free); a GPU run reads the NaN check only at steps that write a row,
    evaluate, checkpoint or end, and at a stop signal, before any of them, unless on_nonfinite: skip must decide
    each step. A non-finite step is then found a few steps late, never saved. Signals are agreed every step
    over the host (agree)."""
    return device_type == "cpu" or on_nonfinite == "skip"


def agree(accelerator, first_nonfinite: torch.Tensor | None, stop: StopRequest,
          signal_group=None) -> tuple[int, int | None]:
    """(the earliest step at which any rank saw a NaN/Inf, 0 if none; the signal any rank got): every rank takes
    the same decision at the same step. One small all-reduce when there are several processes, none in one.
    first_nonfinite None: not a step that decides; the signal alone is agreed over signal_group (host_group)."""
    if accelerator.num_processes == 1:
        return (int(first_nonfinite) if first_nonfinite is not None else 0), stop.signum
    if first_nonfinite is None:  # the signal alone, over the host: never waits for a GPU's queue
        flag = torch.tensor([float(stop.signum or 0)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=signal_group)
        return 0, int(flag[0]) or None
    earliest = torch.where(first_nonfinite > 0, NEVER - first_nonfinite, 0).double()
    flags = torch.stack([earliest, torch.tensor(float(stop.signum or 0), dtype=torch.float64,
                                                device=accelerator.device)])
    # MAX: the earliest NaN anywhere stops everyone; SIGTERM (15, a scheduler) wins over SIGINT (2)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    first = int(NEVER - flags[0]) if flags[0] > 0 else 0
    return first, int(flags[1]) or None
