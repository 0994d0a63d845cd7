"""Where a training step's time goes: a few steps of `wb.train` under torch.profiler, the top operators by
device time and by host time, written to a text file.

    python bench/profile_steps.py                  # a GPU: bench:llama3-1b, 2 x 2,048 tokens, 8 steps
    python bench/profile_steps.py --cpu            # any CPU: builtin:tiny, 2 x 128 tokens, 4 steps
    python bench/profile_steps.py --dpo            # the DPO job of bench/peers.py (SmolLM2-135M, CPU), 2 steps
    python bench/profile_steps.py training.compile=true --out prof.txt   # recipe overrides after the flags

On the H200 (torch 2.11, bench:llama3-1b, LoRA, FlexAttention) 8 steps took about 4 s under the profiler while
the GPU's kernels ran for about 1.2 s: the steps were bound by the host launching ~1,100 matmuls and ~1,400
copies each (README, "On a GPU"). The whole call is recorded, loading included: on a GPU with the 1.24B model,
building the tables takes a minute or two after training ends.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="builtin:tiny on the CPU")
    parser.add_argument("--dpo", action="store_true",
                        help="on the CPU: bench/peers.py's smollm2 DPO job (4 pairs a step, one per forward)")
    parser.add_argument("--job", help="on the CPU: the workbench's run of a bench/peers.py job (short, long, wide, "
                        "...), its model, data and settings, one thread")
    parser.add_argument("--steps", type=int, default=None, help="steps to profile (default 8 on a GPU, 4 on a CPU)")
    parser.add_argument("--out", default="profile_steps.txt", help="the tables go here")
    args, overrides = parser.parse_known_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from peers_data import write_data
    from workbench import Recipe, train

    gpu = torch.cuda.is_available() and not (args.cpu or args.dpo or args.job)
    out = Path(args.out)
    if args.job:
        import peers
        from peers_tools import workbench_recipe

        if args.job not in peers.JOBS:
            parser.error(f"--job {args.job}: one of {', '.join(peers.JOBS)} (bench/peers.py's jobs)")
        steps = args.steps or 40
        job = ["--quick"] if args.job == "quick" else ["--job", args.job]
        spec = peers.job_spec(peers.build_parser().parse_args([*job, "--threads", "1"]), out.parent / "profile_job")
        model, seq = spec["model_name"], spec["max_seq_len"]
        recipe = workbench_recipe({**spec, "tool": "workbench", "out": str(out.parent / "profile_runs")}).override(
            f"training.max_steps={steps}", "output.log_every=1", *overrides)
        torch.set_num_threads(1)
    elif args.dpo:
        from peers_data import write_preference_data

        model, seq, steps = "builtin:smollm2-135m", 512, args.steps or 2
        train_file, _ = write_preference_data(out.parent / "profile_dpo_data", 64, 4)
        recipe = Recipe.load(ROOT / "recipes/smollm2-dpo.yaml", [
            "name=profile-dpo", f"output.dir={out.parent / 'profile_runs'}/{{name}}", f"data.train={train_file}",
            "data.eval=null", f"data.max_seq_len={seq}", "data.packing=false", f"training.max_steps={steps}",
            "training.micro_batch_size=1", "training.grad_accum=4", "output.save_every=null", "output.log_every=1",
            *overrides])
    else:
        if gpu:
            import llama3_1b

            model, seq, steps = str(llama3_1b.path()), 2048, args.steps or 8
        else:
            from workbench.base.builtin import resolve_builtin

            model, seq, steps = str(resolve_builtin("builtin:tiny")), 128, args.steps or 4
        data = write_data(out.parent / "profile_data", 400, 4)
        recipe = Recipe.load(ROOT / "recipes/quickstart.yaml", [
            "name=profile", f"output.dir={out.parent / 'profile_runs'}/{{name}}", f"model.path={model}",
            f"data.train={data[0]}", f"data.eval={data[1]}", f"data.max_seq_len={seq}", "data.packing=true",
            f"training.max_steps={steps}", "training.epochs=1000", "training.micro_batch_size=2",
            "training.grad_accum=1", "output.save_every=null", "output.eval_every=null", "output.log_every=1",
            "output.sample_prompts=[]", *overrides])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    started = time.perf_counter()
    with profile(activities=activities, record_shapes=True, with_flops=True) as prof:
        result = train(recipe, overwrite=True, progress_bar=False)
    wall = time.perf_counter() - started
    device_key = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    averages = prof.key_averages()
    batch = ("4 pairs a step" if args.dpo else f"the {args.job} job: {seq} tokens x {recipe.training.micro_batch_size}"
             if args.job else f"{seq} tokens x 2")
    text = [f"{steps} steps of {model} ({batch}) in {wall:.1f} s under the profiler; "
            f"{result.summary.get('tokens_per_s')} tokens/s",
            "", "by device time:", averages.table(sort_by=device_key, row_limit=25, max_name_column_width=60),
            "", "by host time:", averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60),
            "", *matmul_shapes(prof, device_key)]
    out.write_text("\n".join(text))
    print("\n".join(text[:1]))
    print(f"written: {out}")
    return 0


def matmul_shapes(prof, time_key: str, rows: int = 20) -> list[str]:
    """aten::mm by input shapes: calls, seconds and GFLOP/s in the step (the profiler adds its own cost), and the
    GFLOP/s of the same product timed alone on this machine; and the matmuls' share of all operators' time."""
    everything = sum(getattr(e, time_key) for e in prof.key_averages())
    shapes = sorted((e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm"),
                    key=lambda e: -getattr(e, time_key))
    total = sum(getattr(e, time_key) for e in shapes)
    lines = [f"aten::mm: {total / 1e6:.2f} s, {100 * total / max(everything, 1):.0f}% of all operators' self time; "
             "by shape (calls, seconds, GFLOP/s in the step, GFLOP/s alone):"]
    for e in shapes[:rows]:
        seconds = getattr(e, time_key) / 1e6
        lines.append(f"  {e.input_shapes}  {e.count}  {seconds:.2f}  {e.flops / max(seconds, 1e-9) / 1e9:.0f}  "
                     f"{alone_gflops(e.input_shapes, 'cuda' if time_key.startswith('self_cuda') else 'cpu'):.0f}")
    return lines


def alone_gflops(shapes: list, device: str, repeats: int = 5) -> float:
    """The best GFLOP/s of one (m × k) @ (k × n) product of random float32 matrices, outside any profiler."""
    import torch

    (m, k), (_, n) = shapes[:2]
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


if __name__ == "__main__":
    raise SystemExit(main())
