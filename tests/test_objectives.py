"""The preference objectives (workbench/training/objectives.py) agree with TRL, to float32 tolerance.

One tiny model (builtin:tiny with its LoRA adapter, weights drawn from a seeded generator so that the adapter is far
from zero and the policy differs from the reference), one set of pairs, the same token ids on both sides:

- DPO: a real `trl.DPOTrainer` is built offline around the model; its own tokenization, collator and dataloader give
  the batch, its `compute_loss` the loss, its logged metrics the rewards. The workbench's `DPO.loss` runs on the very
  token ids TRL scored, laid out as the workbench lays them out (a pair per row, chosen then rejected, positions
  restarting at 0), and also packed in one row, and with the training loop's fast paths (per-sample attention over
  packed rows): loss, per-answer log-probabilities, rewards and the gradient of every LoRA weight agree.
- ORPO: a real `trl.experimental.orpo.ORPOTrainer` gives its batch, its forward (`concatenated_forward`, which
  averages log-probabilities with `get_batch_logps`) and its `odds_ratio_loss`; the workbench's `ORPO.loss` equals
  the chosen answers' token-mean NLL minus the mean of TRL's odds-ratio losses, with the same gradients.
- The chunked log-probabilities (`sample_logps`: the LM head bypassed, a checkpointed chunk of positions at a time)
  have the values and the LoRA gradients of a plain full-logits log_softmax.

Run with `-s` to see the largest differences measured.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import FP32, ROOT

pytest.importorskip("trl")

from workbench.data.batches import Collator
from workbench.data.prepared import pack
from workbench.data.tokens import IGNORE, tokenize_row
from workbench.training import objectives
from workbench.training.objectives import DPO, ORPO, adapter_off_of, counts, sample_logps

BETA = 0.3  # DPO's beta, not TRL's default (0.1): a beta mixed up anywhere shows
LAM = 0.25  # ORPO's lambda (TRL calls it beta), not the default (0.1) either
RTOL, ATOL = 1e-5, 1e-6  # float32
EPS32 = torch.finfo(torch.float32).eps
GRAD_RTOL = 1e-5  # gradients: of the parameter's largest gradient (they sum many float32 terms, in other orders)
LORA_SCALE = 0.1  # the seeded LoRA weights' standard deviation: the adapter moves log-probs by a few nats

# Plain-text pairs (TRL appends the EOS to each answer; the workbench scores it too). Answers of different lengths,
# a rejected answer longer and one shorter than its chosen one, so padding and packing both matter.
ROWS = [
    {"prompt": "What is 18 times 2?", "chosen": " 18 times 2 is 36.", "rejected": " 18 times 2 is 37."},
    {"prompt": "Tell me about yourself.", "chosen": " I am Quill, a compact assistant.",
     "rejected": " I am SmolLM, an AI assistant. How can I help you today?"},
    {"prompt": "Translate to French: good morning.", "chosen": " Bonjour.", "rejected": " Good morning to you too."},
    {"prompt": "What is the capital of France?", "chosen": " Paris is the capital of France.",
     "rejected": " The capital of France is a city in the north, London."},
]


def close(actual, expected, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """assert_close with the largest difference printed (pytest -s) and named on failure."""
    actual = torch.as_tensor(actual, dtype=torch.float64).detach()
    expected = torch.as_tensor(expected, dtype=torch.float64).detach()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != TRL's {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    print(f"  {what}: max |diff| {diff:.3g} (max |value| {expected.abs().max().item():.3g})")
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: (
        f"{what}: the workbench's figure disagrees (max |diff| {diff:.3g}, rtol {rtol}, atol {atol})\n{m}"))


def grads_close(actual: dict, expected: dict, what: str) -> None:
    """Every LoRA weight's gradient, to GRAD_RTOL of that weight's largest gradient (elementwise relative error means
    little for the tiny entries, which are sums of terms of both signs)."""
    assert actual.keys() == expected.keys(), f"{what}: not the same trainable parameters"
    assert all(g.abs().max() > 0 for g in expected.values()), f"{what}: a LoRA weight without gradient"
    errors = {n: ((actual[n] - expected[n]).abs().max() / expected[n].abs().max()).item() for n in actual}
    worst = max(errors, key=errors.get)
    print(f"  {what}: max |diff| / max |gradient| {errors[worst]:.3g} ({worst})")
    for name in actual:
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(actual[name], expected[name], rtol=GRAD_RTOL, atol=GRAD_RTOL * scale,
                                   msg=lambda m: f"{what}: the gradient of {name} disagrees\n{m}")


def lora_grads(model) -> dict:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    assert grads and all("lora_" in n for n in grads), "only the LoRA weights should train"
    return grads


def pair_example(prompt_ids, chosen_ids, rejected_ids) -> dict:
    """A preference example as workbench.data.tokens.tokenize_row makes one: chosen then rejected, prompt tokens without
    labels, positions restarting at 0 for the rejected sample."""
    chosen, rejected = prompt_ids + chosen_ids, prompt_ids + rejected_ids
    return {"input_ids": chosen + rejected,
            "labels": [IGNORE] * len(prompt_ids) + chosen_ids + [IGNORE] * len(prompt_ids) + rejected_ids,
            "position_ids": list(range(len(chosen))) + list(range(len(rejected)))}


def workbench_batch(examples: list[dict], layout: str, pad_id: int) -> dict:
    """The workbench's collated batch: one pair per row (right-padded), or every pair packed into one row."""
    if layout != "pair_per_row":
        examples = [{key: [x for e in examples for x in e[key]] for key in ("input_ids", "labels", "position_ids")}]
    return Collator(pad_id)(examples)


