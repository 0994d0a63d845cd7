"""GRPO's math (workbench/training/policy_gradient.py) agrees with TRL's GRPOTrainer on the same inputs.

One real `trl.GRPOTrainer` is built offline for the module around a tiny seeded Llama (float32, no autocast, no
gradient checkpointing, sampling temperature 0.7) and a WordLevel tokenizer made in memory; the workbench's side
runs on a separate copy of the same weights, through the model's plain forward (TRL patches its own copy's head).

- Loss: TRL's `_compute_loss` on hand-made completions (one row fully masked), advantages of both signs, with and
  without old log-probabilities (off-policy: ratios on both sides of the clip range), beta 0 and 0.04, for each
  loss type, and with delta, sequence-level ratios, no KL correction, accumulation: the loss, the gradient of every
  weight and each figure TRL logs (kl, entropy, clip ratios) equal `grpo_loss`'s from the copy's logits.
- Log-probabilities and entropies at temperature 0.7 equal TRL's `_get_per_token_logps_and_entropies`.
- Advantages: TRL's scoring (`_generate_and_score_completions`, generation replaced by fixed completions) with two
  reward functions and weights, a NaN reward, a completion no function scored and a group of equal rewards, for each
  scale and aggregation: the advantages and the reward figures equal `group_advantages`'.

Run with `-s` to see the largest differences measured.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile

import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from workbench.training.policy_gradient import completion_logps_and_entropies, grpo_loss, group_advantages

TEMPERATURE = 0.7
GROUP = 4  # num_generations
MAX_COMPLETION_LENGTH = 8  # dr_grpo's normaliser: wider than the completions below, so it is not their width
EPSILON_LOW = 0.2
EPSILON_HIGH = {"cispo": 1.3}  # cispo's is an absolute cap on the ratio; the others' the upper clip 1 + 0.28
EPSILON_HIGH_DEFAULT = 0.28
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-7
GRAD_RTOL = 1e-5  # of the largest gradient (float32 sums in other orders)
PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)])}
    words = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", padding_side="left")


def quality(prompts, completions, completion_ids, quality, **kwargs):
    return quality  # the reward rides in the row's `quality` column (None: no reward)


def brevity(prompts, completions, completion_ids, brevity, **kwargs):
    return brevity


@pytest.fixture(scope="module")
def models(tokenizer):
    """(TRL's trainer, the workbench's copy of its model, with the same weights)."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD,
                         bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
                         initializer_range=0.2)  # far from uniform: log-probabilities spread over nats
    model = LlamaForCausalLM(config).float()
    ours = copy.deepcopy(model)
    # beta 0 at construction: with beta > 0 and no adapter TRL would load a reference model by name (the tests
    # pass the reference log-probabilities in the inputs and set trainer.beta instead).
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=GROUP, num_generations=GROUP,
                      max_completion_length=MAX_COMPLETION_LENGTH, temperature=TEMPERATURE, loss_type="dapo",
                      beta=0.0, bf16=False, use_cpu=True, gradient_checkpointing=False, report_to="none",
                      save_strategy="no", seed=0)
    dataset = Dataset.from_dict({"prompt": ["w1 w2"], "quality": [1.0], "brevity": [0.0]})
    trainer = GRPOTrainer(model=model, reward_funcs=[quality, brevity], args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    assert trainer.model.training and not torch.is_autocast_enabled()
    for (name, theirs), mine in zip(trainer.model.named_parameters(), ours.parameters()):
        assert torch.equal(theirs, mine), name
    return trainer, ours


# -- the batch: 6 completions of 2 prompts, right padded, one truncated and one with no token that counts --------
PROMPT_IDS = torch.tensor([[PAD, 5, 6], [PAD, 5, 6], [PAD, 5, 6], [7, 8, 9], [7, 8, 9], [7, 8, 9]])
COMPLETION_IDS = torch.tensor([[10, 11, EOS, PAD, PAD, PAD], [12, 13, 14, 15, EOS, PAD],
                               [16, EOS, PAD, PAD, PAD, PAD], [17, 18, 19, 20, 21, 22],
                               [23, 24, 25, EOS, PAD, PAD], [26, 27, 28, 29, 30, 31]])
COMPLETION_MASK = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0],
                                [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0],
                                [0, 0, 0, 0, 0, 0]])  # truncated and masked (mask_truncated_completions)
ADVANTAGES = torch.tensor([0.9, -0.6, 1.2, -1.1, 0.4, -0.8])


def full_sequences():
    prompt_mask = (PROMPT_IDS != PAD).long()
    return torch.cat([PROMPT_IDS, COMPLETION_IDS], 1), torch.cat([prompt_mask, COMPLETION_MASK], 1), prompt_mask


