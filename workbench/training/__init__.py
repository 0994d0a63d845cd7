"""Training: one `TrainingSession` per run (session.py), its `RunSummary` (summary.py), the loop's pieces (parts.py)
and the checks a run makes before it takes its directory over (checks.py). `workbench.train.train` runs a session."""

from .summary import RunSummary
from .session import TrainingSession

__all__ = ["RunSummary", "TrainingSession"]
