"""Which precision a run computes in: the one decision that the loop, the estimator, the launcher and the UI read.

`auto` (the default of model.dtype, training.mixed_precision and quantization.compute_dtype) resolves
for the device that runs the recipe:

- a GPU with bf16 tensor cores: bf16 weights and bf16 autocast;
- an older GPU (T4, V100): fp16 autocast with loss scaling, fp16 frozen weights;
- a CPU: bf16 only where a bf16 matmul measurably beats an fp32 one on this CPU. CPUs with AVX-512 BF16
  or AMX run bf16 3-4x faster than fp32; AVX2-only CPUs have no bf16 kernel and run it about 50x SLOWER.
  The matmul probe decides (a fraction of a second, cached per CPU model and torch version).

An explicit choice is kept, but a bf16 choice on a CPU without native bf16 comes with a warning that
gives the measured factor and the override that fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workbench.hardware.current import local_kind
from workbench.hardware.probes import cpu_matmul_rates
from workbench.spec.model_configs import chunked_loss

if TYPE_CHECKING:
    from workbench.spec.model_configs import ModelInfo
    from workbench.spec.recipe import Recipe

AUTO = "auto"
# autocast mode -> the dtype of weights that go with it
DTYPE_OF = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}
MODE_OF = {dtype: mode for mode, dtype in DTYPE_OF.items()}
# On a CPU, bf16 must beat fp32 by this factor to be chosen (a probe on a busy machine reads noisy).
CPU_BF16_MIN_SPEEDUP = 1.2


@dataclass(frozen=True)
class DeviceHalf:
    """What a device computes natively: `half` is "bf16", "fp16" or None (fp32 is fastest), and why."""

    kind: str
    half: str | None
    reason: str
    bf16_slowdown: float | None = None  # CPUs: how many times slower a bf16 matmul runs than fp32


@dataclass(frozen=True)
class Precision:
    """A recipe's resolved precision on one device."""

    model_dtype: str
    mixed_precision: str
    compute_dtype: str | None  # quantized layers only
    reason: str
    warnings: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        return {"model_dtype": self.model_dtype, "mixed_precision": self.mixed_precision,
                "compute_dtype": self.compute_dtype, "precision_reason": self.reason}


def device_half(kind: str, bf16: bool | None = None) -> DeviceHalf:
    """The native half type of a device kind ("cuda" or "cpu"). `bf16` says what a planned GPU supports
    (a preset, for the estimator); None asks this machine's GPU, or measures this machine's CPU."""
    if kind == "cuda":
        if bf16 is None:
            import torch

            bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return (DeviceHalf("cuda", "bf16", "cuda: the GPU has bf16 tensor cores") if bf16 else
                DeviceHalf("cuda", "fp16", "cuda: no bf16 tensor cores, fp16 with loss scaling"))
    return cpu_half()


def cpu_half() -> DeviceHalf:
    """This CPU's native half type, from its matmul rates (measured once per process, or injected with
    LORA_WORKBENCH_MATMUL_RATES: workbench.hardware.probes.cpu_matmul_rates)."""
    bf16, fp32, source = cpu_matmul_rates()
    slowdown = fp32 / bf16 if bf16 > 0 else float("inf")
    rates = f"bf16 matmul {bf16:.3g} vs fp32 {fp32:.3g} GFLOP/s, {source}"
    if bf16 >= CPU_BF16_MIN_SPEEDUP * fp32:
        return DeviceHalf("cpu", "bf16", f"cpu: native bf16 ({rates})", slowdown)
    return DeviceHalf("cpu", None, f"cpu: no native bf16 ({rates})", slowdown)


def resolve(recipe: "Recipe", kind: str, bf16: bool | None = None) -> Precision:
    """The recipe's precision on a device of this kind ("cuda" or "cpu"); see the module's docstring.

    With one of model.dtype / training.mixed_precision set and the other `auto`, the other follows it;
    with both `auto`, both follow the device."""
    native = device_half(kind, bf16)
    model_dtype, mode = recipe.model.dtype, recipe.training.mixed_precision
    preferred = native.half or "no"
    reasons = []
    if mode == AUTO:
        mode = MODE_OF[model_dtype] if model_dtype in ("bfloat16", "float16") else preferred
        if kind == "cpu" and mode == "fp16":
            mode = preferred  # fp16 autocast is GPU-only; fp16 weights then compute in fp32 or bf16
        reasons.append(native.reason)
    if model_dtype == AUTO:
        model_dtype = DTYPE_OF[mode]
        if recipe.adapter.method == "full" and mode == "fp16":
            model_dtype = "float32"  # fp16 autocast trains fp32 master weights (the scaler refuses fp16 ones)
        if not reasons:
            reasons.append(f"model.dtype follows training.mixed_precision: {mode}")
    compute = None
    if recipe.quantization is not None:
        compute = recipe.quantization.compute_dtype
        if compute == AUTO:
            compute = DTYPE_OF[mode] if mode != "no" else "float32"
    reason = "; ".join(reasons) or "set in the recipe"
    return Precision(model_dtype, mode, compute, reason, tuple(_warnings(kind, native, model_dtype, mode, compute)))


