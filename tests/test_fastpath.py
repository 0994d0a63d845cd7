"""The faster paths compute what the ordinary ones compute: loss, gradients, attention, dropout statistics."""

import json

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from workbench.data.batches import Collator
from workbench.data.tokens import IGNORE
from workbench.hardware import probes
from workbench.model.fastpath import SparseDropout, apply_fast_paths, dropped_positions, lora_fast_paths
from workbench.model.lm_loss import (full_logits_loss_sum, head_bypassed, linear_cross_entropy_sum, lm_loss_sum,
                                     plain_head)
from workbench.model.packed_attention import (FORCE_ENV, PerSampleAttention, Span, _mask_of, choose_path,
                                              packed_attention, sample_spans, use_packed_attention)
from workbench.model.packed_attention import AttentionCosts, attention_costs


def lora_model(path, dropout=0.0, targets="all-linear", dtype=torch.float32):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, init_lora_weights=False,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def packed_batch(pad_id=3):
    """Two packed rows of several samples each, answer tokens as targets, right padding on the second."""
    gen = torch.Generator().manual_seed(1)

    def sample(n):
        ids = torch.randint(5, 1000, (n,), generator=gen).tolist()
        return ids, [IGNORE] * (n // 3) + ids[n // 3:]

    rows = []
    for lengths in ([30, 12, 50, 8], [40, 25]):
        samples = [sample(n) for n in lengths]
        rows.append({"input_ids": [t for s in samples for t in s[0]], "labels": [t for s in samples for t in s[1]],
                     "position_ids": [p for n in lengths for p in range(n)]})
    return Collator(pad_id)(rows)


def loss_and_grads(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_close_grads(a, b, rtol, atol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)


# -- chunked loss ---------------------------------------------------------------------------------


def test_chunked_loss_matches_full_logits(tiny_path, monkeypatch):
    model = lora_model(tiny_path)
    batch = packed_batch()
    reference = loss_and_grads(model, batch, full_logits_loss_sum)
    monkeypatch.setattr("workbench.model.lm_loss.CHUNK_ELEMENTS", 1024 * 7)  # several chunks, a short last one
    chunked = loss_and_grads(model, batch, lm_loss_sum)
    torch.testing.assert_close(chunked[0], reference[0], rtol=1e-5, atol=1e-4)
    assert_close_grads(chunked[1], reference[1], rtol=1e-3, atol=1e-5)


def test_chunked_loss_gradient_of_a_trainable_head():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :3] = IGNORE
    full = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    expected = torch.autograd.grad(3 * full, (hidden, weight))
    got = torch.autograd.grad(3 * linear_cross_entropy_sum(hidden, weight, labels), (hidden, weight))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_a_16bit_head_computed_in_float32_matches_the_float32_head(monkeypatch, masked):
    """precision.vocabulary_dtype_of keeps a frozen head in bf16 while the model computes in float32: the loss
    casts it a slice of the vocabulary at a time (slices of 7 words and a short last one here) and must give
    the loss and hidden-state gradient of the float32 head (whose values are exactly bf16's), compacted rows
    (CPU) or masked ones (accelerators) alike."""
    from workbench.model.lm_loss import _LinearCrossEntropySum

    torch.manual_seed(0)
    monkeypatch.setattr("workbench.model.lm_loss.CHUNK_ELEMENTS", 16 * 7)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(50, 16).to(torch.bfloat16)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :3] = IGNORE
    full = F.cross_entropy((hidden @ weight.float().t()).flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")
    (expected,) = torch.autograd.grad(3 * full, hidden)
    if masked:
        flat, targets = hidden.flatten(0, 1), labels.flatten()
        loss = _LinearCrossEntropySum.apply(flat, weight, targets.clamp(min=0), targets != IGNORE, 64, torch.float32)
    else:
        loss = linear_cross_entropy_sum(hidden, weight, labels, torch.float32)
    (got,) = torch.autograd.grad(3 * loss, hidden)
    torch.testing.assert_close(loss, full, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # evaluation's loss takes the same path without a gradient
        torch.testing.assert_close(linear_cross_entropy_sum(hidden, weight, labels, torch.float32), full,
                                   rtol=1e-6, atol=1e-5)


def test_chunked_loss_needs_a_plain_head(tiny_path):
    assert plain_head(lora_model(tiny_path).get_base_model()) is not None
    on_head = lora_model(tiny_path, targets=["q_proj", "lm_head"])  # LoRA on the head: ordinary path
    assert plain_head(on_head.get_base_model()) is None
    batch = packed_batch()
    torch.testing.assert_close(lm_loss_sum(on_head, batch), full_logits_loss_sum(on_head, batch))


def test_chunked_loss_under_no_grad_and_autocast(tiny_path):
    model = lora_model(tiny_path)
    batch = packed_batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        chunked, full = lm_loss_sum(model, batch), full_logits_loss_sum(model, batch)
    assert not chunked.requires_grad
    torch.testing.assert_close(chunked, full, rtol=2e-2, atol=0.0)


# -- per-sample attention ---------------------------------------------------------------------------


def test_per_sample_attention_matches_a_block_diagonal_mask():
    torch.manual_seed(0)
    lengths = [[7, 20, 5], [16, 16]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    segment = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])
    mask = ((segment[:, :, None] == segment[:, None, :]) & torch.ones(32, 32, dtype=torch.bool).tril())[:, None]
    q = torch.randn(2, 4, 32, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 8, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(2, 4, 32, 8)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    got = PerSampleAttention.apply(q, k, v, sample_spans(positions, 2), 8 ** -0.5)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_per_sample_attention_backward_with_mixed_dtypes():
    """8-bit layers hand float32 queries and gradients next to bfloat16 keys and values (the forward ran
    under autocast): the backward computes in one dtype and returns each gradient in its input's dtype."""
    torch.manual_seed(0)
    positions = torch.cat([torch.arange(10), torch.arange(6)])[None]
    q = torch.randn(1, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 16, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = PerSampleAttention.apply(q, k, v, sample_spans(positions, 1), 8 ** -0.5)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(1, 4, 16, 8))
    assert [g.dtype for g in grads] == [torch.float32, torch.bfloat16, torch.bfloat16]
    assert all(torch.isfinite(g.float()).all() and g.abs().sum() > 0 for g in grads)


def test_sample_spans_start_wherever_positions_do_not_continue():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])
    assert sample_spans(positions, 2) == [[Span(0, 3), Span(3, 5), Span(5, 6)], [Span(0, 2), Span(2, 6)]]