def trl_logps(trainer):
    input_ids, attention_mask, _ = full_sequences()
    return trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask,
                                                      COMPLETION_IDS.shape[1], compute_entropy=True)[:2]


def our_logps(model):
    input_ids, attention_mask, _ = full_sequences()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return completion_logps_and_entropies(logits, COMPLETION_IDS, TEMPERATURE, COMPLETION_MASK)


def gradients(model) -> dict:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def report(what: str, difference: float) -> None:
    print(f"\n{what}: largest difference {difference:.2e}")


def test_logps_and_entropies_at_the_temperature(models):
    trainer, ours = models
    with torch.no_grad():
        (theirs, their_entropy), (mine, my_entropy) = trl_logps(trainer), our_logps(ours)
    assert theirs.shape == mine.shape == COMPLETION_IDS.shape
    assert theirs[COMPLETION_MASK.bool()].std() > 0.5  # not a uniform model: the temperature matters
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(my_entropy, their_entropy, rtol=1e-5, atol=2e-6)
    report("logps", (mine - theirs).abs().max().item())
    report("entropy", (my_entropy - their_entropy).abs().max().item())


CASES = [dict(loss_type=t, beta=b, off_policy=o) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
         for b in (0.0, 0.04) for o in (False, True)] + [
    dict(loss_type="grpo", beta=0.04, off_policy=True, delta=1.4),
    dict(loss_type="dapo", beta=0.0, off_policy=True, delta=1.4),
    dict(loss_type="grpo", beta=0.04, off_policy=True, level="sequence"),
    dict(loss_type="dapo", beta=0.04, off_policy=True, level="sequence"),
    dict(loss_type="bnpo", beta=0.04, off_policy=True, bias_correction=False),
    dict(loss_type="dr_grpo", beta=0.04, off_policy=False, bias_correction=False),
    dict(loss_type="grpo", beta=0.04, off_policy=True, accumulation=2),
    dict(loss_type="dapo", beta=0.04, off_policy=True, accumulation=2),
]


def case_id(case) -> str:
    extras = [f"{k}={v}" for k, v in case.items() if k not in ("loss_type", "beta", "off_policy")]
    policy = "off_policy" if case["off_policy"] else "on_policy"
    return "-".join([case["loss_type"], f"beta={case['beta']}", policy, *extras])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_loss_gradient_and_figures_equal_trl(models, case):
    trainer, ours = models
    loss_type, beta = case["loss_type"], case["beta"]
    epsilon_high = EPSILON_HIGH.get(loss_type, EPSILON_HIGH_DEFAULT)
    delta, level = case.get("delta"), case.get("level", "token")
    bias_correction, accumulation = case.get("bias_correction", True), case.get("accumulation", 1)
    trainer.loss_type, trainer.beta, trainer.importance_sampling_level = loss_type, beta, level
    trainer.epsilon_low, trainer.epsilon_high = EPSILON_LOW, epsilon_high
    trainer.args.delta, trainer.args.use_bias_correction_kl = delta, bias_correction
    trainer.current_gradient_accumulation_steps = accumulation  # set by HF's loop only
    trainer._metrics["train"].clear()

    # old and reference log-probabilities: the policy's, moved by noise (ratios on both sides of the clip range)
    with torch.no_grad():
        current = trl_logps(trainer)[0]
    noise = torch.Generator().manual_seed(1)
    old = ((current + 0.35 * torch.randn(current.shape, generator=noise)) * COMPLETION_MASK
           if case["off_policy"] else None)
    ref = (current + 0.3 * torch.randn(current.shape, generator=noise)) * COMPLETION_MASK if beta else None
    _, _, prompt_mask = full_sequences()
    inputs = dict(prompt_ids=PROMPT_IDS, prompt_mask=prompt_mask, completion_ids=COMPLETION_IDS,
                  completion_mask=COMPLETION_MASK, advantages=ADVANTAGES,
                  num_items_in_batch=COMPLETION_MASK.sum())  # one generation batch = this micro-batch
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref

    trainer.model.zero_grad(set_to_none=True)
    their_loss = trainer._compute_loss(trainer.model, inputs)
    their_loss.backward()
    their_gradients = gradients(trainer.model)
    their_figures = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    ours.zero_grad(set_to_none=True)
    logps, entropies = our_logps(ours)
    # the step's tokens: `accumulation` micro-batches like this one (TRL: num_items * accumulation / spg, spg = 1)
    my_loss, my_figures = grpo_loss(
        logps, old, ref, ADVANTAGES, COMPLETION_MASK, loss_type=loss_type, epsilon_low=EPSILON_LOW,
        epsilon_high=epsilon_high, delta=delta, beta=beta, use_bias_correction_kl=bias_correction,
        importance_sampling_level=level, max_completion_length=MAX_COMPLETION_LENGTH,
        num_tokens=COMPLETION_MASK.sum() * accumulation, parts=accumulation, entropies=entropies)
    my_loss.backward()
    my_gradients = gradients(ours)

    if case["off_policy"] and loss_type != "cispo" and level == "token":  # the clipping is exercised
        assert their_figures["clip_ratio/low_mean"] > 0 and their_figures["clip_ratio/high_mean"] > 0
    if delta is not None:  # the cap binds: a ratio above it where the advantage is negative
        ratios = torch.exp(current - old)
        assert ((ratios > delta) & (ADVANTAGES[:, None] < 0) & COMPLETION_MASK.bool()).any()
    if loss_type == "cispo" and case["off_policy"]:
        assert their_figures["cispo_clip_ratio"] > 0

    torch.testing.assert_close(my_loss.detach(), their_loss.detach(), rtol=LOSS_RTOL, atol=LOSS_ATOL)
    assert my_gradients.keys() == their_gradients.keys() and len(my_gradients) > 0
    largest = max(g.abs().max().item() for g in their_gradients.values())
    assert largest > 0
    gradient_difference = max((my_gradients[n] - g).abs().max().item() for n, g in their_gradients.items())
    assert gradient_difference <= GRAD_RTOL * largest, (gradient_difference, largest)

    assert my_figures.keys() == their_figures.keys()
    for name, value in their_figures.items():
        mine = my_figures[name].item()
        assert math.isclose(mine, value, rel_tol=1e-5, abs_tol=1e-6) or (math.isnan(mine) and math.isnan(value)), \
            (name, mine, value)
    report(f"{case_id(case)} loss {their_loss.item():.6f}", abs(my_loss.item() - their_loss.item()))
    report(f"{case_id(case)} gradient (largest {largest:.2e})", gradient_difference)
    if beta:
        report(f"{case_id(case)} kl {their_figures['kl']:.6f}", abs(my_figures["kl"].item() - their_figures["kl"]))