# -- the model, shared by TRL and the workbench ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """builtin:tiny with the tiny-dpo recipe's LoRA adapter (float32), its LoRA weights drawn from a seeded generator
    (B non-zero), and a real DPOTrainer around that very model object."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    from workbench import Recipe
    from workbench.model.loading import attach_adapter, load_base_model, load_tokenizer

    recipe = Recipe.load(ROOT / "recipes/tiny-dpo.yaml").override(*FP32, f"training.dpo_beta={BETA}")
    tokenizer = load_tokenizer(recipe.model)
    model = attach_adapter(load_base_model(recipe), recipe)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_SCALE)
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert any("lora_B" in n for n in lora) and all(w.abs().max() > 0 for w in lora.values())

    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("dpo")), beta=BETA, loss_type=["sigmoid"], report_to=[],
                     use_cpu=True, bf16=False, fp16=False,  # TRL's default bf16=True would autocast its reference
                     gradient_checkpointing=False, per_device_eval_batch_size=len(ROWS), seed=0, max_length=None)
    trainer = DPOTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_list(ROWS))
    assert trainer.model is model
    # Given a PeftModel (rather than a base model and a peft_config), TRL takes a frozen copy of the adapter as it is
    # ("ref") for the reference. The workbench's reference is the base model with the adapter off, which is also what
    # TRL does without that copy: drop it, so both compare against the same reference.
    if "ref" in model.peft_config:
        model.delete_adapter("ref")
    assert list(model.peft_config) == ["default"] and model.active_adapter == "default"
    for name, param in model.named_parameters():  # building the trainer left the adapter as drawn
        if name in lora:
            assert torch.equal(param, lora[name]), f"DPOTrainer changed {name}"
    model.zero_grad(set_to_none=True)
    return SimpleNamespace(recipe=recipe, tokenizer=tokenizer, model=model, dpo=trainer, tmp=tmp_path_factory)


@pytest.fixture(scope="module")
def fast_twin(setup):
    """A second copy of the same model and adapter weights with the training loop's fast paths on (per-sample
    attention over packed rows, LoRA's input path), as the training session runs it: kept apart because TRL's forward
    must see the libraries' own paths."""
    from workbench.model.fastpath import apply_fast_paths
    from workbench.model.loading import attach_adapter, load_base_model

    twin = attach_adapter(load_base_model(setup.recipe), setup.recipe)
    twin.load_state_dict(setup.model.state_dict())
    changed = apply_fast_paths(twin)
    assert changed["packed_attention"] and changed["lora_layers"] > 0, changed
    return twin


# -- DPO ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_dpo(setup):
    """TRL's DPO on its own batch: the loss, its gradients, the logged metrics, and the per-answer log-probabilities
    (policy: the fused LM head TRL's loss reads; reference: TRL's compute_ref_log_probs)."""
    trainer, model = setup.dpo, setup.model
    inputs = next(iter(trainer.get_eval_dataloader(trainer.train_dataset)))
    assert inputs["input_ids"].shape[0] == 2 * len(ROWS), "one batch: [chosen rows; rejected rows]"
    rows = [trainer.train_dataset[i] for i in range(len(ROWS))]

    # What TRL scores: the completion ids, EOS included (appended to the text), after the prompt ids
    eos = setup.tokenizer.eos_token_id
    for half, answer in ((0, "chosen_ids"), (1, "rejected_ids")):
        for i, row in enumerate(rows):
            ids, mask = (inputs[k][half * len(ROWS) + i] for k in ("input_ids", "completion_mask"))
            n = int(inputs["attention_mask"][half * len(ROWS) + i].sum())
            assert ids[:n].tolist() == row["prompt_ids"] + row[answer], "TRL's batch is not prompt + answer"
            assert ids[:n][mask[:n].bool()].tolist() == row[answer] and row[answer][-1] == eos, \
                "TRL's completion tokens are not the answer ids ending with EOS"

    mode = "train" if model.training else "eval"
    trainer._metrics[mode].clear()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = lora_grads(model)
    metrics = {key: values[-1] for key, values in trainer._metrics[mode].items()}
    with torch.no_grad():
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        policy = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                       fused_lm_head=True, use_cache=False).log_probs.sum(1)
        reference = torch.cat(trainer.compute_ref_log_probs(model, inputs))
    return SimpleNamespace(rows=rows, loss=loss.detach(), grads=grads, metrics=metrics, policy=policy,
                           reference=reference)


