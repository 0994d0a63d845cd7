"""What a run measures: real tokens/s, peak memory, model FLOPs and MFU, and the JSONL metric log."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from functools import lru_cache
from pathlib import Path

import torch

from .models import full_numel

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets, matched on the device name.
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


def peak_rss_bytes() -> int:
    """This process's peak resident memory.

    Linux keeps ru_maxrss across exec, so a child of a large process (a test runner, a launcher)
    would report its parent's peak; VmHWM belongs to the process's own address space.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB elsewhere


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """(peak MB, what was measured): max allocated on a GPU, process peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return peak_rss_bytes() / 2**20, "cpu_peak_rss"


def matmul_flops(model) -> int:
    """Weights that take part in a matmul per token: every Linear (LoRA factors and lm_head included)."""
    total = 0
    for module in model.modules():
        # PEFT wrappers expose their base layer's weight as their own: count the base layer once
        if isinstance(module, torch.nn.Embedding) or hasattr(module, "base_layer"):
            continue
        weight = getattr(module, "weight", None)
        shape = getattr(weight, "ds_shape", getattr(weight, "shape", ()))  # ZeRO-3 keeps the full shape aside
        if isinstance(weight, torch.Tensor) and len(shape) == 2 and "Linear" in type(module).__name__:
            total += full_numel(weight)
    return total


class FlopCounter:
    """Model FLOPs of training steps (no recomputation counted: that makes it MFU, not HFU).

    Per token: forward 2·W, backward through the activations 2·W, weight gradients 2·T
    (W = matmul weights, T = trainable matmul weights; full fine-tuning gives the usual 6·W).
    Attention adds 12·layers·width per attended position (QKᵀ and AV, forward and backward),
    counted from the real, causal, per-sample positions of each batch.
    """

    def __init__(self, model, config):
        self.weights = matmul_flops(model)
        trainable = sum(full_numel(p) for p in model.parameters()
                        if p.requires_grad and len(getattr(p, "ds_shape", p.shape)) == 2)
        self.trainable = min(trainable, self.weights)
        layers = getattr(config, "num_hidden_layers", 0)
        heads = getattr(config, "num_attention_heads", 0) or 1
        head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
        width = heads * head_dim
        self.attention_per_position = 12 * layers * width

    def step_flops(self, tokens: int, attended_positions: int, reference_forward: bool = False) -> float:
        """reference_forward: one more forward without gradients (DPO's reference log-probabilities)."""
        flops = (4 * self.weights + 2 * self.trainable) * tokens + self.attention_per_position * attended_positions
        if reference_forward:
            flops += 2 * self.weights * tokens + self.attention_per_position / 3 * attended_positions
        return float(flops)


@lru_cache(maxsize=None)
def peak_flops(device_type: str, dtype_name: str, threads: int) -> tuple[float, str]:
    """(peak FLOP/s, where it came from): a data-sheet figure on known GPUs, else a matmul probe."""
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return flops, f"datasheet:{key}"
    measured = _matmul_probe(device_type, getattr(torch, dtype_name))
    best = _best_seen(f"{device_type}|{dtype_name}|{threads}|{cpu_model_name()}", measured)
    return best, f"probe:{dtype_name}:{threads}threads"


def cpu_model_name() -> str:
    """The CPU's model and the flags that decide its matmul speed per dtype ("AMD EPYC" alone names CPUs
    with and without bf16 kernels): the key of every per-CPU measurement the project caches."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    speed_flags = sorted(f for f in flags if "bf16" in f or "amx" in f or f in ("avx512f", "avx2", "fp16", "sve"))
    return " ".join([model, *speed_flags]).strip()


def _best_seen(key: str, measured: float) -> float:
    """The highest probe result seen on this machine: a peak is a property of the hardware, and a
    probe that shares the cores with another busy thread only ever reads low."""
    from .builtin import read_cache_json, write_cache_json

    seen = read_cache_json("matmul_peak.json")
    if measured <= seen.get(key, 0.0):
        return float(seen[key])
    try:
        write_cache_json("matmul_peak.json", {**seen, key: measured})
    except OSError:
        pass  # a read-only cache costs accuracy, never the run
    return measured


def _matmul_probe(device_type: str, dtype: torch.dtype, size: int = 1024, seconds: float = 0.5) -> float:
    device = torch.device(device_type)
    # its own generator: the probe may run mid-training (or right after a resume restored the RNG)
    # and must not move the global RNG that dropout draws from
    generator = torch.Generator(device=device).manual_seed(0)
    if device_type == "cpu" and dtype != torch.float32:
        from .precision import cpu_half

        if cpu_half().half is None:  # no native kernel (bf16 on AVX2): a 1024 matmul alone takes seconds
            size = 256
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    torch.matmul(a, b)  # warm up kernels and caches
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if device_type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(4):
            torch.matmul(a, b)
        if device_type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - start))
    return best


class MetricsWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the line being written."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = path
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows the interrupted run wrote after the checkpoint it resumes from."""
        if not (self.enabled and self.path.exists()):
            return
        keep = [json.dumps(row) for row in read_metrics(self.path) if row.get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        from .runs import finite_json

        with self.path.open("a") as handle:
            handle.write(json.dumps(finite_json(row), allow_nan=False) + "\n")
            handle.flush()


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line from a killed run
        if isinstance(row, dict):  # a hand-edited file may hold anything else
            rows.append(row)
    return rows
