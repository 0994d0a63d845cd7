"""The notebook front door's own functions: compare and plot runs, launch several processes.

Everything else of the Python API lives where the CLI and the UI call it too (train, estimate,
evaluate, merge, generate); these are the pieces that only make sense from Python.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Union

from workbench.base.errors import WorkbenchError
from workbench.rundir.runs import Run, TrainResult, compare_rows, load_run

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from workbench.spec.recipe import Recipe

RunLike = Union[str, Path, Run, TrainResult]


def _runs(runs: Iterable[RunLike] | RunLike) -> list[Run]:
    if isinstance(runs, (str, Path, Run, TrainResult)):
        runs = [runs]
    return [r if isinstance(r, Run) else load_run(r.run_dir if isinstance(r, TrainResult) else r) for r in runs]


def compare(runs: Iterable[RunLike] | RunLike) -> "pd.DataFrame":
    """One row per run with the columns of the UI's Compare tab and `workbench runs`.

    `runs`: run directories, `Run`s (from `load_run`/`list_runs`) or `TrainResult`s (from `train`/`launch`).
    """
    import pandas as pd

    from workbench.rundir.runs import COMPARE_COLUMNS

    return pd.DataFrame(compare_rows(_runs(runs)), columns=COMPARE_COLUMNS)


def plot_compare(runs: Iterable[RunLike] | RunLike) -> "Figure":
    """Peak memory (measured beside predicted), tokens/s and loss curves of the runs: one Figure."""
    from workbench.base.charts import compare_figure

    loaded = _runs(runs)
    return compare_figure(compare_rows(loaded), {r.name: r.metrics for r in loaded})


def launch(recipe: "Recipe | str | Path", nproc: int = 1, nnodes: int = 1, node_rank: int = 0,
           master: str = "127.0.0.1:29500", overwrite: bool = False, resume: bool = False,
           timeout: float | None = None) -> TrainResult:
    """Train on `nproc` processes (per machine) through the same `accelerate launch` command as
    `workbench launch`, wait for it, and return its result. A notebook cannot host the ranks itself:
    they run as child processes, and their output goes to the notebook's terminal/log."""
    from workbench.distributed.launcher import plan_launch, run_launch
    from workbench.spec.recipe import Recipe
    from workbench.rundir.runs import metrics_frame

    with tempfile.TemporaryDirectory(prefix="workbench-launch-") as scratch:
        if isinstance(recipe, Recipe):  # the ranks read a file: write this one out
            path = Path(scratch) / "recipe.yaml"
            recipe.save(path)
        else:
            path = Path(recipe)
        train_args = ["--no-progress"] + (["--resume"] if resume else []) + (["--overwrite"] if overwrite else [])
        plan = plan_launch(path, [], nproc=nproc, nnodes=nnodes, node_rank=node_rank, master=master,
                           train_args=train_args)
        code = run_launch(plan, timeout=timeout)
    if node_rank != 0:  # only the machine of rank 0 holds the run directory
        return TrainResult(plan.run_dir, {"status": "exited", "exit_code": code})
    if code != 0:
        raise WorkbenchError(f"the launch exited with code {code}; see the output above and {plan.run_dir}/run.json")
    run = load_run(plan.run_dir)
    return TrainResult(run.path, run.summary, metrics_frame(run.metrics))
