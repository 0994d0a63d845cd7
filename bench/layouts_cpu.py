"""Multi-process layouts on this CPU: each rank's measured peak RSS against the estimator's figure for its layout.

    python bench/layouts_cpu.py                          # SmolLM2-135M LoRA, 2 processes: ddp, fsdp, zero3
    python bench/layouts_cpu.py --nproc 4 --only fsdp,zero3

Each layout trains in its own launch (`workbench launch --nproc N`, gloo) for a few steps of the quickstart recipe
(no evaluation, no sample generations); the figures come from each run's run.json: `peak_memory_mb_per_rank`
(VmHWM of each rank) and `predicted_peak_memory_mb` (the estimate for the layout that really ran, taken before
the run). The ratio is measured / estimate per rank: the spread the estimator reports for CPU layouts
(workbench/estimator/calibration.py) must hold these.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"ddp": ["distributed.strategy=ddp"], "fsdp": ["distributed.strategy=fsdp"],
           "zero3": ["distributed.strategy=deepspeed", "distributed.deepspeed.stage=3"]}
COMMON = ["data.eval=null", "output.eval_every=null", "output.sample_prompts=[]", "output.save_every=null"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", default=",".join(LAYOUTS))
    args = parser.parse_args()
    rows = ["| layout | processes | measured per rank (MiB) | estimate (MiB) | measured / estimate |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            run_dir = Path(tmp) / name
            command = [sys.executable, "-m", "workbench", "launch", args.recipe, "--nproc", str(args.nproc),
                       *LAYOUTS[name], *COMMON, f"training.max_steps={args.steps}", f"output.dir={run_dir}"]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if done.returncode:
                rows.append(f"| {name} | {args.nproc} | failed: {done.stderr.strip().splitlines()[-1:]} | | |")
                continue
            summary = json.loads((run_dir / "run.json").read_text())["summary"]
            measured, estimate = summary["peak_memory_mb_per_rank"], summary["predicted_peak_memory_mb"]
            ratios = [m / estimate for m in measured]
            rows.append(f"| {summary['layout']['name']} | {args.nproc} | {', '.join(f'{m:.0f}' for m in measured)} | "
                        f"{estimate:.0f} | {min(ratios):.2f}–{max(ratios):.2f} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
