"""lora-workbench: LoRA/QLoRA fine-tuning from one YAML recipe, on a laptop CPU or many GPUs.

    import workbench as wb
    result = wb.train(wb.Recipe.load("recipes/tiny.yaml"))
    wb.compare(["runs/tiny"])
"""

from .errors import DataError, ModelError, RecipeError, WorkbenchError
from .evaluation import evaluate
from .export import generate, merge
from .memory import Estimate, estimate
from .recipe import Recipe
from .runs import Run, list_runs, load_run
from .train import TrainResult, train


def compare(runs):
    """A pandas DataFrame comparing runs (directories, Run objects or TrainResults)."""
    import pandas as pd

    from .runs import compare_rows

    loaded = [r if isinstance(r, Run) else load_run(getattr(r, "run_dir", r)) for r in runs]
    return pd.DataFrame(compare_rows(loaded))


__all__ = [
    "DataError", "Estimate", "ModelError", "Recipe", "RecipeError", "Run", "TrainResult", "WorkbenchError",
    "compare", "estimate", "evaluate", "generate", "list_runs", "load_run", "merge", "train",
]
__version__ = "0.1.0"
