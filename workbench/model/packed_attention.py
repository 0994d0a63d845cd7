"""Attention for packed sequences on a CPU: each sample attends to itself only, computed sample by sample.

A packed row holds several samples whose positions restart at 0. With `sdpa`, transformers turns that into
a block-diagonal (row × row) mask, and PyTorch's CPU kernel then does the work of the whole row, masked
or not. CPUs have no variable-length attention kernel, so this runs one causal attention per sample:
the forward through PyTorch's fused CPU kernel (it skips the causal upper half), the backward as plain
matmuls over each sample's own (n × n) scores, recomputed from q and k as a fused kernel would. The
work then grows with the sum of the squared sample lengths, not with the square of the row length.

A sample whose positions do not start at 0 continues a prompt it shares with the row's last sample that did
(a preference pair keeps one copy of its prompt: [prompt, chosen] then [rejected] with positions continuing
the prompt, see workbench/data/pipeline.py): it attends to that sample's first tokens as to its own earlier ones.

Per-sample attention pays a fixed cost per sample (a kernel call and its backward), so rows of many very
short samples can be cheaper as one masked attention over the whole row. A cost model measured on this
machine (`AttentionCosts`: per-call and per-score costs of both paths, timed once per shape, dtype and
thread count and cached on disk) picks the cheaper path for each batch. LORA_WORKBENCH_PACKED_ATTENTION=
per_sample|masked forces one.

`use_packed_attention(model)` switches a transformers model from `sdpa` to this implementation; batches
with a padding mask, a KV cache (generation) or another device take the ordinary `sdpa` path unchanged.
Attention dropout, and a sliding window shorter than a sample (Mistral, Gemma 3, Phi-3), take the masked path
with the dropout and the window applied.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from workbench.data.batches import sample_starts
from workbench.hardware.current import cpu_model_name
from workbench.hardware.probes import measured, once, stored

NAME = "sdpa_packed"
FORCE_ENV = "LORA_WORKBENCH_PACKED_ATTENTION"
_last_spans: tuple[torch.Tensor | None, list] = (None, [])  # every layer of a forward sees the same position_ids
_last_mask: tuple[torch.Tensor | None, dict] = (None, {})  # masks by sliding window, for the last position_ids


def use_packed_attention(model, compute_dtype: torch.dtype | None = None) -> bool:
    """Register the implementation and select it on models that run `sdpa`; True when switched. With the
    dtype attention will compute in, the cost model is measured now (never inside a forward)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, packed_mask)
    model.set_attn_implementation(NAME)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if compute_dtype is not None and model.device.type == "cpu":
        attention_costs(heads, getattr(config, "num_key_value_heads", None) or heads, head_dim, compute_dtype)
    return True


