"""What a run's loss optimizes (`training.objective`): the one registry that the recipe, the compatibility rules,
the loop, the estimator, evaluation, the model card and the UI ask (`OBJECTIVES[name]`), never comparing names.

Each entry says which rows it learns from, the settings that tune it, whether it scores against a reference
(the base model with the adapter switched off) and what that costs, and what kind of model it leaves behind.
The losses are workbench/training/objectives.py's and grpo.py's, one class per entry (`LOSSES` in losses.py,
checked against this table).
A new objective is an entry here, its loss class there, and their tests; a new kind of row also needs its
format in workbench/spec/formats.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Objective:
    name: str
    summary: str  # what it optimizes, in a sentence (the recipe's schema, the model card, the docs)
    rows: str  # the kind of rows it learns from: a DataFormat's `rows` ("instructions", "pairs", "unpaired")
    settings: tuple[tuple[str, str], ...] = ()  # (training.<field>, how a status line or card names it)
    reference: bool = False  # scores answers against the base model with the adapter switched off
    extra_forwards: int = 0  # forward passes without gradients per micro-batch beside the one with
    scores_sequences: bool = False  # a sequence scorer (a scalar head read at the answer's last token), no LM
    reward_scale: str | None = None  # the training field evaluation scales log-probability ratios by
    logs_rewards: bool = False  # logs reward margins and accuracies (charts, compare columns, status lines)
    samples_answers: bool = False  # samples its answers during training (online RL): whole weights per process

    @property
    def generates(self) -> bool:
        """Whether what it trains writes text (generate, chat, GGUF, the hub's text-generation task)."""
        return not self.scores_sequences

    @property
    def next_token_loss(self) -> bool:
        """Whether its loss is the plain next-token loss over every target (what the chunked LM loss computes)."""
        return self.rows == "instructions"

    def settings_text(self, training: Mapping) -> str:
        """Its settings as `training` holds them, e.g. "beta = 0.1"; "" where it has none set."""
        return ", ".join(f"{label} = {training[field]:g}" for field, label in self.settings
                         if isinstance(training.get(field), (int, float)))


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("sft", "supervised fine-tuning: next-token loss on the answers", rows="instructions"),
    Objective("dpo", "DPO: prefer the chosen answer over the rejected one, against the base model (adapter off) "
                     "as reference", rows="pairs", settings=(("dpo_beta", "beta"),), reference=True,
              extra_forwards=1, reward_scale="dpo_beta", logs_rewards=True),
    Objective("orpo", "ORPO: next-token loss on the chosen answer plus an odds-ratio preference term, no reference",
              rows="pairs", settings=(("orpo_lambda", "lambda"),), logs_rewards=True),
    Objective("kto", "KTO: raise desirable answers and lower undesirable ones (unpaired rows), against the base "
                     "model (adapter off)", rows="unpaired",
              settings=(("kto_beta", "beta"), ("kto_desirable_weight", "desirable weight"),
                        ("kto_undesirable_weight", "undesirable weight")),
              reference=True, extra_forwards=2, reward_scale="kto_beta", logs_rewards=True),
    Objective("reward", "a reward model: a scalar score head, read at the answer's last token, trained so that the "
                        "chosen answer scores above the rejected one (Bradley-Terry)", rows="pairs",
              settings=(("reward_center_coefficient", "centring coefficient"),), scores_sequences=True,
              logs_rewards=True),
    Objective("grpo", "GRPO (online RL with verifiable rewards): sample training.grpo.num_generations answers per "
                      "prompt, score them with training.grpo.rewards, and raise the answers that beat their group's "
                      "mean (clipped policy gradient; KL to the base model, adapter off, where training.grpo.beta > 0)",
              rows="prompts", extra_forwards=1, samples_answers=True),
)}
OBJECTIVE_NAMES = tuple(OBJECTIVES)
DEFAULT_OBJECTIVE = "sft"  # the schema's default, and what a run from before objectives trained


def objective_of(name: object) -> Objective:
    """The registry's entry for a recorded name; the default for a run that names none or an unknown one."""
    return OBJECTIVES.get(name if isinstance(name, str) else DEFAULT_OBJECTIVE) or OBJECTIVES[DEFAULT_OBJECTIVE]


def objectives_reading(rows: str) -> tuple[str, ...]:
    """The objectives that learn from rows of this kind."""
    return tuple(name for name, objective in OBJECTIVES.items() if objective.rows == rows)


def without_reference(objective: Objective) -> str:
    """Advice for a recipe whose objective needs a reference it cannot have: the objectives that learn from the
    same rows without one ("" when there are none)."""
    others = [o.name for o in OBJECTIVES.values() if o.rows == objective.rows and not o.reference and o.generates]
    return f", or objective {' or '.join(others)} (no reference model)" if objective.reference and others else ""
