"""GRPO in the loop (`training.objective: grpo`): sample answers, score them, raise the better ones.

It is an objective like the others (workbench/training/objectives.py), so the loop has one path:

- `counts(model, batch)`, run for every micro-batch of a step before the first backward, is the rollout: each of
  the micro-batch's prompts is answered `num_generations` (G) times by the model as it is (adapter on, eval mode,
  no gradient, KV cache), each answer cut after its first EOS (kept, as TRL does), scored by the rewards, and given
  its advantage within its group (a prompt's G answers are always in one micro-batch on one process, so a group
  is whole where its advantages are computed). With training.grpo.beta > 0 the reference (adapter off) scores
  the answers too. It counts the answers' tokens, which dapo and cispo average over, and the micro-batch, which
  grpo, bnpo and dr_grpo divide by: summed over the step's micro-batches and processes, the parts add up to the
  step's loss, as TRL's gradient accumulation and DDP mean make it;
- `loss(model, batch, totals)` is one forward with gradient over prompt + answer, the answer tokens'
  log-probabilities at the sampling temperature, and policy_gradient.grpo_loss. One optimiser step per
  generation batch: the sampling policy is the policy (old = logp without gradient, TRL's num_iterations 1).

The math is workbench/training/policy_gradient.py's (checked against TRL in tests/test_grpo_loss.py); the
rewards are workbench/spec/rewards.py's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from workbench.base.metric_names import REWARD_METRIC
from workbench.model.lm_loss import causal_lm_of
from workbench.spec.rewards import resolve
from workbench.training import policy_gradient
from workbench.training.objectives import COUNTS, MICRO_BATCHES, TARGETS, Objective, Part

# what each micro-batch adds to the logged sums (then the rewards' own: sum, sum of squares, count of each)
SUMS = ("loss_sum", "steps", "completions", "completion_tokens", "terminated", "reward_sum", "reward_squares",
        "rewards_counted", "zero_std", "kl_tokens", "entropy_tokens", "clip_low_tokens", "clip_high_tokens",
        "clip_region_tokens", "cispo_clip_tokens", "generation_s")
CLIP_FIGURES = (("clip_low_tokens", "clip_ratio/low_mean"), ("clip_high_tokens", "clip_ratio/high_mean"),
                ("clip_region_tokens", "clip_ratio/region_mean"), ("cispo_clip_tokens", "cispo_clip_ratio"))


@dataclass
class Rollout:
    """One micro-batch's sampled answers, ready for the loss: B = prompts x G rows, prompts left-padded to P,
    answers right-padded to C."""
    input_ids: torch.Tensor  # (B, P + C)
    attention_mask: torch.Tensor  # (B, P + C): 0 on padding
    completion_ids: torch.Tensor  # (B, C)
    completion_mask: torch.Tensor  # (B, C): the answer up to and including its first EOS
    advantages: torch.Tensor  # (B,)
    ref_logps: torch.Tensor | None  # (B, C) where beta > 0
    sums: torch.Tensor  # the rollout's part of the logged sums (rewards, lengths, generation time)
    texts: list[str]  # the decoded answers (tests, and what a reward read)

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions counted over the real tokens: the same as generation used (left padding takes none)."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)


class GRPO(Objective):
    name = "grpo"
    final_metrics = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "kl", "entropy",
                     "generation_share")

    def __init__(self, settings, tokenizer, adapter_off):
        self.cfg, self.tokenizer, self.adapter_off = settings, tokenizer, adapter_off
        self.rewards = resolve(settings.rewards, settings.allow_code_rewards)
        self.weights = list(settings.reward_weights or [1.0] * len(self.rewards))
        self.sum_names = SUMS + tuple(f"{r.name}/{part}" for r in self.rewards
                                      for part in ("sum", "squares", "counted"))
        self.shortest, self.longest = math.inf, 0  # this process's answer lengths since the last report

    # -- the rollout ---------------------------------------------------------------------------------------------

    def counts(self, model, batch) -> torch.Tensor:
        rollout = batch["rollout"] = self.rollout(model, batch)
        totals = torch.zeros(COUNTS, device=rollout.completion_mask.device)
        totals[TARGETS] = rollout.completion_mask.sum()
        totals[MICRO_BATCHES] = 1
        return totals

    def rollout(self, model, batch) -> Rollout:
        cfg, tokenizer = self.cfg, self.tokenizer
        group = cfg.num_generations
        prompt_ids, prompt_mask = left_padded(batch["input_ids"], batch["prompt_lengths"], tokenizer.pad_token_id)
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
        started = time.perf_counter()
        completion_ids, completion_mask, terminated = self.sample(model, prompt_ids, prompt_mask)
        lengths = completion_mask.sum(-1).tolist()  # (read on the host: the generation is done)
        generation_s = time.perf_counter() - started

        rows = [row for row in batch["rows"] for _ in range(group)]
        texts = [tokenizer.decode(ids[:n], skip_special_tokens=True) for ids, n in zip(completion_ids.tolist(),
                                                                                          lengths)]
        columns = {key: [row["columns"].get(key) for row in rows] for key in {k for r in rows for k in r["columns"]}}
        prompts = [row["prompt"] for row in rows]
        ids = [ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)]
        scores = torch.tensor([reward(prompts, texts, ids, columns) for reward in self.rewards],
                              dtype=torch.float32).T.to(prompt_ids.device)  # (B, F)
        advantages, stats = policy_gradient.group_advantages(scores, self.weights, group, cfg.scale_rewards)

        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        rollout = Rollout(input_ids, attention_mask, completion_ids, completion_mask, advantages, None,
                          self.rollout_sums(scores, completion_mask, terminated, stats, generation_s), texts)
        if cfg.beta > 0:  # the base model's view of the same answers (no gradient, once per rollout)
            with torch.no_grad(), self.adapter_off():
                rollout.ref_logps = self.token_logps(model, rollout)[0]
        # the loop's throughput and FLOP counts: the sequences the loss scores
        batch["num_tokens"] = int(attention_mask.sum())
        batch["num_attended"] = int(((rollout.position_ids + 1) * attention_mask).sum())
        self.shortest, self.longest = min(self.shortest, min(lengths)), max(self.longest, max(lengths))
        return rollout

    def sample(self, model, prompt_ids, prompt_mask):
        """(answer ids right-padded, their mask, whether each ended with an EOS) from the model as it trains
        (adapter on), in eval mode (no dropout) under no_grad, with the recipe's sampling settings alone (the
        model's own generation defaults, e.g. a checkpoint's top_p, set aside)."""
        from transformers import GenerationConfig

        cfg, tokenizer = self.cfg, self.tokenizer
        causal_lm = causal_lm_of(model)  # inside DDP and compile wrappers; LoRA layers stay in the modules
        stops = stop_ids(causal_lm, tokenizer)
        config = GenerationConfig(max_new_tokens=cfg.max_completion_length, do_sample=True,
                                  temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=stops, use_cache=True)
        own, was_training = causal_lm.generation_config, model.training
        causal_lm.generation_config = config
        model.eval()
        try:
            with torch.no_grad():
                out = causal_lm.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
        finally:
            causal_lm.generation_config = own
            model.train(was_training)
        return cut_after_eos(out[:, prompt_ids.shape[1]:], stops, tokenizer.pad_token_id)

    def rollout_sums(self, scores, completion_mask, terminated, stats, generation_s) -> torch.Tensor:
        sums = dict.fromkeys(self.sum_names, 0.0)
        total = (scores * torch.tensor(self.weights, device=scores.device)).nansum(-1)
        total = total.masked_fill(torch.isnan(scores).all(-1), math.nan)
        counted = ~torch.isnan(total)
        sums.update(completions=float(len(scores)), completion_tokens=float(completion_mask.sum()),
                    terminated=float(terminated.sum()), reward_sum=float(total[counted].sum()),
                    reward_squares=float((total[counted] ** 2).sum()), rewards_counted=float(counted.sum()),
                    zero_std=float(stats["frac_reward_zero_std"]) * len(scores), generation_s=generation_s)
        for reward, column in zip(self.rewards, scores.T):
            kept = column[~torch.isnan(column)]
            sums.update({f"{reward.name}/sum": float(kept.sum()), f"{reward.name}/squares": float((kept ** 2).sum()),
                         f"{reward.name}/counted": float(len(kept))})
        return torch.tensor([sums[name] for name in self.sum_names], device=scores.device)

    # -- the loss ------------------------------------------------------------------------------------------------

    def token_logps(self, model, rollout: Rollout):
        """(log-probability, entropy) of each answer token at the sampling temperature; the head runs over the
        answer positions only (logits_to_keep)."""
        width = rollout.completion_ids.shape[1]
        logits = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                       position_ids=rollout.position_ids, use_cache=False, logits_to_keep=width + 1).logits
        return policy_gradient.completion_logps_and_entropies(logits, rollout.completion_ids, self.cfg.temperature,
                                                              rollout.completion_mask)

    def loss(self, model, batch, totals) -> Part:
        cfg = self.cfg
        rollout = batch.get("rollout") or self.rollout(model, batch)
        logps, entropies = self.token_logps(model, rollout)
        loss, figures = policy_gradient.grpo_loss(
            logps, None, rollout.ref_logps, rollout.advantages, rollout.completion_mask, loss_type=cfg.loss_type,
            epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
            max_completion_length=cfg.max_completion_length, num_tokens=totals[TARGETS],
            parts=totals[MICRO_BATCHES].clamp(min=1), entropies=entropies)
        tokens = rollout.completion_mask.sum().float()
        sums = rollout.sums.clone()
        index = {name: i for i, name in enumerate(self.sum_names)}
        sums[index["loss_sum"]] = loss.detach()
        sums[index["steps"]] = 1 / totals[MICRO_BATCHES].clamp(min=1)  # a step's micro-batches add up to 1
        for figure, name in (("kl", "kl_tokens"), ("entropy", "entropy_tokens"),
                             *((figure, name) for name, figure in CLIP_FIGURES)):
            if figure in figures:
                sums[index[name]] = figures[figure] * tokens
        return Part(loss, sums)

    # -- the logged figures --------------------------------------------------------------------------------------

    def report(self, sums) -> dict:
        """TRL's figures over the window: loss (the mean step loss), reward and reward_std (of the weighted sum),
        rewards/<name>/mean and /std, frac_reward_zero_std, completions/mean_length, min_length and max_length
        (this process's), clipped_ratio (answers cut at max_completion_length), kl, entropy and the clip ratios
        (token means)."""
        s = dict(zip(self.sum_names, (float(x) for x in sums)))
        if s["steps"] == 0:
            return {"loss": None}
        row = {"loss": s["loss_sum"] / s["steps"], REWARD_METRIC: _mean(s["reward_sum"], s["rewards_counted"]),
               "reward_std": _std(s["reward_sum"], s["reward_squares"], s["rewards_counted"])}
        for reward in self.rewards:
            total, squares, counted = (s[f"{reward.name}/{part}"] for part in ("sum", "squares", "counted"))
            row[f"rewards/{reward.name}/mean"] = _mean(total, counted)
            row[f"rewards/{reward.name}/std"] = _std(total, squares, counted)
        answers, tokens = s["completions"], s["completion_tokens"]
        row.update({"frac_reward_zero_std": s["zero_std"] / answers, "completions/mean_length": tokens / answers,
                    "completions/min_length": self.shortest if self.longest else None,
                    "completions/max_length": self.longest if self.longest else None,
                    "completions/clipped_ratio": 1 - s["terminated"] / answers})
        self.shortest, self.longest = math.inf, 0
        if self.cfg.beta > 0:
            row["kl"] = s["kl_tokens"] / tokens
        row["entropy"] = s["entropy_tokens"] / tokens
        for name, figure in CLIP_FIGURES:
            if (figure == "cispo_clip_ratio") == (self.cfg.loss_type == "cispo"):
                row[figure] = s[name] / tokens
        return row

    def report_window(self, sums, process_seconds: float) -> dict:
        row = self.report(sums)
        generation_s = float(sums[self.sum_names.index("generation_s")])
        row["generation_share"] = generation_s / process_seconds if process_seconds > 0 else None
        return row


def _mean(total: float, count: float) -> float | None:
    return total / count if count > 0 else None


def _std(total: float, squares: float, count: float) -> float | None:
    """The Bessel-corrected std from the sums (TRL's nanstd)."""
    if count < 2:
        return None
    return math.sqrt(max(0.0, (squares - total * total / count) / (count - 1)))


# -- the pieces ------------------------------------------------------------------------------------------------


def left_padded(input_ids, lengths, pad_token_id: int):
    """(ids, mask) of right-padded rows of the given lengths moved to the right edge: generation appends to
    every row at the same place."""
    width = int(lengths.max())
    ids = torch.full((len(lengths), width), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    mask = torch.zeros((len(lengths), width), dtype=torch.long, device=input_ids.device)
    for row, length in enumerate(lengths.tolist()):
        ids[row, width - length:] = input_ids[row, :length]
        mask[row, width - length:] = 1
    return ids, mask


def stop_ids(causal_lm, tokenizer) -> list[int]:
    """The tokens an answer ends at: the tokenizer's EOS and every one the model's generation config names."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(causal_lm, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return sorted(i for i in ids if i is not None)


def cut_after_eos(completion_ids, stops: list[int], pad_token_id: int):
    """(ids with everything after the first EOS set to pad, the mask of the answer up to and including that EOS,
    whether each answer has one): TRL's cut; an answer without an EOS keeps every token it was given."""
    width = completion_ids.shape[1]
    is_stop = torch.isin(completion_ids, torch.tensor(stops, device=completion_ids.device))
    ended = is_stop.any(-1)
    first = torch.where(ended, is_stop.int().argmax(-1), torch.full_like(ended, width, dtype=torch.long))
    mask = (torch.arange(width, device=completion_ids.device)[None] <= first[:, None]).long()
    return completion_ids.masked_fill(mask == 0, pad_token_id), mask, ended
