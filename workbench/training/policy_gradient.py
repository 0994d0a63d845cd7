"""The math of GRPO (group-relative policy optimisation), as TRL's GRPOTrainer (1.16.0) computes it: the completion
tokens' log-probabilities under the sampling temperature, the group-relative advantages of the rewards, and the
clipped surrogate loss with its KL term and the figures TRL logs. Pure functions, tensors in and tensors out; the
generation, the reward functions and the loop that counts tokens over a step live elsewhere.

Notation: B completions (each prompt's G completions consecutive), C the completion width (right padded), m the
completion mask (1 on the tokens that count: the completion up to and including its first EOS), logp the policy's
per-token log-probabilities (with gradient), old the sampling policy's (no gradient), ref the reference model's,
A the advantages, w = exp(logp - old) the importance ratio.

Checked against TRL's own code on the same inputs in tests/test_grpo_loss.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

STD_EPSILON = 1e-4  # added to a std before dividing by it (TRL's constant)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
# (TRL's loss-type names; "grpo" the loss type, named apart from the objective it shares its name with)
GRPO_LOSS = LOSS_TYPES[0]
SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


# -- log-probabilities of the completion tokens --------------------------------------------------------


def completion_logps(logits, completion_ids, temperature: float = 1.0, completion_mask=None):
    """(B, C) log-probability of each completion token under the sampling temperature, from the logits of the
    whole prompt + completion (B, P + C, V): position t's logits predict token t + 1, divided by the temperature
    before the softmax, in float32, as TRL scores completions (the temperature the tokens were drawn at, so the
    ratio to the sampling policy starts at 1). With completion_mask, positions outside it are 0 (TRL's value there)."""
    return _scored(logits, completion_ids, temperature, completion_mask, entropy=False)[0]


def completion_logps_and_entropies(logits, completion_ids, temperature: float = 1.0, completion_mask=None):
    """completion_logps and, for each completion position, the entropy of the tempered next-token distribution
    (TRL's `entropy` figure, also 0 outside completion_mask where it is given)."""
    return _scored(logits, completion_ids, temperature, completion_mask, entropy=True)


def _scored(logits, completion_ids, temperature, completion_mask, entropy: bool):
    width = completion_ids.shape[1]
    scaled = logits[:, -width - 1:-1, :].float() / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    logps = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    entropies = -(log_probs.exp() * log_probs).sum(-1) if entropy else None
    if completion_mask is not None:
        mask = completion_mask.to(logps.dtype)
        logps = logps * mask
        entropies = entropies * mask if entropies is not None else None
    return logps, entropies


# -- advantages --------------------------------------------------------------------------------------


def nanstd(values, dim: int | None = None, keepdim: bool = False):
    """The standard deviation of the values that are not NaN, with Bessel's correction (n - 1); NaN where fewer
    than two are left (TRL's nanstd: torch has none)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    if keepdim:
        return std
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(rewards_per_function, weights, group_size: int, scale: str = "group",
                     aggregation: str = "sum_then_normalize", names: Sequence[str] | None = None):
    """Each completion's advantage, and the reward figures TRL logs, from the rewards of the whole generation
    batch (N, F): N completions, each prompt's group_size in a row (gathered from every rank first, so a group is
    whole), F reward functions, NaN where a function gave no reward (TRL turns a None into NaN).

    - sum_then_normalize (TRL's default): r = the weighted sum of the functions' rewards, a NaN adding 0;
      A = r - the group's mean, divided by std + 1e-4 where the std is the group's ("group"), the whole batch's
      ("batch": the mean stays the group's), or not at all ("none").
    - normalize_then_sum: each function's rewards normalised within their group first, then the weighted sum
      normalised over the batch (scale is not read, as in TRL).

    A completion every function left NaN is out of its group's mean and std and gets advantage 0, as does any
    completion whose advantage comes out NaN (a group with a single scored completion under "group"). Stds are
    Bessel-corrected. The figures (0-d tensors): rewards/<name>/mean and /std of each function (names default to
    func0, func1, ...), reward and reward_std of the weighted sum, and frac_reward_zero_std, the share of
    completions whose std (the one used: group or batch) is 0."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, not {scale!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {aggregation!r}")
    rewards_per_function = rewards_per_function.float()
    count, functions = rewards_per_function.shape
    if count % group_size:
        raise ValueError(f"{count} completions do not make groups of {group_size}")
    weights = torch.as_tensor(weights, dtype=torch.float32, device=rewards_per_function.device).reshape(1, -1)
    unscorable = torch.isnan(rewards_per_function).all(dim=1)

    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_function * weights).nansum(dim=1).masked_fill(unscorable, float("nan"))
        groups = rewards.view(-1, group_size)
        group_mean = torch.nanmean(groups, dim=1).repeat_interleave(group_size)
        if scale == "batch":
            std = nanstd(rewards).expand_as(rewards) if count > 1 else torch.zeros_like(rewards)
        else:  # "none" computes the group's std only for frac_reward_zero_std
            std = nanstd(groups, dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
        advantages = rewards - group_mean
        if scale != "none":
            advantages = advantages / (std + STD_EPSILON)
    else:
        grouped = rewards_per_function.view(-1, group_size, functions)
        mean = torch.nanmean(grouped, dim=1, keepdim=True)
        spread = nanstd(grouped, dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        normalised = ((grouped - mean) / (spread + STD_EPSILON)).view(-1, functions)
        rewards = (normalised * weights).nansum(dim=1).masked_fill(unscorable, float("nan"))
        std = nanstd(rewards).expand_as(rewards) if count > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + STD_EPSILON)
    advantages = torch.nan_to_num(advantages, nan=0.0)

    names = list(names) if names is not None else [f"func{i}" for i in range(functions)]
    stats = {}
    for i, name in enumerate(names):
        stats[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_function[:, i])
        stats[f"rewards/{name}/std"] = nanstd(rewards_per_function[:, i])
    total = (rewards_per_function * weights).nansum(dim=1).masked_fill(unscorable, float("nan"))
    stats["reward"] = torch.nanmean(total)
    stats["reward_std"] = nanstd(total)
    stats["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean()
    return advantages, stats


# -- the loss ----------------------------------------------------------------------------------------


def importance_ratios(logps, old_logps, completion_mask, level: str = "token"):
    """w = exp(logp - old): (B, C) per token, or (B, 1) per sequence ("sequence", GSPO: the exponential of the
    mean log-ratio over the completion's tokens). old_logps None means on-policy (one optimiser step per
    generation batch): old = logp without gradient, so w is 1 and its gradient is logp's."""
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old_logps
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        mask = completion_mask.to(log_ratio.dtype)
        return torch.exp((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', not {level!r}")


def k3_kl(logps, ref_logps):
    """Per-token KL(policy || reference) estimate exp(ref - logp) - (ref - logp) - 1 (Schulman's k3: never
    negative, unbiased on samples of the policy)."""
    difference = ref_logps - logps
    return torch.exp(difference) - difference - 1


def grpo_token_losses(logps, old_logps, ref_logps, advantages, completion_mask, *, loss_type: str = "dapo",
                      epsilon_low: float = 0.2, epsilon_high: float | None = None, delta: float | None = None,
                      beta: float = 0.0, use_bias_correction_kl: bool = True,
                      importance_sampling_level: str = "token"):
    """(per-token losses before masking, the importance ratio w, the per-token KL or None), TRL's per-token terms:

    - grpo, bnpo, dr_grpo, dapo (they differ only in how the tokens are averaged, `grpo_loss`): the PPO clipped
      surrogate -min(w A, clamp(w, 1 - epsilon_low, 1 + epsilon_high) A); with delta, the unclipped w is capped
      at delta first (two-sided clipping: a negative advantage cannot push through an unbounded ratio);
    - cispo: -min(w, epsilon_high) A logp, the capped ratio without gradient (epsilon_high is an absolute cap here);
    - plus beta * k3 KL to the reference where beta != 0, the KL multiplied by w when use_bias_correction_kl
      (TRL's default: an importance-sampling correction that, w keeping its gradient, also changes the KL's
      gradient on-policy).

    epsilon_high None means epsilon_low (TRL). advantages: (B,) or (B, C). ref_logps is read only when beta != 0."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, not {loss_type!r}")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = importance_ratios(logps, old_logps, completion_mask, importance_sampling_level)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference model's log-probabilities")
        kl = k3_kl(logps, ref_logps)
        if use_bias_correction_kl:
            kl = kl * ratio
    if loss_type == "cispo":
        losses = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logps
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
        losses = -torch.min(unclipped * advantages, clipped * advantages)
    if kl is not None:
        losses = losses + beta * kl
    return losses, ratio, kl


def grpo_loss(logps, old_logps, ref_logps, advantages, completion_mask, *, loss_type: str = "dapo",
              epsilon_low: float = 0.2, epsilon_high: float | None = None, delta: float | None = None,
              beta: float = 0.0, use_bias_correction_kl: bool = True, importance_sampling_level: str = "token",
              max_completion_length: int | None = None, num_tokens=None, parts: int = 1, entropies=None):
    """(this micro-batch's loss, the figures TRL logs) from `grpo_token_losses`, averaged over the tokens as TRL's
    loss types do (L: the per-token losses, masked):

    - grpo: each completion's token mean, then the mean over completions (long answers weigh no more than short);
    - bnpo: the token mean over the micro-batch;
    - dr_grpo: sum(L) / (B * max_completion_length), a constant normaliser (Dr. GRPO: no length bias);
    - dapo, cispo: sum(L) / num_tokens, num_tokens being the completion tokens of the whole optimiser step, over
      all its micro-batches and processes (counted by the loop before the first backward), so the step's loss is
      the token mean over the step. TRL's per-process normaliser num_items_in_batch / num_processes *
      accumulation_steps / steps_per_generation is that count's share of one process, which DDP's gradient
      average makes whole.

    grpo, bnpo and dr_grpo are divided by parts, the number of micro-batch losses whose gradients the step adds
    up (TRL: its gradient accumulation steps; DDP then averages over processes).

    The figures, 0-d tensors without gradient, as TRL names them, over this micro-batch: kl (mean of the
    per-token KL after the correction, where beta != 0), entropy (where entropies are given), and
    clip_ratio/low_mean, high_mean, region_mean (shares of tokens with w < 1 - epsilon_low and A < 0, w > 1 +
    epsilon_high and A > 0, either), clip_ratio/low_min and high_max (the least and most of the per-completion
    shares), or cispo_clip_ratio (w > epsilon_high and A > 0) for cispo."""
    losses, ratio, kl = grpo_token_losses(
        logps, old_logps, ref_logps, advantages, completion_mask, loss_type=loss_type, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, delta=delta, beta=beta, use_bias_correction_kl=use_bias_correction_kl,
        importance_sampling_level=importance_sampling_level)
    mask = completion_mask.to(losses.dtype)
    masked = losses * mask
    if loss_type == GRPO_LOSS:
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / parts
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0) / parts
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo divides by max_completion_length: pass it")
        loss = masked.sum() / (losses.shape[0] * max_completion_length) / parts
    else:
        if num_tokens is None:
            raise ValueError(f"{loss_type} divides by the step's completion tokens: pass num_tokens")
        loss = masked.sum() / torch.as_tensor(num_tokens, dtype=losses.dtype, device=losses.device).clamp(min=1.0)
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    return loss, grpo_metrics(ratio, advantages, completion_mask, kl, entropies, loss_type, epsilon_low, epsilon_high)


def grpo_metrics(ratio, advantages, completion_mask, kl, entropies, loss_type: str, epsilon_low: float,
                 epsilon_high: float) -> dict:
    """The figures `grpo_loss` reports (see there), as TRL's GRPOTrainer logs them for one process."""
    mask = completion_mask.float()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)

    def mean(values):  # over the masked tokens; a (B, 1) value is one per completion
        values = values.detach().float()
        if values.shape[1] == 1:
            return values.sum() / values.shape[0]
        return (values * mask).sum() / mask.sum().clamp(min=1.0)

    def per_completion(values):  # NaN for a completion without tokens
        values = values.detach().float()
        return values.squeeze(1) if values.shape[1] == 1 else (values * mask).sum(-1) / mask.sum(-1)

    metrics = {}
    if kl is not None:
        metrics["kl"] = mean(kl)
    if entropies is not None:
        metrics["entropy"] = mean(entropies)
    ratio = ratio.detach()
    if loss_type == "cispo":
        metrics["cispo_clip_ratio"] = mean(((ratio > epsilon_high) & (advantages > 0)).float())
        return metrics
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    metrics["clip_ratio/low_mean"] = mean(low.float())
    metrics["clip_ratio/high_mean"] = mean(high.float())
    metrics["clip_ratio/region_mean"] = mean((low | high).float())
    metrics["clip_ratio/low_min"] = _nan_extreme(per_completion(low.float()), torch.min)
    metrics["clip_ratio/high_max"] = _nan_extreme(per_completion(high.float()), torch.max)
    return metrics


def _nan_extreme(values, extreme):
    kept = values[~torch.isnan(values)]
    return extreme(kept) if kept.numel() else values.new_tensor(float("nan"))
