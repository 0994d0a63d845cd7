"""lora-workbench: LoRA/QLoRA fine-tuning from one YAML recipe, on a laptop CPU or many GPUs.

    import workbench as wb
    recipe = wb.Recipe.load("recipes/tiny.yaml").override("adapter.r=4")
    wb.estimate(recipe, world_size=2)          # memory per device for each strategy
    result = wb.train(recipe)                  # in this process; wb.launch(recipe, nproc=2) for several
    result.plot()
    wb.compare(["runs/tiny", result])          # a DataFrame; wb.plot_compare(...) draws it
"""

from .quiet import quiet_warnings

quiet_warnings()

from .api import compare, launch, plot_compare  # noqa: E402
from .errors import DataError, ModelError, RecipeError, WorkbenchError  # noqa: E402
from .evaluation import evaluate  # noqa: E402
from .export import generate, merge  # noqa: E402
from .memory import Estimate, estimate  # noqa: E402
from .recipe import Recipe  # noqa: E402
from .runs import Run, TrainResult, list_runs, load_run  # noqa: E402
from .train import train  # noqa: E402

__all__ = [
    "DataError", "Estimate", "ModelError", "Recipe", "RecipeError", "Run", "TrainResult", "WorkbenchError",
    "compare", "estimate", "evaluate", "generate", "launch", "list_runs", "load_run", "merge", "plot_compare",
    "train",
]
__version__ = "0.1.0"
