"""Stopping cleanly: SIGINT/SIGTERM become a request the loop honours between steps.

A scheduler that preempts a job sends SIGTERM (and SIGKILL a little later); Ctrl-C sends SIGINT to every
rank. The handler only records the signal, so a step or a checkpoint write in progress always finishes;
the loop then saves a checkpoint and raises `Interrupted` (exit code 130 or 143). A second Ctrl-C stops at
once; repeated SIGTERMs (torchrun forwards the one it got to ranks that had it already) are ignored.
A launcher gives its ranks a grace period before SIGKILL (torchrun and SLURM: 30 s by default): the
checkpoint written on the way out must fit in it.
"""

from __future__ import annotations

import signal
import threading
import time

import torch

FORWARDED_WITHIN_S = 1.0


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._since = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _record(self, signum: int, frame) -> None:
        now = time.monotonic()
        # Ctrl-C twice: stop now, without the checkpoint. A copy of the first one that a launcher forwards
        # (torchrun passes on what it got) arrives within moments and does not count as a second.
        if signum == signal.SIGINT and self.signum == signal.SIGINT and now - self._since > FORWARDED_WITHIN_S:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum, self._since = signum, now

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


def agree(accelerator, nonfinite: bool, stop: StopRequest) -> tuple[bool, int | None]:
    """(any rank saw a NaN/Inf, the signal any rank got): every rank takes the same decision at the same
    step. One small all-reduce per step when there are several processes, none in one process."""
    if accelerator.num_processes == 1:
        return nonfinite, stop.signum
    flags = torch.tensor([float(nonfinite), float(stop.signum or 0)], device=accelerator.device)
    # MAX: a NaN anywhere stops everyone; SIGTERM (15, a scheduler) wins over SIGINT (2)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return bool(flags[0] > 0), int(flags[1]) or None
