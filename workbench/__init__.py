"""lora-workbench: LoRA/QLoRA fine-tuning from one YAML recipe, on a laptop CPU or many GPUs.

    import workbench as wb
    recipe = wb.Recipe.load("recipes/tiny.yaml").override("adapter.r=4")
    wb.estimate(recipe, world_size=2)          # memory per device for each strategy
    result = wb.train(recipe)                  # in this process; wb.launch(recipe, nproc=2) for several
    result.plot()
    wb.compare(["runs/tiny", result])          # a DataFrame; wb.plot_compare(...) draws it

Importing the package is instant and changes nothing in the process: each name loads its module (and
torch, transformers, ...) on first use. The command line depends on that: `python -m workbench` takes
Ctrl-C back before any heavy import, so a job started with SIGINT ignored can still be stopped at once.
"""

import importlib.util as _importlib_util

from workbench.base.quiet import import_quietly

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    "DataError": "base.errors", "ModelError": "base.errors", "RecipeError": "base.errors",
    "WorkbenchError": "base.errors",
    "compare": "frontends.api", "launch": "frontends.api", "plot_compare": "frontends.api",
    "evaluate": "outputs.evaluation", "generate": "model.inference", "merge": "outputs.merging",
    "Estimate": "estimator.memory", "estimate": "estimator.memory",
    "export": "outputs.gguf_export",
    "push": "outputs.publish",
    "ray_train": "frontends.ray",
    "preview_data": "outputs.preview",
    "Recipe": "spec.recipe",
    "Run": "rundir.runs", "TrainResult": "rundir.runs", "list_runs": "rundir.runs", "load_run": "rundir.runs",
    "train": "training.entry",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        value = getattr(import_quietly(f"{__name__}.{_API[name]}"), name)
    elif not name.startswith("_") and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
        value = import_quietly(f"{__name__}.{name}")  # a floor: `workbench.estimator` (its modules: import them)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