def test_a_sample_continuing_a_prompt_attends_to_it():
    """[prompt + chosen][rejected, positions continuing the prompt]: the second span sees the first's first tokens.
    A span with no sample before it that started at 0, or one too short, stands alone."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 2, 3, 0, 1, 1, 5, 6]])
    assert sample_spans(positions, 1) == [[Span(0, 5), Span(5, 7, prefix=2, root=0), Span(7, 9),
                                           Span(9, 10, prefix=1, root=7), Span(10, 12)]]
    assert sample_spans(torch.tensor([[2, 3, 0, 1]]), 1) == [[Span(0, 2), Span(2, 4)]]


@pytest.mark.parametrize("path", ["per_sample", "masked"])
def test_shared_prompt_attention_equals_attention_over_the_whole_sequence(path):
    """The rejected answer continuing a shared prompt gets exactly what it would as [prompt + rejected] on its own:
    outputs and the gradients of q, k and v (the prompt's keys and values get both answers' gradients)."""
    torch.manual_seed(0)
    prompt, chosen, rejected = 9, 6, 4
    positions = torch.tensor([list(range(prompt + chosen)) + list(range(prompt - 1, prompt - 1 + rejected))])
    length = positions.shape[1]
    q = torch.randn(1, 4, length, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, length, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(1, 4, length, 8, dtype=torch.float64)
    spans = sample_spans(positions, 1)
    if path == "per_sample":
        got = PerSampleAttention.apply(q, k, v, spans, 8 ** -0.5)
    else:
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask_of(positions, spans, length), enable_gqa=True)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)

    # the reference: two whole causal sequences, [prompt + chosen] and [prompt - 1 tokens + rejected]
    whole = [list(range(prompt + chosen)), list(range(prompt - 1)) + list(range(prompt + chosen, length))]
    expected = torch.zeros_like(got)
    expected_grads = [torch.zeros_like(t) for t in (q, k, v)]
    for index, own in zip(whole, (slice(0, prompt + chosen), slice(prompt + chosen, length))):
        qs, ks, vs = (t[:, :, index] for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        expected[:, :, own] = out[:, :, -(own.stop - own.start):].detach()
        # the gradient of the answer's own outputs only: each output position counts once
        weight = torch.zeros_like(out)
        weight[:, :, -(own.stop - own.start):] = grad_out[:, :, own]
        for total, piece in zip(expected_grads, torch.autograd.grad(out, (q, k, v), weight)):
            total += piece  # gradients of the whole q, k and v, zero outside this sequence
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)  # the backward's scores are float32


@pytest.mark.parametrize("path", ["per_sample", "masked"])
def test_packed_attention_model_matches_sdpa(tiny_path, path, monkeypatch):
    monkeypatch.setenv(FORCE_ENV, path)  # both branches of the cost model compute the same thing
    model = lora_model(tiny_path)
    batch = packed_batch()
    reference = loss_and_grads(model, batch, full_logits_loss_sum)
    assert apply_fast_paths(model)["packed_attention"]
    assert model.config._attn_implementation == "sdpa_packed"
    packed = loss_and_grads(model, batch, full_logits_loss_sum)
    torch.testing.assert_close(packed[0], reference[0], rtol=1e-5, atol=1e-4)
    assert_close_grads(packed[1], reference[1], rtol=1e-3, atol=1e-5)


def test_attention_dropout_stays_within_each_sample():
    """With attention dropout (GPT-2's attn_pdrop) training takes the masked path with the dropout applied: what a
    sample attends to, however the dropout falls, never includes another sample."""
    import types

    torch.manual_seed(0)
    positions = torch.cat([torch.arange(10), torch.arange(6)])[None]
    q = torch.randn(1, 4, 16, 8)
    k, v = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :10], v2[:, :, :10] = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)  # another first sample
    module = types.SimpleNamespace(is_causal=True)

    def attend(key, value, dropout):
        torch.manual_seed(1)
        return packed_attention(module, q, key, value, None, dropout=dropout, position_ids=positions)[0]

    dropped, other_first, no_dropout = attend(k, v, 0.5), attend(k2, v2, 0.5), attend(k, v, 0.0)
    assert torch.equal(dropped[:, 10:], other_first[:, 10:])  # the second sample never saw the first
    assert not torch.allclose(dropped, no_dropout)  # and the dropout was applied


def test_a_sliding_window_shorter_than_a_sample_is_kept():
    """Mistral-style sliding-window attention over packed rows, and over a pair holding its prompt once, gives what
    each sample gets on its own. (transformers' own sdpa masks do not keep windowed packed samples apart: the
    reference here is each sample alone.)"""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=6, max_position_embeddings=64)
    model = MistralForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 128, (1, 30))
    rows = torch.cat([torch.arange(18), torch.arange(12)])[None]  # two samples, both longer than the window
    # a pair holding its prompt once: [prompt 9 + chosen 6][rejected 4, positions from 8]
    pair = torch.cat([torch.arange(15), torch.arange(8, 12)])[None]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[:, :18]).logits, model(input_ids=ids[:, 18:]).logits], dim=1)
        rejected_alone = model(input_ids=torch.cat([ids[:, :8], ids[:, 15:19]], dim=1)).logits[:, 8:]
        assert use_packed_attention(model)
        got = model(input_ids=ids, position_ids=rows).logits
        got_rejected = model(input_ids=ids[:, :19], position_ids=pair).logits[:, 15:]
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_rejected, rejected_alone, rtol=1e-5, atol=1e-5)


def test_a_window_set_only_on_the_attention_module_is_kept():
    """Some models (Qwen2-MoE) put the window on the attention module and not in the call: the same result."""
    import types

    torch.manual_seed(0)
    positions = torch.cat([torch.arange(9), torch.arange(7)])[None]
    q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    given = packed_attention(types.SimpleNamespace(is_causal=True), q, k, v, None, position_ids=positions,
                             sliding_window=4)[0]
    on_module = packed_attention(types.SimpleNamespace(is_causal=True, sliding_window=4), q, k, v, None,
                                 position_ids=positions)[0]
    unwindowed = packed_attention(types.SimpleNamespace(is_causal=True), q, k, v, None, position_ids=positions)[0]
    assert torch.equal(on_module, given) and not torch.allclose(given, unwindowed)


def test_packed_attention_leaves_generation_alone(tiny_path, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation="sdpa")
    prompts = tiny_tokenizer(["The model reads", "A student writes the answer"], return_tensors="pt", padding=True,
                             padding_side="left")
    single = tiny_tokenizer("The robot learns", return_tensors="pt")
    before = [model.generate(**x, max_new_tokens=8, do_sample=False) for x in (prompts, single)]
    apply_fast_paths(model)
    after = [model.generate(**x, max_new_tokens=8, do_sample=False) for x in (prompts, single)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# -- LoRA input path and dropout ----------------------------------------------------------------------


@pytest.mark.parametrize("autocast", [False, True])
def test_lora_fast_paths_change_nothing_without_dropout(tiny_path, autocast):
    model = lora_model(tiny_path, dtype=torch.bfloat16 if autocast else torch.float32)
    batch = packed_batch()

    def loss_fn(m, b):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return full_logits_loss_sum(m, b)

    reference = loss_and_grads(model, batch, loss_fn)
    assert lora_fast_paths(model) > 0
    fast = loss_and_grads(model, batch, loss_fn)
    torch.testing.assert_close(fast[0], reference[0], rtol=0, atol=0)
    assert_close_grads(fast[1], reference[1], rtol=0, atol=0)


def test_lora_fast_paths_swap_the_dropout(tiny_path):
    model = lora_model(tiny_path, dropout=0.1)
    lora_fast_paths(model)
    dropouts = [m for m in model.modules() if isinstance(m, SparseDropout)]
    assert dropouts and all(d.p == 0.1 for d in dropouts)
    model.train()
    packed = packed_batch()
    full_logits_loss_sum(model, packed).backward()  # trains through it


def test_sparse_dropout_has_the_dropout_distribution():
    torch.manual_seed(0)
    n, p = 2_000_000, 0.05
    dropped = dropped_positions(n, p, "cpu")
    assert torch.all(dropped[1:] > dropped[:-1]) and 0 <= int(dropped[0]) and int(dropped[-1]) < n
    assert abs(len(dropped) / n - p) < 5 * (p * (1 - p) / n) ** 0.5
    mask = torch.zeros(n, dtype=torch.bool)
    mask[dropped] = True
    both = (mask[1:] & mask[:-1]).float().mean().item()  # neighbours independent: p squared
    assert abs(both - p * p) < 5 * (p * p / n) ** 0.5


def test_sparse_dropout_scales_and_masks_the_gradient_alike():
    torch.manual_seed(0)
    x = torch.randn(64, 128, requires_grad=True)
    layer = SparseDropout(0.2).train()
    y = layer(x)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.8)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, kept.float() / 0.8)
    assert torch.equal(layer.eval()(x), x)


def test_chunked_loss_runs_the_head_in_the_forwards_autocast_dtype(tiny_path):
    """accelerate applies autocast inside the model's forward only: the head must still run in bf16."""
    model = lora_model(tiny_path)
    forward = model.forward
    model.forward = lambda *a, **k: torch.autocast("cpu", dtype=torch.bfloat16)(forward)(*a, **k)
    batch = packed_batch()
    name, _ = plain_head(model.get_base_model())
    with torch.no_grad(), head_bypassed(model.get_base_model(), name) as passthrough:
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    assert passthrough.autocast_dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(lm_loss_sum(model, batch), full_logits_loss_sum(model, batch), rtol=1e-3, atol=0.0)


def test_lora_fast_paths_leave_dora_alone(tiny_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation="sdpa")
    dora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, use_dora=True,
                                            target_modules="all-linear", task_type="CAUSAL_LM"))
    assert lora_fast_paths(dora) == 0
    assert not any(isinstance(m, SparseDropout) for m in dora.modules())


