"""What the loss optimizes: the next-token loss (`sft`), a preference between two answers (`dpo`, `orpo`),
desirable and undesirable answers on their own (`kto`), or a reward model's scores of two answers (`reward`).

Every objective gives the loop the same pieces, so the loop has one path for all of them:

- `counts(model, batch)`: what the loss is normalised by (target tokens, pairs, chosen-answer tokens) and, for
  KTO, the sums its KL estimate is made of. The loop sums them over the step's micro-batches and ranks before the
  first backward;
- `loss(model, batch, totals)`: this micro-batch's part of the step's loss, normalised by those totals, so the
  parts over micro-batches and ranks add up to the step's loss whatever the accumulation and world size (the
  rule the SFT loss has always followed);
- `sums`: what the logged figures are made of, a vector summed over a logging window and the ranks, which
  `report` turns into metrics (`loss`, and for preferences the rewards, their margin and accuracy);

Preference rows hold a pair as two samples of one row (workbench/data/pipeline.py): sample 2k is the chosen answer,
2k + 1 the rejected one, whichever row and micro-batch the pair lands in (with a shared prompt, sample 2k holds
the prompt and 2k + 1 continues it: the same log-probabilities). Unpaired rows hold their answer as sample 2k
and another row's answer to the same prompt as 2k + 1 (KTO's mismatched KL sample), with one `desirable` label
per row. The reference of DPO and KTO is the base model with the adapter switched off: no second copy of the
weights.

Definitions (as the papers and TRL's trainers compute them; checked against TRL in tests/test_objectives.py):
- DPO: logp = the answer's summed token log-probability; reward = beta * (logp - logp_reference);
  loss per pair = -log sigmoid(reward_chosen - reward_rejected).
- ORPO: logp = the answer's mean token log-probability; odds(p) = p / (1 - p);
  loss = NLL of the chosen answers' tokens + lambda * mean over pairs of -log sigmoid(log odds(chosen) -
  log odds(rejected)); reward = lambda * logp.
- KTO: logp summed as DPO's; z = max(0, mean over the step's KL samples of logp - logp_reference), no gradient;
  loss per row = desirable_weight * (1 - sigmoid(beta * (logratio - z))) for a desirable answer,
  undesirable_weight * (1 - sigmoid(beta * (z - logratio))) for an undesirable one; mean over rows. TRL
  estimates z per micro-batch (averaged over ranks); the workbench over the whole step, the same for one
  micro-batch and less noisy with accumulation. A row is classified right when its reward lies on its label's
  side of the reference point beta * z (reward_accuracy).
- Reward model: reward = the score head's output at the answer's last token; loss = mean over pairs of
  -log sigmoid(reward_chosen - reward_rejected) (+ c * (reward_chosen + reward_rejected)^2 with
  reward_center_coefficient c), as TRL's RewardTrainer.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from workbench.data.batches import sample_starts
from workbench.data.tokens import IGNORE
from workbench.model.lm_loss import CHUNK_ELEMENTS, causal_lm_of, head_bypassed, plain_head

# the counts vector: what losses are normalised by, KTO's KL estimate (summed log-ratios, samples), and the
# micro-batches of the step (GRPO's grpo, bnpo and dr_grpo losses divide by them, as TRL by its accumulation steps)
TARGETS, PAIRS, CHOSEN_TARGETS, KL_SUM, KL_SAMPLES, MICRO_BATCHES = range(6)
COUNTS = 6
PREFERENCE_METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen",
                      "logps_rejected", "kl")


@dataclass
class Part:
    loss: torch.Tensor  # this micro-batch's share of the step's (normalised) loss: backward goes through it
    sums: torch.Tensor  # the objective's logged sums over this micro-batch


def counts(batch: dict) -> torch.Tensor:
    """[target tokens, pairs, chosen-answer target tokens, 0, 0, 1] of a micro-batch, on its device."""
    labels = batch["labels"]
    targets = (labels != IGNORE).sum()
    pairs = torch.tensor(batch.get("num_samples", 0) // 2, device=labels.device)
    chosen = ((labels != IGNORE) & (sample_index(batch["position_ids"]) % 2 == 0).view_as(labels)).sum()
    zero, one = torch.zeros((), device=labels.device), torch.ones((), device=labels.device)
    return torch.stack([targets.float(), pairs.float(), chosen.float(), zero, zero, one])


def sample_index(position_ids: torch.Tensor) -> torch.Tensor:
    """For each position (flattened), the batch-wide index of the sample it belongs to (data.sample_starts;
    padding continues the row's last sample and carries no target)."""
    return sample_starts(position_ids).flatten().cumsum(0) - 1


def only_samples(batch: dict, parity: int) -> dict:
    """The batch with targets kept only in its even (parity 0) or odd (1) samples: the forward is the same, the
    LM head runs over the kept targets alone."""
    odd = (sample_index(batch["position_ids"]) % 2 == 1).view_as(batch["labels"])
    return {**batch, "labels": batch["labels"].masked_fill(odd if parity == 0 else ~odd, IGNORE)}


# -- the objectives ---------------------------------------------------------------------------------


class Objective:
    name: str
    sum_names: tuple[str, ...]
    final_metrics = PREFERENCE_METRICS  # the report's figures the run's summary keeps as <name>_final

    def counts(self, model, batch) -> torch.Tensor:
        return counts(batch)

    def report_window(self, sums, process_seconds: float) -> dict:
        """`report` of a logging window that took process_seconds (wall seconds times processes)."""
        return self.report(sums)


class SFT(Objective):
    name = "sft"
    sum_names = ("loss_sum", "targets")

    def __init__(self, loss_sum_of):
        self.loss_sum_of = loss_sum_of  # the chunked or the full-logits next-token loss (workbench/model/lm_loss.py)

    def loss(self, model, batch, totals) -> Part:
        loss_sum = self.loss_sum_of(model, batch)
        targets = (batch["labels"] != IGNORE).sum().float()
        return Part(loss_sum / totals[TARGETS].clamp(min=1), torch.stack([loss_sum.detach().float(), targets]))

    def report(self, sums) -> dict:
        return {"loss": float(sums[0] / sums[1]) if sums[1] > 0 else None}


class DPO(Objective):
    name = "dpo"
    sum_names = ("loss_sum", "pairs", "rewards_chosen", "rewards_rejected", "correct", "logps_chosen",
                 "logps_rejected")

    def __init__(self, beta: float, adapter_off):
        self.beta = beta
        self.adapter_off = adapter_off  # a context in which the model is its frozen base

    def loss(self, model, batch, totals) -> Part:
        with torch.no_grad(), self.adapter_off():  # first: nothing of it is kept for backward
            reference, _ = sample_logps(model, batch)
        logps, _ = sample_logps(model, batch)
        losses, chosen_rewards, rejected_rewards = dpo_losses(logps[0::2], logps[1::2], reference[0::2],
                                                              reference[1::2], self.beta)
        sums = torch.stack([losses.detach().sum(), torch.tensor(float(len(losses)), device=losses.device),
                            chosen_rewards.sum(), rejected_rewards.sum(),
                            (chosen_rewards > rejected_rewards).float().sum(),
                            logps[0::2].detach().sum(), logps[1::2].detach().sum()])
        return Part(losses.sum() / totals[PAIRS].clamp(min=1), sums)

    def report(self, sums) -> dict:
        return preference_report(sums[0] / sums[1] if sums[1] > 0 else None, sums[1], sums[2:])


class ORPO(Objective):
    name = "orpo"
    sum_names = ("nll_sum", "chosen_targets", "odds_ratio_sum", "pairs", "rewards_chosen", "rewards_rejected",
                 "correct", "logps_chosen", "logps_rejected")

    def __init__(self, lam: float):
        self.lam = lam

    def loss(self, model, batch, totals) -> Part:
        logps, tokens = sample_logps(model, batch)
        nll_sum = -logps[0::2].sum()  # the chosen answers' next-token loss, summed over their tokens
        mean_logps = logps / tokens.clamp(min=1)
        odds_ratio, chosen_rewards, rejected_rewards = orpo_terms(mean_logps[0::2], mean_logps[1::2], self.lam)
        loss = nll_sum / totals[CHOSEN_TARGETS].clamp(min=1) + self.lam * odds_ratio.sum() / totals[PAIRS].clamp(min=1)
        sums = torch.stack([nll_sum.detach(), tokens[0::2].sum(), odds_ratio.detach().sum(),
                            torch.tensor(float(len(odds_ratio)), device=logps.device),
                            chosen_rewards.sum(), rejected_rewards.sum(),
                            (chosen_rewards > rejected_rewards).float().sum(),
                            mean_logps[0::2].detach().sum(), mean_logps[1::2].detach().sum()])
        return Part(loss, sums)

    def report(self, sums) -> dict:
        nll, chosen_targets, odds_ratio, pairs = sums[0], sums[1], sums[2], sums[3]
        loss = nll / chosen_targets + self.lam * odds_ratio / pairs if pairs > 0 and chosen_targets > 0 else None
        return preference_report(loss, pairs, sums[4:])


class KTO(Objective):
    name = "kto"
    sum_names = ("loss_sum", "rows", "rewards_desirable", "desirable", "rewards_undesirable", "undesirable",
                 "logps_desirable", "logps_undesirable", "kl_rows", "correct")

    def __init__(self, beta: float, desirable_weight: float, undesirable_weight: float, adapter_off):
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight
        self.adapter_off = adapter_off

    def counts(self, model, batch) -> torch.Tensor:
        """The KL estimate's sums: the mismatched samples' log-ratios, policy (no gradient) against reference. The
        reference pass scores the answers too, kept with the micro-batch for its loss."""
        totals = counts(batch)
        with torch.no_grad():
            with self.adapter_off():
                reference, _ = sample_logps(model, batch)
            policy, _ = sample_logps(model, only_samples(batch, parity=1))
        batch["reference_logps"] = reference[0::2]
        log_ratios = policy[1::2] - reference[1::2]
        totals[KL_SUM], totals[KL_SAMPLES] = log_ratios.sum(), log_ratios.numel()
        return totals

    def loss(self, model, batch, totals) -> Part:
        kl = (totals[KL_SUM] / totals[KL_SAMPLES].clamp(min=1)).clamp(min=0)
        reference = batch.get("reference_logps")
        if reference is None:  # counts ran elsewhere (an evaluation reading its own counts does not)
            with torch.no_grad(), self.adapter_off():
                reference = sample_logps(model, only_samples(batch, parity=0))[0][0::2]
        logps = sample_logps(model, only_samples(batch, parity=0))[0][0::2]
        desirable = batch["desirable"].to(logps.device)
        losses, rewards = kto_losses(logps - reference, kl, desirable, self.beta, self.desirable_weight,
                                     self.undesirable_weight)
        undesirable = ~desirable
        sums = torch.stack([losses.detach().sum(), torch.tensor(float(len(losses)), device=losses.device),
                            rewards[desirable].sum(), desirable.sum().float(),
                            rewards[undesirable].sum(), undesirable.sum().float(),
                            logps.detach()[desirable].sum(), logps.detach()[undesirable].sum(),
                            kl.detach() * len(losses), right_side(rewards, self.beta * kl, desirable).float().sum()])
        return Part(losses.sum() / totals[PAIRS].clamp(min=1), sums)

    def report(self, sums) -> dict:
        loss, rows, reward_d, n_d, reward_u, n_u, logps_d, logps_u, kl_rows, correct = (float(x) for x in sums)
        row = {"loss": loss / rows if rows > 0 else None}
        if rows > 0:
            row.update(kl=kl_rows / rows, reward_accuracy=correct / rows)
        if n_d > 0:
            row.update(rewards_chosen=reward_d / n_d, logps_chosen=logps_d / n_d)
        if n_u > 0:
            row.update(rewards_rejected=reward_u / n_u, logps_rejected=logps_u / n_u)
        if n_d > 0 and n_u > 0:
            row["reward_margin"] = row["rewards_chosen"] - row["rewards_rejected"]
        return row


class Reward(Objective):
    """A reward model: the score head's value at each answer's last token is its reward, and the chosen answer's
    should exceed the rejected one's (Bradley-Terry)."""
    name = "reward"
    sum_names = ("loss_sum", "pairs", "rewards_chosen", "rewards_rejected", "correct")

    def __init__(self, center_coefficient: float | None, pad_token_id: int):
        self.center_coefficient, self.pad_token_id = center_coefficient, pad_token_id

    def loss(self, model, batch, totals) -> Part:
        rewards = sequence_rewards(model, batch, self.pad_token_id)
        chosen, rejected = rewards[0::2], rewards[1::2]
        losses = reward_losses(chosen, rejected, self.center_coefficient)
        chosen, rejected = chosen.detach(), rejected.detach()
        sums = torch.stack([losses.detach().sum(), torch.tensor(float(len(losses)), device=losses.device),
                            chosen.sum(), rejected.sum(), (chosen > rejected).float().sum()])
        return Part(losses.sum() / totals[PAIRS].clamp(min=1), sums)

    def report(self, sums) -> dict:
        loss, pairs, chosen, rejected, correct = (float(x) for x in sums)
        if pairs == 0:
            return {"loss": None}
        return {"loss": loss / pairs, "rewards_chosen": chosen / pairs, "rewards_rejected": rejected / pairs,
                "reward_margin": (chosen - rejected) / pairs, "reward_accuracy": correct / pairs}


def adapter_off_of(peft_model):
    """DPO's reference: the same model with its adapter switched off (peft's disable_adapter)."""
    disable = getattr(peft_model, "disable_adapter", None)
    return disable if callable(disable) else nullcontext


def preference_report(loss, pairs, sums) -> dict:
    row = {"loss": float(loss) if loss is not None else None}
    if pairs > 0:
        chosen, rejected, correct, logps_chosen, logps_rejected = (float(x / pairs) for x in sums)
        row.update(rewards_chosen=chosen, rewards_rejected=rejected, reward_margin=chosen - rejected,
                   reward_accuracy=correct, logps_chosen=logps_chosen, logps_rejected=logps_rejected)
    return row


# -- the losses -------------------------------------------------------------------------------------


def dpo_losses(chosen, rejected, reference_chosen, reference_rejected, beta: float):
    """Per-pair DPO (sigmoid) losses and the implicit rewards (detached)."""
    chosen_ratio, rejected_ratio = chosen - reference_chosen, rejected - reference_rejected
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def right_side(rewards, point, desirable):
    """Rows whose reward lies strictly on their label's side of the reference point (a tie is right for neither)."""
    return torch.where(desirable, rewards > point, rewards < point)


def kto_losses(log_ratios, kl, desirable, beta: float, desirable_weight: float, undesirable_weight: float):
    """Per-row KTO losses and the implicit rewards beta * log-ratio (detached). kl: the step's KL estimate,
    already clamped at 0 and without gradient."""
    margin = beta * (log_ratios - kl)
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(margin)),
                         undesirable_weight * (1 - torch.sigmoid(-margin)))
    return losses, beta * log_ratios.detach()


