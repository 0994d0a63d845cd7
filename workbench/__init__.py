"""lora-workbench: LoRA/QLoRA fine-tuning from one YAML recipe, on a laptop CPU or many GPUs.

    import workbench as wb
    recipe = wb.Recipe.load("recipes/tiny.yaml").override("adapter.r=4")
    wb.estimate(recipe, world_size=2)          # memory per device for each strategy
    result = wb.train(recipe)                  # in this process; wb.launch(recipe, nproc=2) for several
    result.plot()
    wb.compare(["runs/tiny", result])          # a DataFrame; wb.plot_compare(...) draws it
"""

from .api import compare, launch, plot_compare
from .errors import DataError, ModelError, RecipeError, WorkbenchError
from .evaluation import evaluate
from .export import generate, merge
from .memory import Estimate, estimate
from .recipe import Recipe
from .runs import Run, TrainResult, list_runs, load_run
from .train import train

__all__ = [
    "DataError", "Estimate", "ModelError", "Recipe", "RecipeError", "Run", "TrainResult", "WorkbenchError",
    "compare", "estimate", "evaluate", "generate", "launch", "list_runs", "load_run", "merge", "plot_compare",
    "train",
]
__version__ = "0.1.0"
