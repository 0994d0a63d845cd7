"""Next-token loss without the full logits: the LM head runs over target positions only, a chunk at a time.

A batch of B·L positions and a vocabulary of V words makes B·L·V logits; upcast to float32 for a stable
softmax, kept for backward and matched by a gradient of the same size, they are the largest tensors of a
LoRA step on a small model (1,024 positions × 49,152 words: about 0.8 GB). Here the head sees only the
positions that have a target (prompt tokens of an instruction set carry no loss, so the head's work
shrinks with them), a chunk of rows at a time, and each chunk's gradient with respect to the hidden
states is computed at once, so nothing of size V outlives its chunk.

Models whose head is not a plain bias-free `nn.Linear` used as is (LoRA on the head, 4-bit heads,
sharded FSDP/ZeRO-3 weights, logit scaling or soft-capping) take the ordinary full-logits path.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from workbench.data.tokens import IGNORE
CHUNK_ELEMENTS = 1 << 23  # logits per chunk: 32 MB in float32, whatever the vocabulary
# config fields by which some models scale or cap their logits after the head (the chunked path does not)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")


def lm_loss_sum(model, batch: dict) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's target tokens (labels are pre-shifted)."""
    causal_lm = causal_lm_of(model)
    head = plain_head(causal_lm)
    if head is None:
        return full_logits_loss_sum(model, batch)
    name, module = head
    with head_bypassed(causal_lm, name) as passthrough:
        hidden = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return linear_cross_entropy_sum(hidden, module.weight, batch["labels"], passthrough.autocast_dtype)


def full_logits_loss_sum(model, batch: dict) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE,
                           reduction="sum")


def causal_lm_of(model):
    """The transformers causal LM inside accelerate/DDP, torch.compile and PEFT wrappers."""
    while True:
        if isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile
            model = model._orig_mod
        elif hasattr(model, "get_base_model"):  # PEFT
            model = model.get_base_model()
        else:
            return model


