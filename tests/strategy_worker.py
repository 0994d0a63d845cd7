"""Trains several recipes one after another in each process of one launch (tests/test_strategy_matrix.py).

Importing the stack takes most of a small run's time; one launch per family of layouts, training all its
cells in turn, keeps the whole matrix within the suite's budget. Usage: strategy_worker.py CELLS.json, where
the file maps each cell's run directory to {"overrides": [...], "resume": bool}. A refused cell (a
WorkbenchError) is recorded in CELLS.json.errors-RANK and the next cell runs.
"""

import json
import sys

from workbench import Recipe, WorkbenchError, train

RECIPE = "recipes/tiny.yaml"


def skip_deepspeed_shm_op() -> None:
    """DeepSpeed's communication backend JIT-compiles its shared-memory all-reduce op (C++: about a minute of CPU
    on a fresh checkout, as in CI) when it starts, though only inference's tensor-parallel layers call it
    (`inference_all_reduce`); training's collectives are torch.distributed's either way. Without it DeepSpeed runs
    as it does wherever the op is unavailable (its `build_shm_op` returns None there too): the same ZeRO engine."""
    import importlib

    # (the module itself: the attribute `deepspeed.comm.torch` is the torch package, which the comm package imports)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


if __name__ == "__main__":
    path = sys.argv[1]
    cells = json.loads(open(path).read())
    errors = {}
    for run_dir, cell in cells.items():
        recipe = Recipe.load(RECIPE, [*cell["overrides"], f"output.dir={run_dir}"])
        if recipe.distributed.strategy == "deepspeed":
            skip_deepspeed_shm_op()
        try:
            train(recipe, resume=cell.get("resume", False), overwrite=not cell.get("resume", False),
                  progress_bar=False)
        except WorkbenchError as err:
            errors[run_dir] = str(err)
    import os

    with open(f"{path}.errors-{os.environ.get('RANK', '0')}", "w") as handle:
        json.dump(errors, handle)
