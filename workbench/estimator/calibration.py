"""How far the estimate has been from measured peaks, per kind of layout: the spread every figure is read with.

An estimate is one number; what a run measures has been between `low` and `high` times it, on the runs listed
(measured / estimate, per device). The estimator reports each layout's figure with that range, and the planner
its limits at the high end too (what fits even if this run lands where the worst measured one did). The ranges
are recomputed by the tests from the same runs (tests/test_memory.py: the published table, the GPU check, the CPU
calibration): a change of the estimator that moves a run outside its family's range fails there until the range,
or the estimator, is put right. docs/estimator.md holds the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.spec.strategies import Layout


@dataclass(frozen=True)
class Spread:
    low: float  # measured / estimate, the lowest seen
    high: float  # the highest seen
    runs: str  # which runs, in a few words

    def to_json(self) -> dict:
        return {"low": self.low, "high": self.high, "runs": self.runs}


SPREADS = {
    "cpu": Spread(0.95, 1.30, "2-core CPUs: single (7 runs, tiny and SmolLM2-135M; SmolLM2 in float32, on CPUs "
                              "without native bf16, up to 1.30), ddp and fsdp on 2 and 4 processes (SmolLM2-135M, "
                              "bench/layouts_cpu.py)"),
    "cpu_deepspeed": Spread(1.15, 1.25, "2-core CPU: ZeRO-3 on 2 processes (SmolLM2-135M, bench/layouts_cpu.py); "
                                        "the estimate does not yet name 0.4-0.6 GB DeepSpeed keeps per process"),
    "gpu_replicated": Spread(0.78, 1.04, "one GPU: torchtune's Llama 3.1 8B LoRA and QLoRA, the QLoRA paper's 65B "
                                         "bound, the 1.24B GPU check on an H200 (5 rows)"),
    "gpu_sharded": Spread(0.87, 1.21, "2 GPUs: Answer.AI's Llama-2-7B LoRA and QLoRA under FSDP (4 runs), PEFT's "
                                      "Llama-2-70B QLoRA under FSDP and under ZeRO-3"),
    "gpu_offload": Spread(0.96, 1.60, "2 GPUs, FSDP with CPU offload: Answer.AI's Llama-2-7B and 70B QLoRA, PEFT's "
                                      "Llama-2-70B QLoRA"),
}


def family(layout: Layout, device_kind: str) -> str:
    """Which spread a layout's figure on this kind of device is read with."""
    if device_kind == "cpu":
        return "cpu_deepspeed" if layout.strategy == "deepspeed" else "cpu"
    if "weights" in layout.offloads:  # (an optimizer offloaded alone is read as its layout without it)
        return "gpu_offload"
    return "gpu_sharded" if layout.shards_weights else "gpu_replicated"


def spread_of(layout: Layout, device_kind: str) -> Spread:
    return SPREADS[family(layout, device_kind)]
