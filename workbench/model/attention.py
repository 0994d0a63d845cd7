"""Which attention kernel a run uses: decided here, read by the loop, the estimator, the UI and the docs.

Packing puts several samples in one row, each attending only to itself. How that is computed decides
both speed and memory:

- `flex_attention` (PyTorch's FlexAttention, no extra package): transformers finds the samples from
  `position_ids` and builds a block-sparse document mask; blocks outside every sample are skipped and
  the mask costs a few bytes per 128×128 block. The default for packed rows on a GPU.
- `flash_attention_2` (the `flash-attn` package): the variable-length kernel, given each sample's start
  from `position_ids`; no mask at all. Chosen when the recipe asks for it.
- `sdpa`: on a GPU, transformers turns packed rows into a dense (row × row) block-diagonal mask, which
  rules out the flash kernels and costs memory quadratic in the row length. On a CPU the workbench's own
  per-sample path (workbench/model/packed_attention.py) replaces it, so `sdpa` is the CPU choice.
- `eager`: the reference implementation; a dense mask and (heads × row × row) probabilities per layer.

`model.attn: auto` (the default) picks FlexAttention for packed rows on a GPU and `sdpa` everywhere else.
A kernel that cannot train on the device is refused before anything loads.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

from workbench.base.errors import RecipeError
from workbench.hardware.current import local_kind
from workbench.hardware.precision import compute_dtype_of
from workbench.hardware.probes import flex_backward_error
from workbench.spec.formats import format_of

AUTO = "auto"
FLEX_BLOCK = 128  # FlexAttention's default block size: the document mask has one entry per block pair


@dataclass(frozen=True)
class Attention:
    implementation: str  # what transformers is given as attn_implementation
    packed_rows: str  # how a packed row's samples are kept apart: see packed_rows_of()
    reason: str

    def to_json(self) -> dict:
        return {"attention": self.implementation, "attention_packed_rows": self.packed_rows,
                "attention_reason": self.reason}


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flex_attention_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def resolve(recipe, device_kind: str, here: bool = True, flex_problem: str | None = None) -> Attention:
    """The kernel a run of `recipe` uses on a device of this kind ("cpu" or "cuda"), or RecipeError naming
    model.attn when the one asked for cannot train there. here=False (an estimate for another machine): the
    packages installed in this process are not checked. flex_problem: why FlexAttention cannot serve this model
    here (flex_problem_for_run), named in the reason."""
    asked, packing, gpu = recipe.model.attn, recipe.data.several_samples_per_row, device_kind == "cuda"
    if asked == AUTO:
        if gpu and packing and not flex_attention_available():
            flex_problem = "this torch has no FlexAttention"
        if gpu and packing and flex_problem is None:
            implementation, why = "flex_attention", "auto: packed rows on a GPU take FlexAttention's document mask"
        elif gpu and packing:
            implementation, why = "sdpa", f"auto: {flex_problem}; sdpa"
        else:
            implementation, why = "sdpa", f"auto: sdpa on {'a GPU without packing' if gpu else 'a CPU'}"
    else:
        implementation, why = asked, "model.attn"
        check_trainable(implementation, device_kind, here)
    return Attention(implementation, packed_rows_of(implementation, device_kind, recipe), why)


def flex_problem_for_run(recipe, model_config, device_kind: str) -> str | None:
    """Why `auto` should not give this run's packed rows to FlexAttention (None: it may, or it is not asked)."""
    if recipe.model.attn != AUTO or device_kind != "cuda" or not recipe.data.several_samples_per_row:
        return None
    import torch

    return flex_unavailable(model_config, getattr(torch, compute_dtype_of(recipe)))


def flex_unavailable(model_config, dtype) -> str | None:
    """Why `auto` should not use FlexAttention for this model in this process, or None. Its transformers class
    must support it (GPT-2, Falcon and remote-code models do not), and on a GPU a forward and backward of this
    model's head shape must run: some GPUs lack the shared memory Triton's backward kernel wants for some head
    sizes. Probed once per GPU, torch version, shape and dtype; the answer is cached on disk."""
    if not model_class_runs_flex(model_config):
        return f"{type(model_config).__name__.replace('Config', '')} has no FlexAttention in transformers"
    if local_kind() != "cuda":
        return None
    text = model_config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return flex_backward_error(heads, kv_heads, head_dim, dtype) or None


def model_class_runs_flex(model_config) -> bool:
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(model_config)]
    except (KeyError, ValueError):  # remote code or an unknown model: stay with sdpa
        return False
    return bool(getattr(cls, "_supports_flex_attn", False))


