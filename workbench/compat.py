"""Combinations the workbench refuses up front, each with what to change instead."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .recipe import Recipe


def check_recipe(recipe: "Recipe") -> None:
    """Raise ValueError (turned into a RecipeError naming the field) for an impossible recipe."""
    method = recipe.adapter.method
    if recipe.quantization is not None and method != "qlora":
        raise ValueError(
            f"quantization: only used with adapter.method: qlora (got {method}); "
            "remove the quantization section or set adapter.method: qlora"
        )
    if method == "full" and recipe.adapter.modules_to_save:
        raise ValueError("adapter.modules_to_save: has no meaning with method full (every module is trained)")
    if recipe.data.eval and recipe.data.eval_split:
        raise ValueError("data.eval_split: set either data.eval (a file) or data.eval_split, not both")
    if recipe.training.mixed_precision == "fp16" and recipe.model.dtype == "bfloat16":
        raise ValueError(
            "training.mixed_precision: fp16 autocast over bfloat16 weights mixes two half types; "
            "use mixed_precision: bf16 or model.dtype: float16"
        )
