"""The strategy matrix's per-cell figures, from the run folders a kept pytest run leaves:

    python -m pytest tests/test_strategy_matrix.py --basetemp=/tmp/mx     # about 5 minutes on 2 cores
    python bench/matrix_figures.py /tmp/mx

For each 2-process layout × method × accumulation cell: the largest relative difference of its step losses and
the largest absolute difference of its adapter weights against the 1-process run with the double micro-batch;
for each checkpoint resumed on another layout or process count: the same against the uninterrupted run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file


def losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def compare(run: Path, reference: Path) -> tuple[float, float]:
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses(run), losses(reference)))
    ours, theirs = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (run, reference))
    return loss, max(float((ours[k] - theirs[k]).abs().max()) for k in ours)


def main(basetemp: str) -> None:
    root = next(Path(basetemp).glob("matrix*[0-9]"))
    print("| layout | method | grad_accum | max rel. loss diff | max abs. adapter diff |\n|---|---|---|---|---|")
    for layout in ("ddp", "fsdp", "zero1", "zero2", "zero3", "fsdp_hybrid"):
        for method in ("lora", "qlora", "dpo", "orpo"):
            for ga in (1, 2):
                cell = root / f"{layout}-{method}-ga{ga}"
                if (cell / "adapter").exists():
                    loss, weights = compare(cell, root / f"single-{method}-ga{ga}")
                    print(f"| {layout} | {method} | {ga} | {loss:.1e} | {weights:.1e} |")
    print("\n| checkpoint written by | resumed on | max rel. loss diff | max abs. adapter diff |\n|---|---|---|---|")
    for run in sorted(root.glob("*-on-*")):
        source, _, target = run.name.partition("-on-")
        if (run / "adapter").exists():
            loss, weights = compare(run, root / source)
            print(f"| {source} | {target} | {loss:.1e} | {weights:.1e} |")
        else:
            print(f"| {source} | {target} | refused | |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mx")
