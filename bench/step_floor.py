"""How close a job's step is to its floor: what an exact LoRA step cannot skip, against what the loop takes.

    python bench/step_floor.py                                    # short, long, wide at bf16 and fp32, one thread
    python bench/step_floor.py --jobs short --precisions bf16 --trl-s short/bf16=43.2
    python bench/step_floor.py --jobs quick --precisions fp32 --micro-batches 2 --repeats 1   # a smoke run

For each of bench/peers.py's jobs (its model, data, LoRA and micro-batches), in this one process, interleaved:

- `step`: the workbench's training step (forward, backward, AdamW) under the loop's fast paths;
- `no dropout`: the same step with the adapter's dropout off (what the dropout costs);
- `base`: the frozen model's forward and backward with the adapter switched off, the gradient taken as far as
  the adapted layers' outputs (no further: the first layer's inputs need none), the loss a chunk at a time;
- `adapter products`: the adapter's six matrix products per layer (two forward, four backward) at the step's
  shapes, timed alone.

`base` + `adapter products` is the floor of any exact step: every one of those products, forward and backward,
has to run. The job's floor adds the steps of one epoch to the imports (`torch`, `transformers`, `peft`,
`datasets`, timed in a fresh interpreter), which any tool pays first. Given TRL's measured time for a job
(`--trl-s short/bf16=43.2`, from `python bench/peers.py --shapes ...`), it prints whether half of it lies
above that floor.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

IMPORTS = "import torch, transformers, peft, datasets"


def import_seconds(repeats: int = 3) -> float:
    """The best time of a fresh interpreter importing what every tool imports first."""
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", IMPORTS], check=True, capture_output=True)
        best = min(best, time.perf_counter() - started)
    return best


def measure(job: str, precision: str, micro_batches: int, repeats: int, workdir: Path) -> dict:
    import torch

    import peers
    from peers_tools import workbench_recipe
    from workbench.data import Collator, prepare_data
    from workbench.fastpath import SparseDropout, apply_fast_paths
    from workbench.lm_loss import lm_loss_sum
    from workbench.models import attach_adapter, load_base_model, load_tokenizer

    which = ["--quick"] if job == "quick" else ["--job", job]
    spec = peers.job_spec(peers.build_parser().parse_args(
        [*which, "--threads", "1", f"--precision={precision}"]), workdir / f"{job}-{precision}")
    recipe = workbench_recipe({**spec, "tool": "workbench", "out": str(workdir / "runs")})
    tokenizer = load_tokenizer(recipe.model)
    data = prepare_data(recipe.data, tokenizer, seed=recipe.training.seed)
    collate, size = Collator(tokenizer.pad_token_id), recipe.training.micro_batch_size
    rows = len(data.train) // size
    batches = [collate([data.train[(i % rows) * size + j] for j in range(size)]) for i in range(min(micro_batches, rows))]
    steps = math.ceil(len(data.train) / (size * recipe.training.grad_accum))

    torch.manual_seed(recipe.training.seed)
    model = attach_adapter(load_base_model(recipe), recipe)
    apply_fast_paths(model, torch.bfloat16 if precision == "bf16" else torch.float32)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.training.lr)
    autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    dropouts = [m for m in model.modules() if isinstance(m, SparseDropout)]
    from peft.tuners.lora.layer import LoraLayer

    adapted = [m for m in model.modules() if isinstance(m, LoraLayer)]
    # with the adapter off, the gradient starts at each adapted layer's output (the first layer's too)
    for layer in adapted:
        layer.register_forward_hook(lambda _m, _i, out: out.requires_grad_() if not out.requires_grad else out)

    def step(batch):
        with torch.autocast(**autocast):
            loss = lm_loss_sum(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def no_dropout(batch):
        for d in dropouts:
            d.p, d.kept_p = 0.0, d.p
        step(batch)
        for d in dropouts:
            d.p = d.kept_p

    def base(batch):
        with model.disable_adapter():
            with torch.autocast(**autocast):
                loss = lm_loss_sum(model, batch)
            loss.backward()

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    tokens = int(batches[0]["input_ids"].numel())
    r = recipe.adapter.r
    factors = [(torch.randn(tokens, m.in_features, dtype=dtype), torch.randn(r, m.in_features, dtype=dtype),
                torch.randn(m.out_features, r, dtype=dtype), torch.randn(tokens, m.out_features, dtype=dtype))
               for m in adapted]

    def adapter_products(_batch):
        for x, a, b, grad in factors:
            down = x @ a.t()
            down @ b.t()
            grad_down = grad @ b
            grad.t() @ down
            grad_down.t() @ x
            grad_down @ a

    timed = {"step": step, "no dropout": no_dropout, "base": base, "adapter products": adapter_products}
    best = {name: math.inf for name in timed}
    for f in timed.values():
        f(batches[0])  # warm the kernels
    for _ in range(repeats):
        for name, f in timed.items():
            started = time.perf_counter()
            for batch in batches:
                f(batch)
            best[name] = min(best[name], (time.perf_counter() - started) / len(batches))
    return {"job": job, "precision": precision, "tokens": tokens, "steps": steps, "layers": len(adapted),
            **{name: seconds * 1e3 for name, seconds in best.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="short,long,wide", help="bench/peers.py jobs, comma-separated (quick: a "
                        "tiny model, a smoke run)")
    parser.add_argument("--precisions", default="bf16,fp32")
    parser.add_argument("--micro-batches", dest="micro_batches", type=int, default=20,
                        help="micro-batches timed per variant and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="the best of this many")
    parser.add_argument("--trl-s", dest="trl_s", default="",
                        help="TRL's measured job time, e.g. short/bf16=43.2,long/bf16=31.6 (its faster setup)")
    parser.add_argument("--import-repeats", dest="import_repeats", type=int, default=3)
    parser.add_argument("--workdir", help="where the jobs' data and models go (default: a temporary folder)")
    args = parser.parse_args(argv)
    import peers

    jobs, precisions = args.jobs.split(","), args.precisions.split(",")
    for job in jobs:
        if job not in peers.JOBS:
            parser.error(f"--jobs: {job!r} is not a job of bench/peers.py ({', '.join(peers.JOBS)})")
    for precision in precisions:
        if precision not in ("bf16", "fp32"):
            parser.error(f"--precisions: {precision!r} is neither bf16 nor fp32")
    trl = {}
    for item in filter(None, args.trl_s.split(",")):
        key, _, seconds = item.partition("=")
        try:
            trl[key] = float(seconds)
        except ValueError:
            parser.error(f"--trl-s: {item!r} is not JOB/PRECISION=SECONDS (e.g. short/bf16=43.2)")
    import torch

    torch.set_num_threads(1)
    imports = import_seconds(args.import_repeats)
    print(f"imports ({IMPORTS}): {imports:.1f} s; one thread; ms per micro-batch, best of {args.repeats}")
    print(f"{'job':6} {'prec':5} {'tokens':>6} {'step':>7} {'no dropout':>10} {'base':>7} {'adapter':>8} "
          f"{'floor':>7} {'floor/step':>10} {'steps':>6} {'job floor s':>11} {'half TRL s':>10}")
    with tempfile.TemporaryDirectory() as scratch:
        for job in jobs:
            for precision in precisions:
                print_row(measure(job, precision, args.micro_batches, args.repeats, Path(args.workdir or scratch)),
                          imports, trl)
    return 0


def print_row(row: dict, imports: float, trl: dict) -> None:
    job, precision = row["job"], row["precision"]
    floor = row["base"] + row["adapter products"]
    job_floor = imports + row["steps"] * floor / 1e3
    half = trl.get(f"{job}/{precision}")
    verdict = "" if half is None else f"{half / 2:>10.1f}  {'floor above' if job_floor > half / 2 else 'below'}"
    print(f"{job:6} {precision:5} {row['tokens']:>6} {row['step']:>7.1f} {row['no dropout']:>10.1f} "
          f"{row['base']:>7.1f} {row['adapter products']:>8.1f} {floor:>7.1f} {floor / row['step']:>10.2f} "
          f"{row['steps']:>6} {job_floor:>11.1f} {verdict}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
