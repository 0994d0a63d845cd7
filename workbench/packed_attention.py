"""Attention for packed sequences on a CPU: each sample attends to itself only, computed sample by sample.

A packed row holds several samples whose positions restart at 0. With `sdpa`, transformers turns that into
a block-diagonal (row × row) mask, and PyTorch's CPU kernel then does the work of the whole row, masked
or not. CPUs have no variable-length attention kernel, so this runs one causal attention per sample:
the forward through PyTorch's fused CPU kernel (it skips the causal upper half), the backward as plain
matmuls over each sample's own (n × n) scores, recomputed from q and k as a fused kernel would. The
work then grows with the sum of the squared sample lengths, not with the square of the row length.

`use_packed_attention(model)` switches a transformers model from `sdpa` to this implementation; batches
with a padding mask, a KV cache (generation), attention dropout or another device take the ordinary
`sdpa` path unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "sdpa_packed"
_last_spans: tuple[torch.Tensor | None, list] = (None, [])  # every layer of a forward sees the same position_ids


def use_packed_attention(model) -> bool:
    """Register the implementation and select it on models that run `sdpa`; True when switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, packed_mask)
    model.set_attn_implementation(NAME)
    return True


def packed_mask(*, attention_mask=None, device="cpu", **kwargs):
    """No (row × row) mask on a CPU when nothing is padded: the attention reads the samples from position_ids."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and torch.device(device).type == "cpu":
        return None
    return sdpa_mask(attention_mask=attention_mask, device=device, **kwargs)


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     position_ids=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    per_sample = (attention_mask is None and position_ids is not None and query.device.type == "cpu"
                  and query.shape[2] == key.shape[2] and dropout == 0.0 and getattr(module, "is_causal", True)
                  and is_causal is not False)
    if not per_sample:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, position_ids=position_ids, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = PerSampleAttention.apply(query, key, value, sample_spans(position_ids, query.shape[0]), scale)
    return out.transpose(1, 2).contiguous(), None


def sample_spans(position_ids: torch.Tensor, batch: int) -> list[list[tuple[int, int]]]:
    """(start, end) of each sample in each row: a sample starts wherever the position does not continue."""
    global _last_spans
    if _last_spans[0] is position_ids:
        return _last_spans[1]
    positions = position_ids.expand(batch, -1).cpu()
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    length = positions.shape[1]
    spans = []
    for row in starts:
        edges = row.nonzero().flatten().tolist() + [length]
        spans.append(list(zip(edges[:-1], edges[1:])))
    _last_spans = (position_ids, spans)
    return spans


class PerSampleAttention(torch.autograd.Function):
    """Causal attention within each span of each row. q: (B, H, L, D); k, v: (B, KV, L, D), H a multiple of KV."""

    @staticmethod
    def forward(ctx, query, key, value, spans, scale: float):
        out = torch.empty_like(query)
        gqa = query.shape[1] != key.shape[1]
        for b, row in enumerate(spans):
            for start, end in row:
                out[b:b + 1, :, start:end] = F.scaled_dot_product_attention(
                    query[b:b + 1, :, start:end], key[b:b + 1, :, start:end], value[b:b + 1, :, start:end],
                    is_causal=True, scale=scale, enable_gqa=gqa)
        ctx.save_for_backward(query, key, value, out)
        ctx.spans, ctx.scale = spans, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out = ctx.saved_tensors
        # q, k, v may differ in dtype (autocast fed SDPA; 8-bit layers return float32): compute in q's
        dtype = query.dtype
        grads = [torch.zeros_like(t) if needed else None
                 for t, needed in zip((query, key, value), ctx.needs_input_grad[:3])]
        for b, row in enumerate(ctx.spans):
            for start, end in row:
                pieces = [t[b, :, start:end].to(dtype) for t in (query, key, value, out, grad_out)]
                for grad, piece in zip(grads, _span_backward(*pieces, ctx.scale)):
                    if grad is not None:
                        grad[b, :, start:end] = piece
        return (*grads, None, None)


def _span_backward(q, k, v, o, grad_o, scale: float):
    """Gradients of causal softmax attention for one sample, scores recomputed. q, o: (H, n, D); k, v: (KV, n, D)."""
    heads, n, _ = q.shape
    group = heads // k.shape[0]
    k_h, v_h = (t.repeat_interleave(group, dim=0) if group > 1 else t for t in (k, v))
    scores = (q @ k_h.transpose(1, 2)).float().mul_(scale)
    scores.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    del scores
    grad_v = probs.to(q.dtype).transpose(1, 2) @ grad_o
    delta = (grad_o.float() * o.float()).sum(-1, keepdim=True)  # rowsum(dO ∘ O) = rowsum(P ∘ dP)
    grad_probs = (grad_o @ v_h.transpose(1, 2)).float()
    grad_scores = probs.mul_(grad_probs.sub_(delta)).to(q.dtype)  # dS = P ∘ (dP - delta), in P's memory
    grad_q = (grad_scores @ k_h).mul_(scale)
    grad_k = (grad_scores.transpose(1, 2) @ q).mul_(scale)
    if group > 1:
        grad_k = grad_k.view(k.shape[0], group, n, -1).sum(1)
        grad_v = grad_v.view(k.shape[0], group, n, -1).sum(1)
    return grad_q, grad_k, grad_v