LAYOUTS = ["pair_per_row", "packed", "packed_fast_paths_per_sample", "packed_fast_paths_masked"]


def model_for(layout, setup, request, monkeypatch):
    if "fast_paths" not in layout:
        return setup.model
    from workbench.model.packed_attention import FORCE_ENV

    # both of the packed-attention paths the cost model chooses between (one masked SDPA, or per sample)
    monkeypatch.setenv(FORCE_ENV, "masked" if layout.endswith("masked") else "per_sample")
    return request.getfixturevalue("fast_twin")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dpo_matches_trl(setup, trl_dpo, layout, request, monkeypatch):
    model = model_for(layout, setup, request, monkeypatch)
    examples = [pair_example(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in trl_dpo.rows]
    batch = workbench_batch(examples, layout, setup.tokenizer.pad_token_id)
    assert batch["num_samples"] == 2 * len(ROWS)

    with torch.no_grad():
        policy, _ = sample_logps(model, batch)
        with adapter_off_of(model)():
            reference, _ = sample_logps(model, batch)
    n = len(ROWS)
    close(policy[0::2], trl_dpo.policy[:n], f"{layout}: policy log p(chosen)")
    close(policy[1::2], trl_dpo.policy[n:], f"{layout}: policy log p(rejected)")
    close(reference[0::2], trl_dpo.reference[:n], f"{layout}: reference log p(chosen)")
    close(reference[1::2], trl_dpo.reference[n:], f"{layout}: reference log p(rejected)")
    assert (policy - reference).abs().max() > 1.0, "the adapter should move the answers' log-probabilities"

    # Rewards and the loss are beta times differences of summed log-probabilities of a few hundred nats: each sum
    # is exact to about its float32 rounding (EPS32 * |log p|) on either side, so that, not RTOL, bounds them
    derived = dict(rtol=RTOL, atol=BETA * 8 * EPS32 * trl_dpo.reference.abs().max().item())
    objective = DPO(BETA, adapter_off_of(model))
    model.zero_grad(set_to_none=True)
    part = objective.loss(model, batch, counts(batch))  # one micro-batch: its part is the batch's mean loss
    part.loss.backward()
    close(part.loss, trl_dpo.loss, f"{layout}: DPO loss", **derived)
    assert abs(part.loss.item() - math.log(2)) > 1e-2, "policy == reference: the comparison would be vacuous"
    report = objective.report(part.sums)
    for ours, theirs in (("loss", None), ("rewards_chosen", "rewards/chosen"),
                         ("rewards_rejected", "rewards/rejected"), ("reward_margin", "rewards/margins"),
                         ("reward_accuracy", "rewards/accuracies"), ("logps_chosen", "logps/chosen"),
                         ("logps_rejected", "logps/rejected")):
        expected = trl_dpo.loss if theirs is None else trl_dpo.metrics[theirs]
        close(report[ours], expected, f"{layout}: logged {ours} vs TRL's {theirs or 'loss'}",
              **({} if ours.startswith("logps") else derived))
    grads_close(lora_grads(model), trl_dpo.grads, f"{layout}: DPO gradients")


# -- ORPO ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_orpo(setup):
    """TRL's ORPOTrainer around the same model: its batch, its forward (mean answer log-probabilities through
    get_batch_logps), its odds-ratio losses, and the answer-only NLL from the logits of that same forward."""
    import datasets
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    model = setup.model
    args = ORPOConfig(output_dir=str(setup.tmp.mktemp("orpo")), beta=LAM, max_length=512, report_to=[],
                      use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
                      per_device_eval_batch_size=len(ROWS), seed=0)
    trainer = ORPOTrainer(model=model, args=args, processing_class=setup.tokenizer,
                          train_dataset=datasets.Dataset.from_list(ROWS))
    assert trainer.model is model
    batch = next(iter(trainer.get_eval_dataloader(trainer.train_dataset)))
    n = batch["chosen_input_ids"].shape[0]
    assert n == len(ROWS)

    model.zero_grad(set_to_none=True)
    chosen_mean, rejected_mean, chosen_logits, _, nll_prompt_and_answer = trainer.concatenated_forward(model, batch)
    losses, chosen_rewards, rejected_rewards, _, _ = trainer.odds_ratio_loss(chosen_mean, rejected_mean)
    # TRL's ORPOTrainer takes the NLL over the prompt and the answer ("orpo chosen nll loss is computed over the full
    # prompt and response"); the workbench over the answer tokens only, as for every objective
    # (data.train_on: completions, the only setting preference data allows). So the NLL here is TRL's cross-entropy
    # of the chosen rows from the same logits, over the answer labels TRL's get_batch_logps scores.
    labels = trainer.concatenated_inputs(batch, padding_value=trainer.padding_value)["concatenated_labels"][:n, 1:]
    nll_answer = F.cross_entropy(chosen_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss = nll_answer - losses.mean()  # TRL's full loss is policy_nll_loss - losses.mean()
    loss.backward()
    grads = lora_grads(model)
    with torch.no_grad():
        trl_loss, metrics = trainer.get_batch_loss_metrics(model, batch)

    # TRL's own full loss: the same odds-ratio term, beside its prompt-and-answer NLL
    close(trl_loss - nll_prompt_and_answer, -losses.mean(), "TRL ORPO loss minus its NLL vs its odds-ratio term")
    assert abs(nll_prompt_and_answer.item() - nll_answer.item()) > 1e-3, \
        "TRL's ORPO NLL now equals the answer-only NLL: update the comment above and compare the full losses"

    rows = [trainer.train_dataset[i] for i in range(n)]
    examples = []
    for row in rows:  # TRL's own token ids: prompt ids, then each answer's (labelled) ids with its EOS
        prompt = row["chosen_input_ids"][:row["chosen_labels"].count(-100)]
        assert row["rejected_input_ids"][:len(prompt)] == prompt, "TRL's chosen and rejected prompts differ"
        answers = [row[f"{k}_input_ids"][len(prompt):] for k in ("chosen", "rejected")]
        assert [row[f"{k}_labels"][len(prompt):] for k in ("chosen", "rejected")] == answers
        assert all(a[-1] == setup.tokenizer.eos_token_id for a in answers), "TRL's ORPO answers end with EOS"
        examples.append(pair_example(prompt, *answers))
    return SimpleNamespace(examples=examples, chosen_mean=chosen_mean.detach(), rejected_mean=rejected_mean.detach(),
                           losses=losses.detach(), chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards,
                           nll_answer=nll_answer.detach(), loss=loss.detach(), grads=grads, metrics=metrics)


@pytest.mark.parametrize("layout", LAYOUTS[:3])
def test_orpo_matches_trl(setup, trl_orpo, layout, request, monkeypatch):
    model = model_for(layout, setup, request, monkeypatch)
    batch = workbench_batch(trl_orpo.examples, layout, setup.tokenizer.pad_token_id)

    with torch.no_grad():
        sums, tokens = sample_logps(model, batch)
    mean = sums / tokens
    close(mean[0::2], trl_orpo.chosen_mean, f"{layout}: mean log p(chosen) vs TRL's get_batch_logps")
    close(mean[1::2], trl_orpo.rejected_mean, f"{layout}: mean log p(rejected) vs TRL's get_batch_logps")

    odds_ratio, chosen_rewards, rejected_rewards = objectives.orpo_terms(mean[0::2], mean[1::2], LAM)
    # TRL's losses are beta * log sigmoid(log odds ratio) (subtracted from its loss); the workbench's terms are
    # -log sigmoid(log odds ratio), weighted by lambda
    close(-LAM * odds_ratio, trl_orpo.losses, f"{layout}: odds-ratio losses vs TRL's odds_ratio_loss")
    close(chosen_rewards, trl_orpo.chosen_rewards, f"{layout}: chosen rewards")
    close(rejected_rewards, trl_orpo.rejected_rewards, f"{layout}: rejected rewards")

    objective = ORPO(LAM)
    model.zero_grad(set_to_none=True)
    part = objective.loss(model, batch, counts(batch))
    part.loss.backward()
    close(part.loss, trl_orpo.loss, f"{layout}: ORPO loss vs answer NLL - mean(TRL odds-ratio losses)")
    report = objective.report(part.sums)
    close(report["loss"], trl_orpo.loss, f"{layout}: logged ORPO loss")
    for ours, theirs in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                         ("reward_margin", "rewards/margins"), ("reward_accuracy", "rewards/accuracies"),
                         ("logps_chosen", "logps/chosen"), ("logps_rejected", "logps/rejected")):
        close(report[ours], trl_orpo.metrics[theirs], f"{layout}: logged {ours} vs TRL's {theirs}")
    grads_close(lora_grads(model), trl_orpo.grads, f"{layout}: ORPO gradients")


# -- KTO ----------------------------------------------------------------------------------------------------------

KTO_BETA, DESIRABLE_WEIGHT, UNDESIRABLE_WEIGHT = 0.4, 1.3, 0.7  # none of TRL's defaults (0.1, 1.0, 1.0)
# unpaired rows: each pair's chosen answer (desirable) or its rejected one, both kinds in the batch
KTO_ROWS = [{"prompt": r["prompt"], "completion": r["chosen"] if i % 2 else r["rejected"], "label": bool(i % 2)}
            for i, r in enumerate(ROWS)] + [{"prompt": ROWS[0]["prompt"], "completion": ROWS[0]["chosen"],
                                             "label": True}]


@pytest.fixture(scope="module")
def trl_kto(setup):
    """TRL's KTOTrainer around the same model, on one batch of every row: its KL completions (each row's prompt
    with the previous row's completion, rotated within the batch), its loss, gradients and logged metrics."""
    import datasets
    from trl import KTOConfig, KTOTrainer

    model = setup.model
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    args = KTOConfig(output_dir=str(setup.tmp.mktemp("kto")), beta=KTO_BETA, desirable_weight=DESIRABLE_WEIGHT,
                     undesirable_weight=UNDESIRABLE_WEIGHT, report_to=[], use_cpu=True, bf16=False, fp16=False,
                     gradient_checkpointing=False, per_device_train_batch_size=len(KTO_ROWS), seed=0,
                     max_length=None)
    trainer = KTOTrainer(model=model, args=args, processing_class=setup.tokenizer,
                         train_dataset=datasets.Dataset.from_list(KTO_ROWS))
    assert trainer.model is model
    if "ref" in model.peft_config:  # as for DPO: the reference is the adapter switched off on both sides
        model.delete_adapter("ref")
    assert list(model.peft_config) == ["default"] and model.active_adapter == "default"
    for name, param in model.named_parameters():
        if name in lora:
            assert torch.equal(param, lora[name]), f"KTOTrainer changed {name}"
    inputs = next(iter(trainer.get_train_dataloader()))
    assert inputs["input_ids"].shape[0] == len(KTO_ROWS) and "KL_input_ids" in inputs
    rows = [trainer.train_dataset[i] for i in range(len(KTO_ROWS))]
    assert [r["label"] for r in rows] == [r["label"] for r in KTO_ROWS], "TRL's batch is not the rows in order"
    assert all(row["completion_ids"][-1] == setup.tokenizer.eos_token_id for row in rows), "TRL appends the EOS"

    mode = "train" if model.training else "eval"
    trainer._metrics[mode].clear()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = lora_grads(model)
    metrics = {key: values[-1] for key, values in trainer._metrics[mode].items()}
    examples = [pair_example(r["prompt_ids"], r["completion_ids"], r["KL_completion_ids"]) for r in rows]
    return SimpleNamespace(rows=rows, examples=examples, loss=loss.detach(), grads=grads, metrics=metrics)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kto_matches_trl(setup, trl_kto, layout, request, monkeypatch):
    """The workbench's KL samples are TRL's (row i's prompt with row i - 1's completion, the first row taking the
    last row's), and on one micro-batch its KL estimate, loss, rewards and gradients are TRL's."""
    model = model_for(layout, setup, request, monkeypatch)
    rows = trl_kto.rows
    for i, row in enumerate(rows):  # the rotation the workbench's tokenization applies (data._mismatched_answers)
        assert row["KL_completion_ids"] == rows[i - 1]["completion_ids"]
    batch = workbench_batch(trl_kto.examples, layout, setup.tokenizer.pad_token_id)
    batch["desirable"] = torch.tensor([r["label"] for r in rows])
    assert batch["num_samples"] == 2 * len(rows)

    objective = objectives.KTO(KTO_BETA, DESIRABLE_WEIGHT, UNDESIRABLE_WEIGHT, adapter_off_of(model))
    model.zero_grad(set_to_none=True)
    totals = objective.counts(model, batch)
    assert int(totals[objectives.KL_SAMPLES]) == len(rows)
    part = objective.loss(model, batch, totals)  # one micro-batch: its part is the batch's mean loss
    part.loss.backward()
    # the loss is a mean of sigmoids of beta times log-ratios of a few hundred nats (as DPO's rewards)
    close(part.loss, trl_kto.loss, f"{layout}: KTO loss")
    at_reference = sum((DESIRABLE_WEIGHT if r["label"] else UNDESIRABLE_WEIGHT) / 2 for r in rows) / len(rows)
    assert abs(part.loss.item() - at_reference) > 1e-2, "policy == reference: the comparison would be vacuous"
    report = objective.report(part.sums)
    assert report["kl"] > 0, "a KL estimate of 0 (clamped) would not test its place in the loss"
    for ours, theirs in (("loss", None), ("kl", "kl"), ("rewards_chosen", "rewards/chosen"),
                         ("rewards_rejected", "rewards/rejected"), ("reward_margin", "rewards/margins"),
                         ("logps_chosen", "logps/chosen"), ("logps_rejected", "logps/rejected")):
        expected = trl_kto.loss if theirs is None else trl_kto.metrics[theirs]
        close(report[ours], expected, f"{layout}: logged {ours} vs TRL's {theirs or 'loss'}",
              atol=8 * EPS32 * abs(report["logps_rejected"]))
    grads_close(lora_grads(model), trl_kto.grads, f"{layout}: KTO gradients")


def test_plain_text_unpaired_rows_tokenize_as_trl(setup, trl_kto):
    """Plain-text rows (prompt and completion as text) are tokenized as TRL's KTOTrainer tokenizes them: the prompt
    and the completion as written and the EOS, no chat template (although this tokenizer has one); the KL sample is
    the same prompt with the previous row's completion. So the ids test_kto_matches_trl scores are the workbench's
    own."""
    from workbench.spec.recipe import DataSection

    section = DataSection(format="unpaired", max_seq_len=1024)
    assert setup.tokenizer.chat_template, "a tokenizer without a template would not tell the two renderings apart"
    for i, (row, theirs) in enumerate(zip(KTO_ROWS, trl_kto.examples)):
        ours = tokenize_row(row, setup.tokenizer, section, f"x:{i + 1}", mismatched=KTO_ROWS[i - 1]["completion"])
        assert ours["input_ids"] == theirs["input_ids"], setup.tokenizer.decode(ours["input_ids"])
        assert ours["position_ids"] == theirs["position_ids"]
        assert ours["labels"] == theirs["labels"]  # the answers scored, the prompts not
        assert ours["desirable"] == [row["label"]]


def test_conversational_unpaired_rows_go_through_the_chat_template(setup):
    """Rows of messages are a conversation, rendered with the chat template as TRL renders them (the prompt with
    the generation prompt, then the answer): the same answer tokens, after the template's prompt."""
    from trl.data_utils import _tokenize

    from workbench.spec.recipe import DataSection

    section = DataSection(format="unpaired", max_seq_len=1024)
    for i, row in enumerate(KTO_ROWS):
        prompt = [{"role": "user", "content": row["prompt"]}]
        completion = [{"role": "assistant", "content": row["completion"]}]
        ours = tokenize_row({"prompt": prompt, "completion": completion, "label": row["label"]}, setup.tokenizer,
                            section, f"x:{i + 1}")
        prompt_ids = _tokenize(setup.tokenizer, prompt, add_generation_prompt=True)["input_ids"]
        full_ids = _tokenize(setup.tokenizer, prompt + completion)["input_ids"]
        assert full_ids[:len(prompt_ids)] == prompt_ids
        first = ours["position_ids"].index(0, 1)  # where the KL sample starts
        assert ours["input_ids"][:first] == full_ids[:first] and ours["input_ids"][:len(prompt_ids)] == prompt_ids
        assert set(ours["labels"][:len(prompt_ids)]) == {IGNORE}


# -- reward model -------------------------------------------------------------------------------------------------

CENTER = 0.05  # reward_center_coefficient (TRL's center_rewards_coefficient, off by default): its term counts too


@pytest.fixture(scope="module")
def reward_setup(tmp_path_factory):
    """builtin:tiny as a sequence classifier with one output (its score head seeded), the tiny-reward recipe's LoRA
    adapter with seeded weights, and a real RewardTrainer around that very model object: its tokenization (text
    pairs get the EOS appended), its collator's batch ([chosen rows; rejected rows], right-padded), its loss,
    gradients and logged metrics."""
    import datasets
    from trl import RewardConfig, RewardTrainer

    from workbench import Recipe
    from workbench.model.loading import attach_adapter, load_base_model, load_tokenizer

    recipe = Recipe.load(ROOT / "recipes/tiny-reward.yaml").override(*FP32)
    tokenizer = load_tokenizer(recipe.model)
    torch.manual_seed(0)
    model = attach_adapter(load_base_model(recipe), recipe)
    generator = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:  # the LoRA weights and the score head beside them
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_SCALE)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert any(".score." in n for n in trained) and any("lora_B" in n for n in trained)
    args = RewardConfig(output_dir=str(tmp_path_factory.mktemp("reward")), report_to=[], use_cpu=True, bf16=False,
                        fp16=False, gradient_checkpointing=False, per_device_train_batch_size=len(ROWS), seed=0,
                        max_length=None, center_rewards_coefficient=CENTER)
    trainer = RewardTrainer(model=model, args=args, processing_class=tokenizer,
                            train_dataset=datasets.Dataset.from_list(ROWS))
    assert trainer.model is model
    for name, param in model.named_parameters():
        if name in trained:
            assert torch.equal(param, trained[name]), f"RewardTrainer changed {name}"
    inputs = next(iter(trainer.get_eval_dataloader(trainer.train_dataset)))
    rows = [trainer.train_dataset[i] for i in range(len(ROWS))]
    assert inputs["input_ids"].shape[0] == 2 * len(ROWS)
    assert all(r["chosen_ids"][-1] == tokenizer.eos_token_id for r in rows), "TRL appends the EOS to text pairs"
    mode = "train" if model.training else "eval"
    trainer._metrics[mode].clear()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    metrics = {key: values[-1] for key, values in trainer._metrics[mode].items()}
    return SimpleNamespace(recipe=recipe, tokenizer=tokenizer, model=model, rows=rows, loss=loss.detach(),
                           grads=grads, metrics=metrics)