def test_the_cost_model_picks_masked_rows_of_many_short_samples_and_per_sample_otherwise(monkeypatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    costs = AttentionCosts(per_call=2e-3, per_score=2e-7, masked_call=1e-4, masked_score=2e-7)
    many_short = [[Span(i * 25, (i + 1) * 25) for i in range(10)]]  # ten 25-token samples in a 256-token row
    few_long = [[Span(0, 128), Span(128, 256)]]
    assert costs.per_sample(many_short) > costs.masked(1, 256)
    assert costs.per_sample(few_long) < costs.masked(1, 256)
    q, k = torch.zeros(1, 4, 256, 8), torch.zeros(1, 2, 256, 8)
    monkeypatch.setitem(probes._memo, ("_attention_costs", 4, 2, 8, torch.float32, torch.get_num_threads()), costs)
    assert choose_path(many_short, q, k) == "masked" and choose_path(few_long, q, k) == "per_sample"
    assert choose_path([[Span(0, 256)]], q, k) == "per_sample"  # one sample per row: no mask at all
    # an answer continuing a shared prompt pays for its (answer × prompt) scores as well
    assert costs.per_sample([[Span(0, 128), Span(128, 192, prefix=100)]]) > costs.per_sample([[Span(0, 128),
                                                                                                Span(128, 192)]])


def test_the_cost_model_is_measured_on_this_machine_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(probes, "_memo", {})
    costs = attention_costs(4, 2, 8, torch.float32)
    assert min(costs.per_score, costs.masked_score) > 0 and costs.per_call >= 0
    (stored,) = json.loads((tmp_path / "estimator" / "attention_costs.json").read_text()).values()
    assert stored == costs.__dict__
