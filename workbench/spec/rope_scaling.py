"""RoPE scaling: `model.rope_scaling` stretches a model's positions to a longer context than it was trained for.

The one home of the rule: the recipe's section is written into the model's config (transformers' `rope_parameters`)
wherever a config is read (training, evaluation, merging, the preflight check of data.max_seq_len, the
estimator's longest-sequence planner), and the context a run may use becomes original x factor.

- linear   positions divided by the factor (position interpolation);
- dynamic  NTK-aware: the base frequency grows with the sequence, beyond the original length only;
- yarn     NTK-by-parts interpolation with an attention temperature (YaRN);
- llama3   Llama 3.1's frequency-dependent scaling (low_freq_factor 1, high_freq_factor 4 unless given).

A model whose config already scales its positions (Llama 3.1's llama3 x8, say) is refused: a second scaling
on top would be a silent change of what its weights learned.
"""

from __future__ import annotations

import copy

from workbench.base.errors import RecipeError

TYPES = ("linear", "dynamic", "yarn", "llama3")


def scaled_config(config, model):
    """A copy of `config` with the recipe's RoPE scaling (its model section's) written in; the config itself
    when there is none."""
    rope = model.rope_scaling
    if rope is None:
        return config
    config = copy.deepcopy(config)
    text = config.get_text_config()
    current = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    already = current.get("rope_type", current.get("type", "default"))
    if already not in ("default", None):
        raise RecipeError(f"model.rope_scaling: {model.path} already scales its positions (rope_type "
                          f"{already}, factor {current.get('factor')}); remove model.rope_scaling")
    original = rope.original_max_position_embeddings or getattr(text, "max_position_embeddings", None)
    if not original:
        raise RecipeError(f"model.rope_scaling: {model.path} does not say how many positions it was trained "
                          "for; set model.rope_scaling.original_max_position_embeddings")
    parameters = {**current, "rope_type": rope.type, "factor": float(rope.factor),
                  "original_max_position_embeddings": int(original)}
    if rope.type == "llama3":
        parameters.setdefault("low_freq_factor", 1.0)
        parameters.setdefault("high_freq_factor", 4.0)
    text.rope_parameters = parameters
    text.max_position_embeddings = int(original * rope.factor)
    return config


def context_length(model, trained_for: int | None) -> int | None:
    """The positions a run may use (`model`: the recipe's model section): what the model was trained for, times
    the scaling factor."""
    rope = model.rope_scaling
    if rope is None or not trained_for:
        return trained_for
    return int((rope.original_max_position_embeddings or trained_for) * rope.factor)