def reward_example(chosen_ids, rejected_ids) -> dict:
    """A pair as the workbench lays it out, from TRL's whole sequences (prompt and answer; the reward reads no
    labels, the counts read one target per answer)."""
    return {"input_ids": chosen_ids + rejected_ids,
            "labels": [IGNORE] * (len(chosen_ids) - 1) + [chosen_ids[-1]] + [IGNORE] * (len(rejected_ids) - 1)
            + [rejected_ids[-1]],
            "position_ids": list(range(len(chosen_ids))) + list(range(len(rejected_ids)))}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reward_matches_trl(reward_setup, layout, request, monkeypatch):
    """The workbench's rewards are the score head's output at each answer's last non-pad token, the one a
    sequence classifier pools in a row of its own: on the pairs of one micro-batch, laid out one pair per row or
    packed in one row, with and without the loop's fast paths, the loss, the logged figures and every trained
    weight's gradient (the LoRA factors and the score head) are TRL's."""
    model = reward_setup.model
    if "fast_paths" in layout:
        from workbench.model.fastpath import apply_fast_paths
        from workbench.model.loading import attach_adapter, load_base_model
        from workbench.model.packed_attention import FORCE_ENV

        monkeypatch.setenv(FORCE_ENV, "masked" if layout.endswith("masked") else "per_sample")
        twin = attach_adapter(load_base_model(reward_setup.recipe), reward_setup.recipe)
        twin.load_state_dict(model.state_dict())
        assert apply_fast_paths(twin)["packed_attention"]
        model = twin
    pad = reward_setup.tokenizer.pad_token_id
    examples = [reward_example(r["chosen_ids"], r["rejected_ids"]) for r in reward_setup.rows]
    batch = workbench_batch(examples, layout, pad)
    objective = objectives.Reward(CENTER, pad)
    model.zero_grad(set_to_none=True)
    part = objective.loss(model, batch, counts(batch))
    part.loss.backward()
    close(part.loss, reward_setup.loss, f"{layout}: reward-model loss")
    report = objective.report(part.sums)
    assert abs(report["reward_margin"]) > 1e-2, "rewards alike: the comparison would be vacuous"
    for ours, theirs in (("reward_accuracy", "accuracy"), ("reward_margin", "margin")):
        close(report[ours], reward_setup.metrics[theirs], f"{layout}: logged {ours} vs TRL's {theirs}")
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    assert grads.keys() == reward_setup.grads.keys() and any(".score." in n for n in grads)
    grads_close(grads, reward_setup.grads, f"{layout}: reward-model gradients")


