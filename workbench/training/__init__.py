"""Training: one `TrainingSession` per run (session.py), its `RunSummary` (workbench/run_summary.py), and the loop's
pieces (parts.py); what a resumed run checks lives in workbench/resume.py. `train` (entry.py) runs one."""

from ..run_summary import RunSummary
from .session import TrainingSession

__all__ = ["RunSummary", "TrainingSession"]
