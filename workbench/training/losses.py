"""The loss of each entry of workbench/spec/objectives.py's registry (`LOSSES`, in its order), built from the
recipe's training section: the classes of workbench/training/objectives.py, and GRPO's (workbench/training/grpo.py,
which samples its answers and builds on them)."""

from __future__ import annotations

from workbench.training.grpo import GRPO
from workbench.training.objectives import DPO, KTO, ORPO, SFT, Reward

LOSSES = {
    "sft": lambda training, loss_sum_of, **_: SFT(loss_sum_of),
    "dpo": lambda training, adapter_off, **_: DPO(training.dpo_beta, adapter_off),
    "orpo": lambda training, **_: ORPO(training.orpo_lambda),
    "kto": lambda training, adapter_off, **_: KTO(training.kto_beta, training.kto_desirable_weight,
                                                  training.kto_undesirable_weight, adapter_off),
    "reward": lambda training, pad_token_id, **_: Reward(training.reward_center_coefficient, pad_token_id),
    "grpo": lambda training, adapter_off, tokenizer, **_: GRPO(training.grpo, tokenizer, adapter_off),
}


def build(recipe, loss_sum_of, adapter_off=None, pad_token_id: int | None = None, tokenizer=None):
    """The recipe's objective. adapter_off: a context manager that switches the adapter off (the reference of
    DPO, KTO and GRPO's KL term); pad_token_id: the token a reward model never reads its score at; tokenizer:
    what GRPO decodes its sampled answers with."""
    training = recipe.training
    return LOSSES[training.objective](training, loss_sum_of=loss_sum_of, adapter_off=adapter_off,
                                      pad_token_id=pad_token_id, tokenizer=tokenizer)
