"""A pipeline stage of a Llama-like causal LM: a contiguous run of its decoder layers, the embeddings before the
first stage's, the final norm after the last stage's.

torch.distributed.pipelining cannot trace the peft-wrapped model (`pipeline()` fails with a recursion error inside
the graph capture: measured, /work/research48.md §4), so each process builds the whole model, attaches the adapter
with the run's seed (the adapter then starts as one process's would), and keeps its own stage: `keep_stage` drops
the other stages' layers, and `StageModule` runs what the model's own forward runs for those layers (the causal
mask and the rotary position embeddings, computed from the position ids on every stage, as LlamaModel.forward
computes them). The other stages' modules stay in the model with empty parameters (no memory; not on the meta
device, whose modules transformers' train() refuses), so every parameter keeps its name and peft's save finds every LoRA layer: checkpoints, the saved adapter and the optimizer's groups
read the same names as in one process.

The stage builder knows models whose decoder is `model.embed_tokens`, `model.layers`, `model.rotary_emb` and
`model.norm` under a causal LM with an `lm_head`, and whose layers all use full causal attention (Llama, Qwen2/3
without sliding windows, Mistral without one, SmolLM); anything else is refused naming model.path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.base.errors import RecipeError, escaped
from workbench.data.tokens import IGNORE
from workbench.model.lm_loss import causal_lm_of, linear_cross_entropy_sum, plain_head
from workbench.spec.strategies import schedule_problem

PARTS = ("embed_tokens", "layers", "rotary_emb", "norm")


def layer_split(layers: int, stages: int) -> list[range]:
    """The decoder layers each stage holds: as even as they go, the earlier stages taking one more where the
    count does not divide (the first stage also embeds, the last also runs the norm and the head: the head's
    matmul over a large vocabulary usually outweighs a layer, so the remainder goes to the front)."""
    if stages < 1 or layers < stages:
        raise ValueError(f"{layers} decoder layers cannot make {stages} pipeline stages")
    base, extra = divmod(layers, stages)
    bounds = [0]
    for stage in range(stages):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def architecture_problem(causal_lm, model_path: str) -> str | None:
    """Why the stage builder cannot split this model (naming model.path), or None."""
    inner = getattr(causal_lm, "model", None)
    missing = [part for part in PARTS if not isinstance(getattr(inner, part, None), torch.nn.Module)]
    if not isinstance(getattr(causal_lm, "lm_head", None), torch.nn.Module):
        missing.append("lm_head")
    if missing or not isinstance(inner.layers, torch.nn.ModuleList):
        return (f"model.path: {escaped(model_path)} ({type(causal_lm).__name__}) is not a Llama-like decoder (no "
                f"{', '.join(missing) or 'layer list'}); strategy pp splits those only, use strategy fsdp")
    config = causal_lm.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "sliding_window", None) and getattr(
            config, "use_sliding_window", True):
        return (f"model.path: {escaped(model_path)} ({type(causal_lm).__name__}) has sliding-window layers, whose "
                "masks the pipeline stages do not build yet; use strategy fsdp")
    return None


def check_stages(model_path: str, layers: int, stages: int, micro_batches: int, schedule: str) -> None:
    """The refusals that need the process count and the model: one line naming the field."""
    if layers < stages:
        raise RecipeError(f"model.path: {escaped(model_path)} has {layers} decoder layers, fewer than the {stages} "
                          "pipeline stages (one a process); launch fewer processes")
    problem = schedule_problem(micro_batches, stages, schedule)
    if problem:
        raise RecipeError(problem)


def keep_stage(model, stage: int, stages: int, model_path: str = "the model") -> "StageModule":
    """Empty every parameter of the other stages' modules of `model` (peft-wrapped or not), frozen, and return
    this stage's module. The model keeps its whole structure (what peft's save walks to name the adapter's
    tensors) and every parameter its name; only this stage's hold memory and train."""
    causal_lm = causal_lm_of(model)
    problem = architecture_problem(causal_lm, model_path)
    if problem:
        raise RecipeError(problem)
    inner = causal_lm.model
    own = layer_split(len(inner.layers), stages)[stage]
    module = StageModule(causal_lm, own, stage == 0, stage == stages - 1)
    kept = {id(p) for p in module.parameters()}
    others = [layer for i, layer in enumerate(inner.layers) if i not in own]
    others += [part for part, held in ((inner.embed_tokens, module.first), (inner.norm, module.last),
                                       (causal_lm.lm_head, module.last)) if not held]
    for part in others:
        if any(id(p) in kept for p in part.parameters()):  # tied to a kept module (embeddings and head): stays
            continue
        for param in part.parameters():  # frozen and emptied: no memory (the model's device stays this stage's)
            param.requires_grad_(False)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return module


class StageModule(torch.nn.Module):
    """One stage's forward: (input ids on the first stage, else the previous stage's hidden states; position ids)
    → hidden states (after the final norm on the last stage; the head runs in the loss, `head_loss_sum`). It holds
    the modules this stage runs, shared with the model they stay in."""

    def __init__(self, causal_lm, layers: range, first: bool, last: bool):
        super().__init__()
        inner = causal_lm.model
        self.config = causal_lm.config
        self.layer_indices, self.first, self.last = layers, first, last
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.lm_head = causal_lm.lm_head if last else None  # (run by the loss)

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed_tokens(inputs) if self.first else inputs
        # as LlamaModel.forward: no padding mask (padding continues the row's last sample), no cache
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           position_ids=position_ids, cache=None, use_cache=False)
        return self.norm(hidden) if self.last else hidden


def head_loss_sum(causal_lm, hidden: torch.Tensor, labels: torch.Tensor, chunked: bool) -> torch.Tensor:
    """The summed next-token loss over the targets (labels pre-shifted) from the last stage's hidden states: the
    chunked head over target positions (training.fast_paths, workbench/model/lm_loss.py) where the head is a
    plain Linear, else the full logits, as the one-process loss computes it."""
    head = plain_head(causal_lm) if chunked else None
    if head is not None:
        return linear_cross_entropy_sum(hidden, head[1].weight, labels)
    logits = causal_lm.lm_head(hidden)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def padded(batch: dict, rows: int, width: int, pad_token_id: int) -> dict:
    """A micro-batch of `rows` x `width` tokens: a pipeline sends one activation shape through a step's
    micro-batches (its receive buffers are sized once), so every micro-batch of the step is padded to the step's
    widest, and a short one (the epoch's last) to the micro-batch size. Padding continues each row's last sample
    (no target, attends backwards only), and a padding row is one sample of its own: the real tokens' results do
    not change. Only the tensors a stage reads are kept."""
    ids, positions, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    have_rows, have_width = ids.shape
    if (have_rows, have_width) == (rows, width):
        return {"input_ids": ids, "position_ids": positions, "labels": labels}
    out = {"input_ids": torch.full((rows, width), pad_token_id, dtype=ids.dtype, device=ids.device),
           "labels": torch.full((rows, width), IGNORE, dtype=labels.dtype, device=labels.device),
           "position_ids": torch.arange(width, device=positions.device).repeat(rows, 1)}
    out["input_ids"][:have_rows, :have_width] = ids
    out["labels"][:have_rows, :have_width] = labels
    out["position_ids"][:have_rows, :have_width] = positions
    if have_width < width and have_width:  # the row's last sample continues into the padding
        out["position_ids"][:have_rows, have_width:] = (positions[:, -1:] + 1
                                                       + torch.arange(width - have_width, device=positions.device))
    return out
