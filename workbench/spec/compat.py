"""The compatibility matrix: combinations refused up front, each with what to change instead.

`check_recipe` runs whenever a recipe is validated (no model or device needed);
`check_runtime` runs once the device and the model's config are known, before weights load.
The table in docs/compatibility.md lists the same rules; tests/test_compat.py checks each one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from workbench.base.errors import RecipeError
from workbench.spec import adapter_init
from workbench.spec.formats import FORMATS, format_of
from workbench.spec.objectives import DEFAULT_OBJECTIVE, OBJECTIVES, objectives_reading, without_reference
from workbench.spec.strategies import layout_of, layout_problem

if TYPE_CHECKING:
    from workbench.spec.recipe import Recipe

QUANTIZABLE_METHODS = ("qlora", "dora")  # dora + quantization = QDoRA


def check_recipe(recipe: "Recipe") -> None:
    """Raise ValueError (the recipe loader turns it into a RecipeError) for an impossible recipe."""
    adapter, training, dist = recipe.adapter, recipe.training, recipe.distributed
    method = adapter.method
    quantized = recipe.quantization is not None
    if quantized and method not in QUANTIZABLE_METHODS:
        raise ValueError(
            f"quantization: only used with adapter.method: qlora or dora (got {method}); "
            "remove the quantization section or set adapter.method: qlora"
        )
    if method == "full" and adapter.modules_to_save:
        raise ValueError("adapter.modules_to_save: has no meaning with method full (every module is trained)")
    if method == "full" and adapter.rslora:
        raise ValueError("adapter.rslora: only applies to LoRA adapters; remove it or choose method lora")
    for problem in (adapter_init.recipe_problem(recipe), streaming_problem(recipe)):
        if problem:
            raise ValueError(problem)
    data_format = format_of(recipe.data.format)
    for k, source in enumerate(recipe.data.sources):
        # sources may mix instruction formats, never rows of another kind: one objective trains every row
        if format_of(source.format).rows != data_format.rows:
            raise ValueError(f"data.train[{k}].format: {source.format} rows cannot mix with data.format "
                             f"{recipe.data.format} (they train with different objectives)")
    objective = training.objective_spec
    if objective.rows != data_format.rows:
        readers = [f.name for f in FORMATS.values() if f.rows == objective.rows]
        if data_format.rows == OBJECTIVES[DEFAULT_OBJECTIVE].rows:  # the objective was chosen: change the data
            raise ValueError(f"data.format: training.objective {objective.name} learns from "
                             f"{' or '.join(readers)} rows; set data.format: {readers[0]} (got {recipe.data.format})")
        raise ValueError(f"training.objective: {objective.name} does not learn from data.format "
                         f"{recipe.data.format} rows ({recipe.data.format} trains objective "
                         f"{' or '.join(objectives_reading(data_format.rows))}); give {' or '.join(readers)} rows "
                         "or choose another objective")
    if not objective.next_token_loss and recipe.data.train_on == "all":
        raise ValueError(f"data.train_on: {recipe.data.format} rows are scored on their answers; use train_on: "
                         "completions")
    if training.has_reference and method == "full":
        raise ValueError(f"training.objective: {training.objective} compares against the base model with the "
                         "adapter switched off, and full fine-tuning has no adapter to switch off; use "
                         "adapter.method lora/qlora/dora" + without_reference(objective))
    if training.scores_sequences and method == "full":
        raise ValueError("training.objective: reward trains an adapter and the score head beside it, saved as a "
                         "sequence-classification adapter; use adapter.method lora/qlora/dora")
    if training.scores_sequences and any(name.split(".")[-1].lower() == "lm_head"
                                         for name in adapter.modules_to_save or []):
        raise ValueError("adapter.modules_to_save: lm_head: a reward model loads no language-model head (its score "
                         "head trains whole already); remove lm_head")
    problem = grpo_problem(recipe)
    if problem:
        raise ValueError(problem)
    if recipe.data.eval and recipe.data.eval_split:
        raise ValueError("data.eval_split: set either data.eval (a file) or data.eval_split, not both")
    # `auto` precision is checked again once resolved for the device (workbench/hardware/precision.py)
    if training.mixed_precision == "fp16" and recipe.model.dtype == "bfloat16":
        raise ValueError(
            "training.mixed_precision: fp16 autocast over bfloat16 weights mixes two half types; "
            "use mixed_precision: bf16 or model.dtype: float16"
        )
    if dist.strategy in ("single", "ddp", "fsdp", "tp", "pp") or (dist.strategy == "deepspeed" and
                                                                  not dist.deepspeed.config_file):
        # a named strategy is checked now; `auto` (and a DeepSpeed JSON) when the layout is resolved at launch
        problem = layout_problem(recipe, layout_of(recipe, world_size=2))
        if problem:
            raise ValueError(problem)


def grpo_problem(recipe: "Recipe") -> str | None:
    """What objective grpo (answers sampled in the loop) cannot run with yet, in one line naming the field."""
    training, data = recipe.training, recipe.data
    if not training.objective_spec.samples_answers:
        return None
    grpo = training.grpo
    if data.packing:
        return ("data.packing: GRPO's rows are prompts, each answered num_generations times in a row of its own; "
                "set data.packing: false")
    if data.eval or data.eval_split:
        field = "data.eval" if data.eval else "data.eval_split"
        return (f"{field}: a held-out reward evaluation of GRPO is not built yet; leave it out (the training "
                "rewards are logged every step)")
    if data.streaming:
        return "data.streaming: GRPO reads its prompts whole; turn data.streaming off"
    if training.micro_batch_auto:
        return ("training.micro_batch_size: auto does not count GRPO's sampled answers; set the prompts per "
                "micro-batch (each answered training.grpo.num_generations times)")
    completions = training.micro_batch_size * grpo.num_generations
    if completions > MOST_COMPLETIONS_PER_MICRO_BATCH:
        return (f"training.grpo.num_generations: {grpo.num_generations} answers x training.micro_batch_size "
                f"{training.micro_batch_size} prompts = {completions} sequences in one micro-batch (at most "
                f"{MOST_COMPLETIONS_PER_MICRO_BATCH}); lower either, and raise grad_accum to keep the step")
    if grpo.beta > 0 and recipe.adapter.method == "full":
        return ("training.grpo.beta: the KL term compares against the base model with the adapter switched off, "
                "and full fine-tuning has no adapter to switch off; use beta: 0 or adapter.method lora/qlora/dora")
    if grpo.loss_type != "cispo" and grpo.epsilon_high is not None and grpo.epsilon_high < grpo.epsilon:
        return (f"training.grpo.epsilon_high: {grpo.epsilon_high:g} is below epsilon {grpo.epsilon:g}; the upper "
                "clip is at least the lower one (null: the same)")
    return None


MOST_COMPLETIONS_PER_MICRO_BATCH = 4096  # micro_batch_size x num_generations: far past what one forward holds


def streaming_problem(recipe: "Recipe") -> str | None:
    """Why the recipe cannot read its training data as a stream, in one line naming the field; None when it can."""
    data, training = recipe.data, recipe.training
    if not data.streaming:
        return None
    if training.max_steps is None:
        return ("training.max_steps: a streamed data set has no length to count epochs in; set the steps to run "
                "(data.streaming: true)")
    if not isinstance(data.train, str):
        return ("data.train: data.streaming reads one source; mix the sources into one file, or turn streaming off "
                "to weight several")
    if data.eval_split:
        return ("data.eval_split: holding a fraction out needs the whole source up front; give data.eval a file "
                "(data.streaming: true)")
    if Path(data.train).suffix.lower() == ".json":
        return (f"data.train: {data.train} is one JSON document, read whole; write it as JSON lines (.jsonl) to "
                "stream it")
    if format_of(data.format).unpaired:
        return ("data.format: unpaired rows pair each answer with another row's (KTO's KL sample), which needs the "
                "whole source; turn data.streaming off")
    if adapter_init.of(recipe).needs_data:
        return (f"adapter.init: {recipe.adapter.init} reads the training data before the first step, which a stream "
                "reads as it trains; turn data.streaming off or use another init")
    return None


def check_runtime(recipe: "Recipe", device_type: str, model_config) -> None:
    """Rules that depend on the device and the model's shapes."""
    training = recipe.training
    if training.mixed_precision == "fp16" and device_type != "cuda":
        raise RecipeError("training.mixed_precision: fp16 needs a GPU; use auto, bf16 or no on a CPU")
    if training.activation_offloading and device_type != "cuda":
        raise RecipeError(
            "training.activation_offloading: moves activations from GPU to CPU memory, so it needs a GPU; "
            "set it to false (or use gradient_checkpointing)"
        )
    if recipe.quantization is not None and recipe.quantization.bits == 4 and device_type == "cpu":
        # bitsandbytes' CPU 4-bit kernels work on blocks of 64 output features.
        widths = _linear_widths(model_config)
        odd = {name: w for name, w in widths.items() if w % 64}
        if odd:
            listed = ", ".join(f"{k}={v}" for k, v in odd.items())
            raise RecipeError(
                f"quantization: 4-bit layers on a CPU need widths that are multiples of 64, this model has {listed}; "
                "use adapter.method: lora, or run on a GPU"
            )


def _linear_widths(config) -> dict[str, int]:
    heads = getattr(config, "num_attention_heads", 0) or 1
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return {"hidden_size": config.hidden_size, "intermediate_size": getattr(config, "intermediate_size", 0),
            "attention width": heads * head_dim, "key/value width": kv_heads * head_dim}