def packed_mask(*, attention_mask=None, device="cpu", **kwargs):
    """No (row × row) mask on a CPU when nothing is padded: the attention reads the samples from position_ids."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and torch.device(device).type == "cpu":
        return None
    return sdpa_mask(attention_mask=attention_mask, device=device, **kwargs)


@torch.compiler.disable  # per-batch Python decisions and caches: run eagerly inside a compiled layer
def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     position_ids=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # most models hand each layer's window in (None on global layers); a few only set it on the module
    sliding_window = kwargs.pop("sliding_window", getattr(module, "sliding_window", None))

    own = (attention_mask is None and position_ids is not None and query.device.type == "cpu"
           and query.shape[2] == key.shape[2] and getattr(module, "is_causal", True) and is_causal is not False)
    if not own:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, position_ids=position_ids, sliding_window=sliding_window,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    spans = sample_spans(position_ids, query.shape[0])
    # attention dropout, and a sliding window that a sample outgrows, need the mask: the per-sample kernel has neither
    windowed = sliding_window is not None and any(s.prefix + s.length > sliding_window for row in spans for s in row)
    if dropout > 0 or windowed or choose_path(spans, query, key) == "masked":
        mask = block_mask(position_ids, spans, query.shape[2], sliding_window if windowed else None)
        out = F.scaled_dot_product_attention(query, key.to(query.dtype), value.to(query.dtype), attn_mask=mask,
                                             dropout_p=dropout, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = PerSampleAttention.apply(query, key, value, spans, scale)
    return out.transpose(1, 2).contiguous(), None


# -- which path: a cost model measured on this machine (AttentionCosts, below) ----------


def choose_path(spans: list[list["Span"]], query: torch.Tensor, key: torch.Tensor) -> str:
    """"per_sample" or "masked": whichever the measured cost model says is cheaper for this batch."""
    forced = os.environ.get(FORCE_ENV, "")
    if forced in ("per_sample", "masked"):
        return forced
    if all(len(row) == 1 for row in spans):
        return "per_sample"  # one sample per row: the fused causal kernel, no mask at all
    costs = measured_attention_costs(query.shape[1], key.shape[1], query.shape[3], query.dtype, torch.get_num_threads())
    if costs is None:  # not measured up front (use_packed_attention without a dtype): the per-sample default
        return "per_sample"
    return "per_sample" if costs.per_sample(spans) <= costs.masked(len(spans), query.shape[2]) else "masked"


def block_mask(position_ids: torch.Tensor, spans: list, length: int, window: int | None = None) -> torch.Tensor:
    """The (rows, 1, L, L) causal block-diagonal mask of a packed batch, built once per forward (and window)."""
    global _last_mask
    if _last_mask[0] is not position_ids:
        _last_mask = (position_ids, {})
    masks = _last_mask[1]
    if window not in masks:
        masks[window] = _mask_of(position_ids, spans, length, window)
    return masks[window]


def _mask_of(position_ids: torch.Tensor, spans: list, length: int, window: int | None = None) -> torch.Tensor:
    """Each token sees the earlier tokens of its own sample and of the prompt it continues; with a sliding window
    only those fewer than `window` positions back (as transformers' windowed masks count)."""
    segment = torch.zeros(len(spans), length, dtype=torch.long)
    for row, row_spans in enumerate(spans):
        for index, span in enumerate(row_spans):
            segment[row, span.start:span.end] = index
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = (segment[:, :, None] == segment[:, None, :]) & causal
    for row, row_spans in enumerate(spans):
        for span in row_spans:
            if span.prefix:
                mask[row, span.start:span.end, span.root:span.root + span.prefix] = True
    if window is not None:
        positions = position_ids.expand(len(spans), -1).cpu()
        mask &= positions[:, None, :] > positions[:, :, None] - window  # bool throughout: no (L × L) int64
    return mask[:, None].to(position_ids.device)


class Span(NamedTuple):
    """One sample of a row: tokens [start, end); a sample continuing a shared prompt also attends to the
    `prefix` tokens at [root, root + prefix) (its positions start at `prefix`, not 0)."""

    start: int
    end: int
    prefix: int = 0
    root: int = 0

    @property
    def length(self) -> int:
        return self.end - self.start


def sample_spans(position_ids: torch.Tensor, batch: int) -> list[list[Span]]:
    """The samples of each row (data.sample_starts). One starting at position p > 0 continues the first p tokens
    of the row's last sample that started at 0 (when that one is long enough: otherwise, positions handed in by
    other callers, it stands alone as before)."""
    global _last_spans
    if _last_spans[0] is position_ids:
        return _last_spans[1]
    positions = position_ids.expand(batch, -1).cpu()
    starts = sample_starts(positions)
    length = positions.shape[1]
    spans = []
    for row_positions, row in zip(positions.tolist(), starts):
        edges = row.nonzero().flatten().tolist() + [length]
        row_spans, root = [], None
        for start, end in zip(edges[:-1], edges[1:]):
            first = row_positions[start]
            if first == 0:
                root = Span(start, end)
                row_spans.append(root)
            elif root is not None and 0 < first <= root.length:
                row_spans.append(Span(start, end, prefix=first, root=root.start))
            else:
                row_spans.append(Span(start, end))
        spans.append(row_spans)
    _last_spans = (position_ids, spans)
    return spans


class PerSampleAttention(torch.autograd.Function):
    """Causal attention within each span of each row (and to its shared prompt, if any). q: (B, H, L, D);
    k, v: (B, KV, L, D), H a multiple of KV."""

    @staticmethod
    def forward(ctx, query, key, value, spans, scale: float):
        out = torch.empty_like(query)
        gqa = query.shape[1] != key.shape[1]
        for b, row in enumerate(spans):
            for span in row:
                q = query[b:b + 1, :, span.start:span.end]
                k, v = (_with_prefix(t[b:b + 1], span) for t in (key, value))
                # the prompt is visible to every query; after it, causal (bottom-right aligned)
                mask = None if not span.prefix else _visible(span.length, span.prefix, query.device)
                out[b:b + 1, :, span.start:span.end] = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
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
            for span in row:  # in row order: a prompt's own gradient is written before its answers add theirs
                q, o, grad_o = (t[b, :, span.start:span.end].to(dtype) for t in (query, out, grad_out))
                k, v = (_with_prefix(t[b], span).to(dtype) for t in (key, value))
                for grad, piece in zip(grads, _span_backward(q, k, v, o, grad_o, ctx.scale, span.prefix)):
                    if grad is None:
                        continue
                    if piece.shape[1] == span.length:
                        grad[b, :, span.start:span.end] = piece
                    else:  # keys and values: the shared prompt's part adds to what the prompt got already
                        grad[b, :, span.root:span.root + span.prefix] += piece[:, :span.prefix]
                        grad[b, :, span.start:span.end] = piece[:, span.prefix:]
        return (*grads, None, None)


def _with_prefix(t: torch.Tensor, span: Span) -> torch.Tensor:
    """A span's keys or values along dim -2: its shared prompt's, then its own."""
    own = t[..., span.start:span.end, :]
    if not span.prefix:
        return own
    return torch.cat([t[..., span.root:span.root + span.prefix, :], own], dim=-2)


def _visible(length: int, prefix: int, device) -> torch.Tensor:
    """(length × prefix + length) bool: query i sees the whole prompt and its own keys up to i."""
    return torch.ones(length, prefix + length, dtype=torch.bool, device=device).tril_(prefix)


def _span_backward(q, k, v, o, grad_o, scale: float, prefix: int = 0):
    """Gradients of causal softmax attention for one sample, scores recomputed. q, o: (H, n, D); k, v: (KV, m, D),
    m = prefix + n (the shared prompt's keys first, every query sees them)."""
    heads, n, _ = q.shape
    group = heads // k.shape[0]
    k_h, v_h = (t.repeat_interleave(group, dim=0) if group > 1 else t for t in (k, v))
    scores = (q @ k_h.transpose(1, 2)).float().mul_(scale)
    scores.masked_fill_(torch.ones(n, prefix + n, dtype=torch.bool, device=q.device).triu_(1 + prefix), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    del scores
    grad_v = probs.to(q.dtype).transpose(1, 2) @ grad_o
    delta = (grad_o.float() * o.float()).sum(-1, keepdim=True)  # rowsum(dO ∘ O) = rowsum(P ∘ dP)
    grad_probs = (grad_o @ v_h.transpose(1, 2)).float()
    grad_scores = probs.mul_(grad_probs.sub_(delta)).to(q.dtype)  # dS = P ∘ (dP - delta), in P's memory
    grad_q = (grad_scores @ k_h).mul_(scale)
    grad_k = (grad_scores.transpose(1, 2) @ q).mul_(scale)
    if group > 1:
        grad_k = grad_k.view(k.shape[0], group, k.shape[1], -1).sum(1)
        grad_v = grad_v.view(k.shape[0], group, k.shape[1], -1).sum(1)
    return grad_q, grad_k, grad_v


# -- the cost model: measured on this machine, kept in the probes' cache -----------------------------------


@dataclass(frozen=True)
class AttentionCosts:
    """Seconds of one attention forward + backward on this CPU, on each path:
    per-sample = calls·per_call + Σn²·per_score; masked = rows·(masked_call + L²·masked_score)."""

    per_call: float
    per_score: float
    masked_call: float
    masked_score: float

    def per_sample(self, spans: list[list]) -> float:
        calls = sum(len(row) for row in spans)
        # a shared prompt adds (answer × prompt) scores, all of them computed, against causal n² / 2
        scores = sum(span.length ** 2 + 2 * span.length * span.prefix for row in spans for span in row)
        return calls * self.per_call + scores * self.per_score

    def masked(self, rows: int, length: int) -> float:
        return rows * (self.masked_call + length * length * self.masked_score)


def attention_costs(heads: int, kv_heads: int, head_dim: int, dtype) -> AttentionCosts:
    """Measured once per shape, dtype and thread count on this CPU; cached in the process and on disk, so
    every run on this machine (a resumed one too) takes the same path for the same batch."""
    return _attention_costs(heads, kv_heads, head_dim, dtype, torch.get_num_threads())


def measured_attention_costs(heads: int, kv_heads: int, head_dim: int, dtype, threads: int) -> AttentionCosts | None:
    """What attention_costs measured in this process for these arguments, or None: never measures (a forward
    asks it)."""
    return measured("_attention_costs", heads, kv_heads, head_dim, dtype, threads)


@once
def _attention_costs(heads: int, kv_heads: int, head_dim: int, dtype, threads: int) -> AttentionCosts:
    key = f"{cpu_model_name()}|torch {torch.__version__}|" + "|".join(
        map(str, (heads, kv_heads, head_dim, str(dtype), threads)))
    values, _ = stored("attention_costs.json", key,
                       lambda: _measure_attention_costs(heads, kv_heads, head_dim, dtype).__dict__)
    return AttentionCosts(**values)


def _measure_attention_costs(heads: int, kv_heads: int, head_dim: int, dtype, length: int = 256) -> AttentionCosts:
    """Two timings per path (a row of many short samples, one of a single long one) fix its two constants."""
    generator = torch.Generator().manual_seed(0)  # never moves the global RNG

    def timed(run, lengths) -> float:
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        spans = sample_spans(positions, 1)
        q = torch.randn(1, heads, sum(lengths), head_dim, generator=generator).to(dtype).requires_grad_()
        k, v = (torch.randn(1, kv_heads, sum(lengths), head_dim, generator=generator).to(dtype).requires_grad_()
                for _ in range(2))
        best = float("inf")
        for _ in range(3):  # best of three: other work on the machine only ever adds time
            start = time.perf_counter()
            run(q, k, v, positions, spans).sum().backward()
            best = min(best, time.perf_counter() - start)
        return best

    def per_sample(q, k, v, positions, spans):
        return PerSampleAttention.apply(q, k, v, spans, head_dim ** -0.5)

    def masked(q, k, v, positions, spans):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_mask_of(positions, spans, q.shape[2]),
                                              enable_gqa=heads != kv_heads)

    short, long = [16] * (length // 16), [length]
    many, one = timed(per_sample, short), timed(per_sample, long)
    # many = 16·call + 16·16²·score, one = call + 256²·score
    per_score = max((16 * one - many) / (16 * length**2 - len(short) * 16**2), 1e-15)
    per_call = max((one - length**2 * per_score), 0.0)
    full, small = timed(masked, long), timed(masked, [length // 4])
    masked_score = max((full - small) / (length**2 - (length // 4) ** 2), 1e-15)
    return AttentionCosts(per_call, per_score, max(small - (length // 4) ** 2 * masked_score, 0.0), masked_score)