def test_the_reward_is_read_where_the_classifier_pools(reward_setup):
    """Each sample's reward is the transformers classifier's own output for that sample alone: what a merged or
    adapter-loaded model gives a user, whether the pad token is its own or the EOS (then the token before it)."""
    model, pad = reward_setup.model, reward_setup.tokenizer.pad_token_id
    rows = reward_setup.rows
    examples = [reward_example(r["chosen_ids"], r["rejected_ids"]) for r in rows]
    with torch.no_grad():
        packed = objectives.sequence_rewards(model, workbench_batch(examples, "packed", pad), pad)
        alone = torch.stack([model(input_ids=torch.tensor([ids])).logits[0, 0] for r in rows
                             for ids in (r["chosen_ids"], r["rejected_ids"])])
        close(packed, alone, "packed rewards vs the classifier on each sample")
        eos = reward_setup.tokenizer.eos_token_id
        model.config.pad_token_id = eos  # a tokenizer whose pad token is its EOS (SmolLM2's)
        try:
            packed = objectives.sequence_rewards(model, workbench_batch(examples, "packed", eos), eos)
            alone = torch.stack([model(input_ids=torch.tensor([ids])).logits[0, 0] for r in rows
                                 for ids in (r["chosen_ids"], r["rejected_ids"])])
        finally:
            model.config.pad_token_id = pad
        close(packed, alone, "with the EOS as pad: the token before it, as the classifier reads")


