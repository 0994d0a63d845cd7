"""Where a training step's time goes: a few steps of `wb.train` under torch.profiler, the top operators by
device time and by host time, written to a text file.

    python bench/profile_steps.py                  # a GPU: bench:llama3-1b, 2 x 2,048 tokens, 8 steps
    python bench/profile_steps.py --cpu            # any CPU: builtin:tiny, 2 x 128 tokens, 4 steps
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
    parser.add_argument("--steps", type=int, default=None, help="steps to profile (default 8 on a GPU, 4 on a CPU)")
    parser.add_argument("--out", default="profile_steps.txt", help="the tables go here")
    args, overrides = parser.parse_known_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from peers_data import write_data
    from workbench import Recipe, train

    gpu = torch.cuda.is_available() and not args.cpu
    if gpu:
        import llama3_1b

        model, seq, steps = str(llama3_1b.path()), 2048, args.steps or 8
    else:
        from workbench.builtin import resolve_builtin

        model, seq, steps = str(resolve_builtin("builtin:tiny")), 128, args.steps or 4
    out = Path(args.out)
    data = write_data(out.parent / "profile_data", 400, 4)
    recipe = Recipe.load(ROOT / "recipes/quickstart.yaml", [
        "name=profile", f"output.dir={out.parent / 'profile_runs'}/{{name}}", f"model.path={model}",
        f"data.train={data[0]}", f"data.eval={data[1]}", f"data.max_seq_len={seq}", "data.packing=true",
        f"training.max_steps={steps}", "training.epochs=1000", "training.micro_batch_size=2",
        "training.grad_accum=1", "output.save_every=null", "output.eval_every=null", "output.log_every=1",
        "output.sample_prompts=[]", *overrides])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        result = train(recipe, overwrite=True, progress_bar=False)
    wall = time.perf_counter() - started
    device_key = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    averages = prof.key_averages()
    text = [f"{steps} steps of {model} ({seq} tokens x 2) in {wall:.1f} s under the profiler; "
            f"{result.summary.get('tokens_per_s')} tokens/s",
            "", "by device time:", averages.table(sort_by=device_key, row_limit=25, max_name_column_width=60),
            "", "by host time:", averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)]
    out.write_text("\n".join(text))
    print("\n".join(text[:1]))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
