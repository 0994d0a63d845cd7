"""Training: one `TrainingSession` per run (session.py), its `RunSummary` (workbench/rundir/run_summary.py), and the loop's
pieces (parts.py); what a resumed run checks lives in workbench/training/resume.py. `train` (entry.py) runs one."""

from workbench.rundir.run_summary import RunSummary
from workbench.training.session import TrainingSession

__all__ = ["RunSummary", "TrainingSession"]