def reward_losses(chosen, rejected, center_coefficient: float | None = None):
    """Per-pair reward-model losses: -log sigmoid(r_chosen - r_rejected), plus center_coefficient *
    (r_chosen + r_rejected)^2 where set (TRL's center_rewards_coefficient, whose batch mean is the mean of these)."""
    losses = -F.logsigmoid(chosen - rejected)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_terms(chosen_mean, rejected_mean, lam: float):
    """Per-pair odds-ratio losses -log sigmoid(log odds(chosen) - log odds(rejected)) from mean token
    log-probabilities, and the rewards lambda * logp (detached)."""
    chosen_mean, rejected_mean = chosen_mean.float(), rejected_mean.float()
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
    return -F.logsigmoid(log_odds), lam * chosen_mean.detach(), lam * rejected_mean.detach()


# -- log-probabilities of each sample's answer --------------------------------------------------------


def sample_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each sample's target tokens, how many there are), one entry per sample of the
    batch in order. The head runs a chunk of positions at a time; each chunk's logits are recomputed in
    backward rather than kept (the vocabulary-sized tensors never outlive their chunk)."""
    samples = batch["num_samples"]
    targets = batch["labels"].flatten()
    token_logps, index, counted = _target_logps(model, batch, targets, sample_index(batch["position_ids"]))
    zeros = torch.zeros(samples, dtype=torch.float32, device=targets.device)
    return zeros.index_add(0, index, token_logps), zeros.index_add(0, index, counted)


def sequence_rewards(model, batch, pad_token_id: int) -> torch.Tensor:
    """Each sample's reward, in order: the score head's output at the sample's last token that is not the pad
    token, the token a sequence classifier's own pooling reads in a row of one sample (so the merged or
    adapter-loaded model scores a sample as training did; where the pad token is the EOS, the token before the
    EOS). The head scores every position in the forward (hidden size x 1); the classifier's own pooling, one
    token per row, is not read, so packed rows and pairs hold several samples each."""
    input_ids = batch["input_ids"]
    scored = []
    hook = score_head(model).register_forward_hook(lambda module, args, output: scored.append(output))
    try:
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    finally:
        hook.remove()
    scores = scored[-1].flatten().float()
    real = (input_ids != pad_token_id).flatten()  # padding continues a row's last sample: never its last token
    place = torch.arange(real.numel(), device=input_ids.device)
    last = torch.zeros(batch["num_samples"], dtype=torch.long, device=input_ids.device).scatter_reduce(
        0, sample_index(batch["position_ids"])[real], place[real], "amax")
    return scores[last]


def score_head(model) -> torch.nn.Module:
    """A sequence classifier's `score` head (peft's wrapper of it, when it trains beside an adapter), through any
    wrapper of the layout (DDP, DeepSpeed, FSDP2 keep the module names)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "score":
            return module
    raise ValueError(f"{type(model).__name__} has no score head: a reward model is loaded as a sequence classifier")