def plain_head(causal_lm) -> tuple[str, torch.nn.Linear] | None:
    """(attribute name, module) of the output head when the chunked path can stand in for it, else None."""
    get_head = getattr(causal_lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not torch.nn.Linear or head.bias is not None:  # exactly Linear: not LoRA, not 4-bit
        return None
    weight = head.weight
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or hasattr(weight, "ds_id") or weight.dim() != 2:
        return None  # FSDP2 DTensor, ZeRO-3 partition
    config = getattr(causal_lm, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(text_config, field, None) is not None for field in LOGIT_TRANSFORMS):
        return None
    name = next((n for n, child in causal_lm.named_children() if child is head), None)
    return (name, head) if name is not None else None


class HiddenPassthrough(torch.nn.Module):
    """Stands in for the head: returns the hidden states and notes the autocast dtype the head would have run in
    (accelerate applies autocast inside the model's forward only, not around the loss)."""

    autocast_dtype: torch.dtype | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        device = hidden.device.type
        self.autocast_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return hidden


@contextmanager
def head_bypassed(causal_lm, name: str):
    """The model's forward returns its final hidden states in place of logits."""
    head, passthrough = getattr(causal_lm, name), HiddenPassthrough()
    setattr(causal_lm, name, passthrough)
    try:
        yield passthrough
    finally:
        setattr(causal_lm, name, head)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """sum over targets of cross_entropy(hidden @ weight.T, label), never holding more than a chunk of logits.
    The head's matmul runs in `compute_dtype` (default: the autocast dtype if autocast is on, else hidden's)."""
    flat = hidden.flatten(0, -2)
    targets = labels.flatten()
    valid = targets != IGNORE
    if flat.device.type == "cpu":  # compact: no work for prompt positions (no device to keep in flight)
        rows = valid.nonzero().squeeze(1)
        flat, targets, valid = flat.index_select(0, rows), targets.index_select(0, rows), None
    else:  # accelerators: keep every position, no host sync for the count
        targets = targets.clamp(min=0)
    device = flat.device.type
    if compute_dtype is None:
        compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else flat.dtype
    chunk = max(64, CHUNK_ELEMENTS // weight.shape[0])
    return _LinearCrossEntropySum.apply(flat, weight, targets, valid, chunk, compute_dtype)


class _LinearCrossEntropySum(torch.autograd.Function):
    """Forward computes the loss and, chunk by chunk, its gradients; backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, valid, chunk: int, compute_dtype):
        needs_hidden, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if weight.dtype != compute_dtype and compute_dtype == torch.float32 and not needs_weight:
            total, grad_hidden = _sliced_vocabulary(hidden, weight, targets, valid, needs_hidden)
            ctx.save_for_backward(grad_hidden, None)
            ctx.weight_dtype = weight.dtype
            return total
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            for start in range(0, hidden.shape[0], chunk):
                h = hidden[start:start + chunk].to(compute_dtype)
                t = targets[start:start + chunk]
                keep = None if valid is None else valid[start:start + chunk]
                # softmax in place, in float32, one chunk of logits alive at a time
                logits = (h @ w.t()).float()
                target_logits = logits.gather(1, t[:, None]).squeeze(1)
                peak = logits.amax(dim=-1, keepdim=True)
                sums = logits.sub_(peak).exp_().sum(dim=-1, keepdim=True)
                losses = (peak + sums.log()).squeeze(1) - target_logits
                total += (losses if keep is None else losses * keep).sum()
                if not (needs_hidden or needs_weight):
                    continue
                grad = logits.div_(sums)  # d loss / d logits = softmax - one_hot(target)
                grad[torch.arange(t.shape[0], device=t.device), t] -= 1
                if keep is not None:
                    grad *= keep[:, None]
                grad = grad.to(compute_dtype)
                if needs_hidden:
                    grad_hidden[start:start + chunk] = grad @ w
                if needs_weight:
                    grad_weight.addmm_(grad.t().float(), h.float())
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _sliced_vocabulary(hidden, weight, targets, valid, needs_hidden: bool):
    """The loss sum and its gradient for a frozen 16-bit head computed in float32, casting the head a slice of
    the vocabulary at a time (precision.vocabulary_dtype_of): all rows at once, the softmax kept online (a
    running maximum, the sum of exponentials and the probability-weighted sum of head rows, rescaled as the
    maximum grows), so neither a float32 copy of the head nor a row of logits as wide as the vocabulary is
    ever held. The same two matmuls per slice as the row-chunked path does per chunk."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    with torch.autocast(hidden.device.type, enabled=False):
        h = hidden.float()
        step = max(1, CHUNK_ELEMENTS // max(rows, weight.shape[1]))
        running_max = torch.full((rows,), float("-inf"), device=h.device)
        sums = torch.zeros(rows, device=h.device)
        target_logits = torch.zeros(rows, device=h.device)
        weighted = torch.zeros_like(h) if needs_hidden else None  # sum of exp(logit - max) * head row
        for start in range(0, vocab, step):
            w = weight[start:start + step].float()
            logits = h @ w.t()
            local = targets - start
            inside = (local >= 0) & (local < w.shape[0])
            picked = logits.gather(1, local.clamp(0, w.shape[0] - 1)[:, None]).squeeze(1)
            target_logits += torch.where(inside, picked, 0.0)
            new_max = torch.maximum(running_max, logits.amax(dim=1))
            rescale = torch.exp(running_max - new_max)
            probs = logits.sub_(new_max[:, None]).exp_()
            sums = sums * rescale + probs.sum(dim=1)
            if needs_hidden:
                weighted = weighted * rescale[:, None] + probs @ w
            running_max = new_max
        losses = running_max + sums.log() - target_logits
        grad_hidden = None
        if needs_hidden:  # d loss / d hidden = softmax @ W - W[target]
            grad_hidden = weighted / sums[:, None] - weight.index_select(0, targets).float()
            if valid is not None:
                grad_hidden *= valid[:, None]
            grad_hidden = grad_hidden.to(hidden.dtype)
    total = (losses if valid is None else losses * valid).sum()
    return total, grad_hidden
