"""How close a job's step is to its floor: what an exact LoRA step cannot skip, against what the loop takes.

    python bench/step_floor.py                                    # short, long, wide at bf16 and fp32, one thread
    python bench/step_floor.py --jobs short --precisions bf16 --trl-s short/bf16=43.2
    python bench/step_floor.py --jobs quick --precisions fp32 --micro-batches 2 --repeats 1   # a smoke run

For each of bench/peers.py's jobs (its model, data, LoRA and micro-batches), in this one process, interleaved:

- `step`: the workbench's training step under the loop's fast paths (forward, backward, the gradient clipped,
  the loop's AdamW);
- `no dropout`: the same step with the adapter's dropout off (what the dropout costs);
- `base`: the frozen model's forward and backward with the adapter switched off, the gradient taken as far as
  the adapted layers' outputs (no further: the first layer's inputs need none), the loss a chunk at a time;
- `adapter products`: the adapter's six matrix products per layer (two forward, four backward) at the step's
  shapes, timed alone.

`base` + `adapter products` is the floor of an exact step with these kernels, run eagerly: every one of those
products, forward and backward, has to run (the adapted layers whose input needs no gradient, the first layer's,
skip the product that would make it). The micro-batches timed are spread over the epoch; the job's floor is the
floor per token times the epoch's tokens (padding included, as training sees them), plus the imports (`torch`,
`transformers`, `peft`, `datasets`, timed in fresh interpreters), which any tool pays first. Given TRL's measured
time for a job (`--trl-s short/bf16=43.2`, from `python bench/peers.py --shapes ...`), it prints whether half of it
lies above that floor. Differences of a few percent between the columns are within the noise of one run.
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
    from workbench.data.prepared import prepare_data
    from workbench.data.batches import Collator
    from workbench.model.fastpath import SparseDropout, apply_fast_paths
    from workbench.model.lm_loss import lm_loss_sum
    from workbench.model.loading import attach_adapter, load_base_model, load_tokenizer
    from workbench.training.parts import build_optimizer

    which = ["--quick"] if job == "quick" else ["--job", job]
    spec = peers.job_spec(peers.build_parser().parse_args(
        [*which, "--threads", "1", f"--precision={precision}"]), workdir / f"{job}-{precision}")
    recipe = workbench_recipe({**spec, "tool": "workbench", "out": str(workdir / "runs")})
    tokenizer = load_tokenizer(recipe.model)
    data = prepare_data(recipe.data, tokenizer, seed=recipe.training.seed)
    collate, size = Collator(tokenizer.pad_token_id), recipe.training.micro_batch_size
    epoch = [collate([data.train[i] for i in range(start, min(start + size, len(data.train)))])
             for start in range(0, len(data.train), size)]
    epoch_tokens = sum(int(batch["input_ids"].numel()) for batch in epoch)
    batches = [epoch[i * len(epoch) // micro_batches] for i in range(min(micro_batches, len(epoch)))]
    tokens = sum(int(batch["input_ids"].numel()) for batch in batches) / len(batches)
    steps = math.ceil(len(epoch) / recipe.training.grad_accum)

    torch.manual_seed(recipe.training.seed)
    model = attach_adapter(load_base_model(recipe), recipe)
    apply_fast_paths(model, torch.bfloat16 if precision == "bf16" else torch.float32)
    model.train()
    optimizer = build_optimizer(model, recipe, "cpu")
    trainable = [p for p in model.parameters() if p.requires_grad]
    autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    dropouts = [m for m in model.modules() if isinstance(m, SparseDropout)]
    from peft.tuners.lora.layer import LoraLayer

    adapted = [m for m in model.modules() if isinstance(m, LoraLayer)]
    # with the adapter off, the gradient starts at each adapted layer's output (the first layer's too)
    for layer in adapted:
        layer.register_forward_hook(lambda _m, _i, out: out.requires_grad_() if not out.requires_grad else out)
    input_needs_grad = {}  # per adapted layer, read in the warm-up step: the first layer's inputs need none
    recording = [layer.register_forward_pre_hook(
        lambda m, args: input_needs_grad.__setitem__(m, bool(args[0].requires_grad))) for layer in adapted]

    def step(batch):
        with torch.autocast(**autocast):
            loss = lm_loss_sum(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, recipe.training.max_grad_norm or float("inf"))
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

    step(batches[0])  # warm the kernels, and see which adapted layers' inputs need a gradient
    for hook in recording:
        hook.remove()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    width, r = round(tokens), recipe.adapter.r
    factors = [(torch.randn(width, m.in_features, dtype=dtype), torch.randn(r, m.in_features, dtype=dtype),
                torch.randn(m.out_features, r, dtype=dtype), torch.randn(width, m.out_features, dtype=dtype),
                input_needs_grad[m]) for m in adapted]

    def adapter_products(_batch):
        for x, a, b, grad, to_input in factors:
            down = x @ a.t()
            down @ b.t()
            grad_down = grad @ b
            grad.t() @ down
            grad_down.t() @ x
            if to_input:
                grad_down @ a

    timed = {"step": step, "no dropout": no_dropout, "base": base, "adapter products": adapter_products}
    best = {name: math.inf for name in timed}
    for f in timed.values():
        f(batches[0])
    for _ in range(repeats):
        for name, f in timed.items():
            started = time.perf_counter()
            for batch in batches:
                f(batch)
            best[name] = min(best[name], (time.perf_counter() - started) / len(batches))
    return {"job": job, "precision": precision, "tokens": tokens, "epoch_tokens": epoch_tokens, "steps": steps,
            **{name: seconds * 1e3 for name, seconds in best.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="short,long,wide", help="bench/peers.py jobs, comma-separated (quick: a "
                        "tiny model, a smoke run)")
    parser.add_argument("--precisions", default="bf16,fp32")
    parser.add_argument("--micro-batches", dest="micro_batches", type=positive, default=20,
                        help="micro-batches timed per variant and repeat, spread over the epoch")
    parser.add_argument("--repeats", type=positive, default=3, help="the best of this many")
    parser.add_argument("--trl-s", dest="trl_s", default="",
                        help="TRL's measured job time, e.g. short/bf16=43.2,long/bf16=31.6 (its faster setup)")
    parser.add_argument("--import-repeats", dest="import_repeats", type=positive, default=3)
    parser.add_argument("--workdir", help="where the jobs' data files go (default: a temporary folder; the models "
                        "and the tokenized data are cached where every run caches them)")
    args = parser.parse_args(argv)
    import peers

    cpu_jobs = [job for job in peers.JOBS if not job.startswith("gpu")]
    jobs, precisions = args.jobs.split(","), args.precisions.split(",")
    for flag, values, known in (("--jobs", jobs, cpu_jobs), ("--precisions", precisions, ["bf16", "fp32"])):
        for value in values:
            if value not in known:
                parser.error(f"{flag}: {value!r} is not one of {', '.join(known)}")
        if len(set(values)) < len(values):
            parser.error(f"{flag}: a value is given twice")
    trl = {}
    for item in filter(None, args.trl_s.split(",")):
        key, _, seconds = item.partition("=")
        try:
            trl[key] = float(seconds)
        except ValueError:
            trl[key] = math.nan
        if key not in {f"{job}/{precision}" for job in jobs for precision in precisions}:
            parser.error(f"--trl-s: {item!r} names no job/precision this run measures (e.g. short/bf16=43.2)")
        if not 0 < trl[key] < math.inf:
            parser.error(f"--trl-s: {item!r}: TRL's time must be a number of seconds above 0")
    if args.workdir:
        try:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"--workdir: {args.workdir}: {error.strerror or error}")
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


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not 1 or more")
    return value


def print_row(row: dict, imports: float, trl: dict) -> None:
    job, precision = row["job"], row["precision"]
    floor = row["base"] + row["adapter products"]
    job_floor = imports + floor / 1e3 * row["epoch_tokens"] / row["tokens"]
    half = trl.get(f"{job}/{precision}")
    verdict = "" if half is None else f"{half / 2:>10.1f}  floor {'above' if job_floor > half / 2 else 'below'}"
    print(f"{job:6} {precision:5} {row['tokens']:>6.0f} {row['step']:>7.1f} {row['no dropout']:>10.1f} "
          f"{row['base']:>7.1f} {row['adapter products']:>8.1f} {floor:>7.1f} {floor / row['step']:>10.2f} "
          f"{row['steps']:>6} {job_floor:>11.1f} {verdict}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