def _target_logps(model, batch, targets, index):
    """Each target token's log-probability, the sample each belongs to, and 1 where it counts (0: no target)."""
    valid = targets != IGNORE
    causal_lm = causal_lm_of(model)
    head = plain_head(causal_lm)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    if head is None:  # sharded or adapted heads: the model's own logits
        hidden, weight, dtype = model(**inputs).logits.flatten(0, 1), None, None
    else:
        name, module = head
        with head_bypassed(causal_lm, name) as passthrough:
            hidden = model(**inputs).logits.flatten(0, 1)
        weight = module.weight
        dtype = passthrough.autocast_dtype or (weight.dtype if weight.dtype == hidden.dtype else hidden.dtype)
    if hidden.device.type == "cpu":  # no work for prompt positions (no device to keep in flight)
        rows = valid.nonzero().squeeze(1)
        hidden, targets, index, keep = hidden.index_select(0, rows), targets.index_select(0, rows), \
            index.index_select(0, rows), None
    else:  # accelerators: every position, no host sync for the count
        targets, keep = targets.clamp(min=0), valid
    width = weight.shape[0] if weight is not None else hidden.shape[-1]
    chunk = max(64, CHUNK_ELEMENTS // width)
    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start:start + chunk], targets[start:start + chunk]
        if weight is None:
            pieces.append(_logps_from_logits(h, t))
        elif torch.is_grad_enabled():
            pieces.append(checkpoint(_logps_from_hidden, h, weight, t, dtype, use_reentrant=False))
        else:
            pieces.append(_logps_from_hidden(h, weight, t, dtype))
    token_logps = torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)
    if keep is None:
        return token_logps, index, torch.ones_like(token_logps)
    return token_logps * keep, index, keep.float()


def _logps_from_hidden(hidden, weight, targets, dtype):
    with torch.autocast(hidden.device.type, enabled=False):
        return _logps_from_logits(hidden.to(dtype) @ weight.to(dtype).t(), targets)


def _logps_from_logits(logits, targets):
    logits = logits.float()
    return logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(dim=-1)