# -- advantages ------------------------------------------------------------------------------------------
NAN = None
REWARDS = [  # (quality, brevity) of 3 groups of GROUP completions
    (1.0, 0.5), (2.0, NAN), (0.0, 0.25), (3.0, 1.0),  # a function without a reward for one completion
    (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0),  # equal rewards: zero std
    (NAN, NAN), (2.0, 0.0), (5.0, 0.5), (0.0, NAN),  # a completion no function scored
]
WEIGHTS = [1.0, 0.5]


@pytest.mark.parametrize("scale, aggregation", [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"),
                                                ("none", "sum_then_normalize"), ("group", "normalize_then_sum")])
def test_advantages_and_reward_figures_equal_trl(models, tokenizer, scale, aggregation):
    trainer, _ = models
    trainer.beta, trainer.loss_type = 0.0, "dapo"  # no reference pass in the scoring
    trainer.scale_rewards, trainer.multi_objective_aggregation = scale, aggregation
    trainer.reward_weights = torch.tensor(WEIGHTS)
    trainer._metrics["train"].clear()
    completions = [[10 + i, EOS] for i in range(len(REWARDS))]
    trainer._generate = lambda prompts: ([[5, 6]] * len(REWARDS), completions, None,
                                         tokenizer.batch_decode(completions, skip_special_tokens=True), None, {},
                                         None, [])
    rows = [{"prompt": "w1 w2", "quality": q, "brevity": b} for q, b in REWARDS]
    theirs = trainer._generate_and_score_completions(rows)["advantages"]
    their_figures = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    rewards = torch.tensor([[math.nan if r is None else r for r in row] for row in REWARDS])
    mine, my_figures = group_advantages(rewards, WEIGHTS, GROUP, scale, aggregation, names=["quality", "brevity"])

    assert theirs[8] == 0 and theirs.abs().sum() > 0  # the unscored completion: no signal; the others: some
    if scale != "batch" and aggregation == "sum_then_normalize":
        assert their_figures["frac_reward_zero_std"] > 0
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    for name, value in my_figures.items():
        assert math.isclose(value.item(), their_figures[name], rel_tol=1e-6, abs_tol=1e-7), \
            (name, value.item(), their_figures[name])
    report(f"advantages {scale} {aggregation}", (mine - theirs).abs().max().item())