def _warnings(kind: str, native: DeviceHalf, model_dtype: str, mode: str, compute: str | None) -> list[str]:
    if kind != "cpu" or native.half == "bf16":
        return []
    slow = [f"{name}: {value}" for name, value in (("model.dtype", model_dtype), ("training.mixed_precision", mode),
                                                   ("quantization.compute_dtype", compute))
            if value in ("bfloat16", "bf16")]
    if not slow:
        return []
    factor = f"about {native.bf16_slowdown:.0f}x slower" if native.bf16_slowdown else "slower"
    return [f"{', '.join(slow)} on this CPU runs {factor} than float32 ({native.reason}); "
            "set model.dtype=auto training.mixed_precision=auto (or float32 / no) to run at full speed"]


def apply(recipe: "Recipe", precision: Precision) -> "Recipe":
    """A copy of the recipe with its precision fields concrete (what a run saves and every part reads)."""
    values = {"model.dtype": precision.model_dtype, "training.mixed_precision": precision.mixed_precision}
    if precision.compute_dtype is not None:
        values["quantization.compute_dtype"] = precision.compute_dtype
    return recipe.override(**{key.replace(".", "__"): value for key, value in values.items()})


def resolve_recipe(recipe: "Recipe", kind: str, bf16: bool | None = None) -> tuple["Recipe", Precision]:
    """The recipe with its precision resolved for a device of this kind, and the decision."""
    precision = resolve(recipe, kind, bf16)
    return apply(recipe, precision), precision


def compute_dtype_of(recipe: "Recipe") -> str:
    """The dtype a resolved recipe's matmuls run in (what MFU and predicted throughput are measured against)."""
    mode = recipe.training.mixed_precision
    return DTYPE_OF[mode] if mode != "no" else recipe.model.dtype


def frozen_dtype_of(recipe: "Recipe") -> str:
    """The dtype of the frozen weights a quantized model keeps unquantized (embeddings, head, norms): the model
    dtype, as torchtune and unsloth keep them, or float32 with quantization.upcast_frozen (peft's k-bit
    preparation). RMSNorm and the loss upcast inside their computation, so 16-bit storage costs no accuracy."""
    quantization = recipe.quantization
    if recipe.adapter.method == "qlora" and quantization is not None and quantization.upcast_frozen:
        return "float32"
    return recipe.model.dtype


def vocabulary_dtype_of(recipe: "Recipe", stored_dtype: str | None) -> str:
    """The dtype a run keeps its frozen input embeddings (and head) in. As frozen_dtype_of, except where a QLoRA
    model computes in float32 (a CPU without native bf16): then a 16-bit checkpoint's vocabulary stays 16-bit,
    as published. Its lookups are cast up (exact) and the chunked loss casts the head a slice of the vocabulary
    at a time (lm_loss), so the largest frozen tensors of a Llama 3 model take half the memory (0.5 GB of
    bench:llama3-1b's 1.8 GB) and compute exactly what they did. Only where that loss stands in for the head:
    SFT with the fast paths, and 4-bit storage in uint8 (no sharded layout). `stored_dtype`: what the local
    checkpoint files hold the vocabulary in (model_configs.stored_vocabulary_dtype), None when unknown."""
    frozen = frozen_dtype_of(recipe)
    quantization = recipe.quantization
    if (recipe.adapter.method == "qlora" and quantization is not None and not quantization.upcast_frozen
            and quantization.quant_storage == "uint8" and frozen == "float32"
            and stored_dtype in ("bfloat16", "float16") and recipe.training.fast_paths
            and recipe.training.objective_spec.next_token_loss):
        return stored_dtype
    return frozen


def vocabulary_dtype(recipe: "Recipe", info: "ModelInfo") -> str:
    """What the run keeps its embeddings and head in (models.prepare_quantized applies it, the estimator counts
    it): vocabulary_dtype_of only where the chunked loss stands in for the head (not with LoRA on the head)."""
    if chunked_loss(recipe, info):
        return vocabulary_dtype_of(recipe, info.vocabulary_stored_dtype)
    return frozen_dtype_of(recipe)


def concrete(recipe: "Recipe") -> "Recipe":
    """The recipe itself when no precision field says `auto`, else resolved for this machine's device."""
    quantization = recipe.quantization
    if AUTO not in (recipe.model.dtype, recipe.training.mixed_precision,
                    quantization.compute_dtype if quantization is not None else None):
        return recipe
    return resolve_recipe(recipe, local_kind())[0]

