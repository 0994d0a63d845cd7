"""Every measurement of this machine, with one cache.

The machine's probes live here (matmul rates, what a training process holds before its model, FlexAttention on
this GPU); a kernel's own cost model lives beside its kernel and keeps its figures in the same cache
(`packed_attention.AttentionCosts`), and the runtime probe runs as its own program (`runtime_probe.py`).

Each probe's result is kept in a table under cache_dir()/estimator (one JSON file per probe, keyed by what the
result depends on: the CPU model, the library versions, a shape ...), so a later process on this machine reads
it instead of measuring; a key it has not seen is measured again. Within a process every probe runs at most
once per arguments (`once`). A read-only cache costs a measurement next time, never the run.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from workbench.base.builtin import cache_dir
from workbench.base.errors import WorkbenchError
from workbench.hardware.current import cpu_model_name

PROBE_ENV = "LORA_WORKBENCH_MATMUL_RATES"  # "bf16=0.8,fp32=39" (GFLOP/s): use these instead of probing

# -- the cache: on disk, and once per process --------------------------------------------------------------

_memo: dict[tuple, Any] = {}  # (probe, its arguments) -> its result in this process


def once(probe: Callable) -> Callable:
    """Run `probe` at most once per process for each set of (hashable, positional) arguments."""

    @functools.wraps(probe)
    def remembered(*args):
        key = (probe.__name__, *args)
        if key not in _memo:
            _memo[key] = probe(*args)
        return _memo[key]

    return remembered


def measured(probe: str, *args) -> Any:
    """What probe `probe` returned in this process for these arguments, or None: never measures."""
    return _memo.get((probe, *args))


def read_cache_json(name: str) -> dict:
    """A small JSON table under cache_dir()/estimator ({} when missing or unreadable)."""
    try:
        table = json.loads((cache_dir() / "estimator" / name).read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}  # a file someone overwrote is measured again


def write_cache_json(name: str, data: dict) -> None:
    """Replace the table atomically: several processes (ranks, tests) may write it at once."""
    path = cache_dir() / "estimator" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def stored(table: str, key: str, measure: Callable[[], Any], best: bool = False) -> tuple[Any, bool]:
    """(value, whether it came from the disk): the value kept under `key` in `table`, else `measure()` kept there.
    best=True: measure anyway and keep the highest value ever seen (a peak is a property of the hardware, and
    a probe that shares the cores with another busy thread only ever reads low)."""
    seen = read_cache_json(table).get(key)
    if best and not isinstance(seen, (int, float)):  # a peak is a number; anything else is measured again
        seen = None
    if seen is not None and not best:
        return seen, True
    value = measure()
    if best and seen is not None and value <= seen:
        return float(seen), True
    try:
        write_cache_json(table, {**read_cache_json(table), key: value})
    except OSError:
        pass
    return value, False


# -- matmul rates --------------------------------------------------------------------------------------------


def matmul_rate(device_type: str, dtype, size: int, seconds: float, repeats: int = 1) -> float:
    """The best FLOP/s of (size × size) matmuls in `dtype` over about `seconds`, each timing `repeats` matmuls.

    Two callers ask different questions: the precision decision wants a rate in a fraction of a second even where
    a kernel is 50x slow (256, 0.1 s, one matmul per timing); the MFU peak wants the rate of large matmuls
    (1024, 0.5 s, four per timing, 256 where the half type has no native kernel)."""
    import torch

    device = torch.device(device_type)
    # its own generator: the probe may run mid-training (or right after a resume restored the RNG)
    # and must not move the global RNG that dropout draws from
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    torch.matmul(a, b)  # warm up kernels and caches
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        if device_type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            torch.matmul(a, b)
        if device_type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        best = max(best, repeats * 2 * size**3 / max(now - start, 1e-9))
        if now > deadline:
            return best


def cpu_matmul_rates() -> tuple[float, float, str]:
    """(bf16, fp32) matmul GFLOP/s of this CPU and where they came from: the PROBE_ENV variable, the
    cache of an earlier probe on this CPU model and torch version, or a probe now (about 0.3 s)."""
    injected = os.environ.get(PROBE_ENV)
    if injected:
        return (*_parse_rates(injected), PROBE_ENV)
    return _probed_cpu_rates()


@once
def _probed_cpu_rates() -> tuple[float, float, str]:
    import torch

    def measure() -> dict:
        return {name: matmul_rate("cpu", dtype, size=256, seconds=0.1) / 1e9
                for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}

    rates, cached = stored("cpu_precision.json", f"{cpu_model_name()}|torch {torch.__version__}", measure)
    return float(rates["bf16"]), float(rates["fp32"]), "probe, cached" if cached else "probe"


def _parse_rates(text: str) -> tuple[float, float]:
    try:
        rates = {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
        return rates["bf16"], rates["fp32"]
    except (KeyError, ValueError) as err:
        raise WorkbenchError(f"{PROBE_ENV}: expected e.g. 'bf16=0.8,fp32=39' (GFLOP/s), got {text!r}") from err


def matmul_peak(device_type: str, dtype_name: str, threads: int, size: int = 1024) -> float:
    """The highest matmul rate (FLOP/s) seen on this machine for this dtype and thread count: half a second of
    matmuls the first time, then a tenth at the end of each run (a peak only ever reads low, so the runs keep
    raising it; a short job does not pay half a second each time for it)."""
    import torch

    key = f"{device_type}|{dtype_name}|{threads}|{cpu_model_name()}"
    seconds = 0.1 if isinstance(read_cache_json("matmul_peak.json").get(key), (int, float)) else 0.5
    measured = matmul_rate(device_type, getattr(torch, dtype_name), size=size, seconds=seconds, repeats=4)
    return float(stored("matmul_peak.json", key, lambda: measured, best=True)[0])


@once
def cpu_decomposition_rate() -> float:
    """FLOP/s of a float32 SVD on this CPU (a 512 x 512 matrix, counted as 12 n^3), cached per CPU model and torch
    version: what an adapter init that decomposes every target weight (PiSSA, OLoRA) runs at start-up. Larger
    matrices run faster, so the estimate it gives errs long."""
    import torch

    def measure() -> float:
        size = 512
        matrix = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
        torch.linalg.svd(matrix, full_matrices=False)  # warm up
        start = time.perf_counter()
        torch.linalg.svd(matrix, full_matrices=False)
        return 12 * size**3 / max(time.perf_counter() - start, 1e-9)

    return float(stored("cpu_decomposition.json", f"{cpu_model_name()}|torch {torch.__version__}", measure)[0])


# -- what a training process holds before its model -----------------------------------------------------------


@once
def cpu_runtime_bytes(deepspeed: bool = False) -> int:
    """Peak RSS of a fresh process that imports the training stack and runs one toy LoRA step; with `deepspeed`,
    plus what importing DeepSpeed adds (only runs that use it import it).

    Measured once per set of library versions (a few seconds in a subprocess) and cached on disk.
    """
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    # "vmhwm": measured as the probe's own peak (earlier entries could hold a parent's peak); "no-deepspeed": the
    # probe unwraps its model as runs do, which no longer imports DeepSpeed into a run that does not use it
    key = "|".join(["vmhwm-no-deepspeed", sys.version.split()[0], sys.platform] + [ver(p) for p in (
        "torch", "transformers", "peft", "accelerate", "datasets", "bitsandbytes", "tokenizers", "deepspeed")])
    measured = stored("cpu_runtime.json", key, _measure_runtime)[0]
    return int(measured["peak_rss_bytes"] + (measured["deepspeed_bytes"] if deepspeed else 0))


def _measure_runtime() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "workbench.training.runtime_probe"], capture_output=True,
                            text=True, timeout=600, env=env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        raise RuntimeError(f"measuring the CPU runtime baseline failed: {result.stderr[-2000:]}")
    return json.loads(lines[-1])


@once
def flex_backward_error(heads: int, kv_heads: int, head_dim: int, dtype) -> str:
    """'' when a compiled FlexAttention forward + backward with a document mask runs on this GPU, else the error.
    Probed once per GPU, torch version, shape and dtype."""
    import torch

    key = f"{torch.cuda.get_device_name()}|torch {torch.__version__}|{heads}|{kv_heads}|{head_dim}|{dtype}"
    return stored("flex_attention.json", key, lambda: _probe_flex_backward(heads, kv_heads, head_dim, dtype))[0]


def _probe_flex_backward(heads: int, kv_heads: int, head_dim: int, dtype) -> str:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    try:
        block = 128  # FlexAttention's default block size (attention.FLEX_BLOCK): two documents of one block each
        length = 2 * block
        document = torch.arange(length, device="cuda") // block
        mask = create_block_mask(lambda b, h, q, kv: (document[q] == document[kv]) & (q >= kv), 1, 1, length, length,
                                 device="cuda")
        q = torch.randn(1, heads, length, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, length, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                for _ in range(2))
        torch.compile(flex_attention)(q, k, v, block_mask=mask, enable_gqa=heads != kv_heads).sum().backward()
        torch.cuda.synchronize()
        return ""
    except Exception as err:  # noqa: BLE001  any failure means: not on this GPU
        return f"FlexAttention's backward failed on this GPU: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