def check_trainable(implementation: str, device_kind: str, here: bool = True) -> None:
    if implementation == "flash_attention_2":
        if device_kind != "cuda":
            raise RecipeError("model.attn: flash_attention_2 runs on CUDA GPUs only; use auto or sdpa here")
        if here and not flash_attn_installed():
            raise RecipeError("model.attn: flash_attention_2 needs the flash-attn package (pip install flash-attn "
                              "--no-build-isolation); or use auto (FlexAttention for packed rows, no package)")
    if implementation == "flex_attention":
        if not flex_attention_available():
            raise RecipeError("model.attn: flex_attention needs torch >= 2.5; use auto or sdpa")
        if device_kind != "cuda":
            raise RecipeError("model.attn: flex_attention has no backward on a CPU in PyTorch, so it cannot train "
                              "here; use auto (per-sample attention for packed rows on a CPU) or sdpa")


def packed_rows_of(implementation: str, device_kind: str, recipe) -> str:
    """'none' (no packing), 'per_sample' (the CPU path), 'document_mask' (flex), 'varlen' (flash) or
    'dense_mask' (sdpa or eager on a GPU, or on a CPU without the fast paths)."""
    if not recipe.data.several_samples_per_row:
        return "none"
    if implementation == "flex_attention":
        return "document_mask"
    if implementation == "flash_attention_2":
        return "varlen"
    if implementation == "sdpa" and device_kind == "cpu" and recipe.training.fast_paths:
        return "per_sample"
    return "dense_mask"


def shares_prompts(attention: Attention, recipe, model_config) -> bool:
    """Whether each preference pair (or unpaired row: its answer and KTO's mismatched one) holds its prompt once,
    the second answer continuing it (workbench/data/pipeline.py: shared_prompt_layout), which spares the prompt's second pass through every layer in the policy's forward
    and backward and the reference's forward. Only the CPU's per-sample attention reads a shared prompt from
    position_ids; FlexAttention's document mask, flash's varlen and dense masks would cut the answer off it.
    Without dropout only: two whole sequences draw their dropout over the prompt independently, a shared prompt
    draws it once for both answers, which would change the pair's loss (TRL's DPO switches dropout off too)."""
    return (attention.packed_rows == "per_sample" and format_of(recipe.data.format).sequences_per_example > 1
            and recipe.adapter.dropout == 0 and not model_drops_out(model_config))


def model_drops_out(model_config) -> bool:
    """Whether the model's own layers draw dropout in training: any dropout rate of its config above 0
    (`attention_dropout`, `hidden_dropout`, GPT-2's `attn_pdrop` ...; classification and summary heads aside)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return any(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
               for name, value in text.to_dict().items()
               if ("dropout" in name or "pdrop" in name) and not name.startswith(("classifier", "summary")))


def dense_mask_warning(attention: Attention, device_kind: str) -> str | None:
    if attention.packed_rows == "dense_mask" and device_kind == "cuda":
        return (f"model.attn: {attention.implementation} with packed rows on a GPU builds a dense (row × row) mask "
                "per batch, which rules out the flash kernels and grows with the square of data.max_seq_len; "
                "model.attn: auto uses FlexAttention's document mask instead")
    return None


def mask_bytes(attention: Attention, rows: int, length: int, compute_bytes: int, layers_kept: int) -> int:
    """Memory of one micro-batch's attention mask. A dense mask is bool (rows × L × L), built once per forward;
    SDPA turns it into a float bias of the compute dtype at every layer and keeps each for backward (layers_kept:
    all layers, or one under gradient checkpointing); eager adds one float mask. FlexAttention's block mask holds
    a few int32 per block pair."""
    dense = rows * length * length
    if attention.packed_rows == "dense_mask":
        if attention.implementation == "eager":
            return dense * compute_bytes
        return dense + dense * compute_bytes * layers_kept
    if attention.packed_rows == "document_mask":
        blocks = math.ceil(length / FLEX_BLOCK)
        return rows * 4 * 4 * blocks * blocks  # kv counts and indices, full and partial, for one direction
    return 0


def with_implementation(recipe, device_kind: str, here: bool = True, flex_problem: str | None = None):
    """The recipe with model.attn resolved for this device, and the decision (a concrete attn stays as is)."""
    attention = resolve(recipe, device_kind, here, flex_problem)
    return recipe.override(model__attn=attention.implementation), attention