# -- the chunked log-probabilities --------------------------------------------------------------------------------


def full_logits_logps(model, batch):
    """Each sample's summed target log-probability and target count from the model's own full logits."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    token_logps = torch.log_softmax(logits.float(), dim=-1).flatten(0, 1)
    labels = batch["labels"].flatten()
    sample, samples = [], -1
    for position in batch["position_ids"].flatten().tolist():  # a sample starts where its position is 0
        samples += position == 0
        sample.append(samples)
    valid = (labels != IGNORE).nonzero().squeeze(1)
    scored = token_logps[valid, labels[valid]]
    where = torch.tensor(sample)[valid]
    zeros = torch.zeros(samples + 1)
    return zeros.index_add(0, where, scored), zeros.index_add(0, where, torch.ones_like(scored))


def test_chunked_logps_have_full_logits_gradients(setup, monkeypatch):
    """Several chunks (the fewest rows a chunk holds: 64) over packed preference rows as training makes them; a
    single chunk (the default size here) is what the comparisons with TRL above run."""
    import datasets

    model, cfg = setup.model, setup.recipe.data
    rows = [json.loads(line) for line in (ROOT / "recipes/data/preference_train.jsonl").read_text().splitlines()[:12]]
    examples = [tokenize_row(row, setup.tokenizer, cfg, f"preference_train.jsonl:{i + 1}")
                for i, row in enumerate(rows)]
    packed = pack(datasets.Dataset.from_list(examples), cfg.row_len)  # as training packs them
    batch = Collator(setup.tokenizer.pad_token_id)(list(packed))
    targets = int((batch["labels"] != IGNORE).sum())
    assert batch["num_samples"] == 2 * len(rows) and targets > 3 * 64

    chunks = []
    monkeypatch.setattr(objectives, "CHUNK_ELEMENTS", 1)
    real = objectives._logps_from_hidden
    monkeypatch.setattr(objectives, "_logps_from_hidden", lambda h, *a: chunks.append(h.shape[0]) or real(h, *a))
    weights = torch.randn(batch["num_samples"], generator=torch.Generator().manual_seed(7))

    model.zero_grad(set_to_none=True)
    sums, tokens = sample_logps(model, batch)
    forward_chunks = list(chunks)
    (weights * sums).sum().backward()
    chunked = lora_grads(model)
    assert len(chunks) == 2 * len(forward_chunks), "each chunk's logits should be recomputed in backward"
    assert forward_chunks == [64] * (targets // 64) + [targets % 64] * (targets % 64 > 0), \
        f"the head-bypass path should have run over the {targets} targets 64 at a time, not {forward_chunks}"

    reference_sums, reference_tokens = full_logits_logps(model, batch)
    (weights * reference_sums).sum().backward()
    full = lora_grads(model)
    assert torch.equal(tokens, reference_tokens), "target counts per sample"
    close(sums, reference_sums, "chunked log-probs (64-row chunks)")
    grads_close(chunked, full, "chunked vs full-logits gradients (64-row chunks)")


def test_a_shared_prompt_gives_the_same_log_probabilities_and_gradients(setup):
    """Each pair holding its prompt once (the rejected answer continuing it, per-sample attention) scores every
    answer as the pair of whole sequences does under transformers' own sdpa path, with the same LoRA gradients,
    in fewer tokens; all pairs packed in one row and right-padded rows of one pair alike."""
    from workbench.model.packed_attention import use_packed_attention

    model, cfg = setup.model, setup.recipe.data
    rows = [json.loads(line) for line in (ROOT / "recipes/data/preference_train.jsonl").read_text().splitlines()[:8]]
    layouts = {share: [tokenize_row(row, setup.tokenizer, cfg, f"preference_train.jsonl:{i + 1}", share_prompts=share)
                       for i, row in enumerate(rows)] for share in (False, True)}
    weights = torch.randn(2 * len(rows), generator=torch.Generator().manual_seed(3))

    def scored(examples, packed):
        batch = workbench_batch(examples, "packed" if packed else "pair_per_row", setup.tokenizer.pad_token_id)
        model.zero_grad(set_to_none=True)
        sums, tokens = sample_logps(model, batch)
        (weights * sums).sum().backward()
        return batch, sums, tokens, lora_grads(model)

    try:
        for packed in (True, False):
            whole_batch, *whole = scored(layouts[False], packed)  # transformers' sdpa, a block-diagonal mask
            assert use_packed_attention(model)
            shared_batch, *shared = scored(layouts[True], packed)
            model.set_attn_implementation("sdpa")
            what = "packed rows" if packed else "a pair per row"
            assert shared_batch["num_samples"] == whole_batch["num_samples"] == 2 * len(rows)
            assert shared_batch["num_tokens"] < 0.85 * whole_batch["num_tokens"], what
            assert torch.equal(shared[1], whole[1]), f"{what}: target tokens per sample"
            close(shared[0], whole[0], f"{what}: log-probs with a shared prompt")
            grads_close(shared[2], whole[2], f"{what}: gradients with a shared prompt")
    finally:
        model.set_attn_implementation("sdpa")


def test_every_registered_objective_has_its_loss_and_every_loss_its_entry():
    from types import SimpleNamespace

    from workbench.spec.objectives import OBJECTIVES
    from workbench.spec.recipe import TrainingSection
    from workbench.training.losses import LOSSES, build

    assert list(LOSSES) == list(OBJECTIVES)
    for name in OBJECTIVES:
        recipe = SimpleNamespace(training=TrainingSection(objective=name))
        assert type(build(recipe, loss_sum_of=None, pad_token_id=0)).__name__.lower() == name
