"""A training process's heap on a CPU: large blocks go back to the system when they are freed.

glibc serves mid-sized allocations from its heaps and raises its mmap threshold as large blocks are freed
(up to 32 MiB), so after a few steps the per-step tensors of a CPU run (a layer's activations, a 4-bit
layer dequantized for its matmul) come from heaps that keep freed memory and fragment. A fixed threshold
maps every block of at least LARGE_BLOCK on its own and unmaps it when freed.

Measured with `python bench/methods.py --model bench:llama3-1b --steps 2 --batch 1 --seq 512
--only lora,qlora-nf4` (float32 on a 2-core AVX2 CPU): glibc's own threshold 10,588 MB LoRA and 9,441 MB
QLoRA; 4 MiB 8,341 and 5,998 MB; 1 MiB (now) 7,395 MB for LoRA (README, Benchmarks). At 4 MiB a row of
497 tokens of a 2,048-wide model (4,071,424 bytes a hidden state) stayed in the heap, and a QLoRA run held
2.1 GB of freed blocks from one step to the next; tokens/s did not change.

The command line sets it for the processes that train (`workbench train`, and each rank of `workbench
launch`): it is the process's allocator, not a library's to change. In a notebook, call
`workbench.base.heap.return_large_blocks()` once before `wb.train` for the same effect. The estimator assumes
what the run's process does (`large_blocks_returned`).
"""

from __future__ import annotations

import ctypes
import sys

LARGE_BLOCK = 1 << 20  # bytes: a 512 x 512 float32 matrix; smaller blocks keep the heap's speed
_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
_state: bool | None = None  # this process: set (True), trains without it (False), not decided yet (None)


def return_large_blocks(threshold: int = LARGE_BLOCK) -> bool:
    """Map blocks of at least `threshold` bytes on their own (glibc only); whether it took effect."""
    global _state
    _state = _mallopt(threshold)
    return _state


def training_starts() -> None:
    """The training loop says so: a process that has not set the threshold by now trains without it."""
    global _state
    if _state is None:
        _state = False


def large_blocks_returned() -> bool:
    """Whether a run's large blocks go back to the system: what this process did once it trains, else what a
    `workbench train` here would do (the estimator's assumption when planning a run)."""
    return _state if _state is not None else supported()


def supported() -> bool:
    return sys.platform.startswith("linux") and _libc() is not None


def _mallopt(threshold: int) -> bool:
    libc = _libc() if sys.platform.startswith("linux") else None
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:  # another C library (musl): its own allocator, left alone
        return None
