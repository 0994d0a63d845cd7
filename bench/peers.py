"""The same LoRA job with lora-workbench, TRL's SFTTrainer and a plain PyTorch + peft loop, side by side.

    python bench/peers.py --job builtin-512 --repeats 2     # Llama, hidden 512, 8 layers (~10 minutes)
    python bench/peers.py --job smollm2 --repeats 2         # SmolLM2-135M-Instruct (~12 minutes)
    python bench/peers.py --quick                           # a smoke run with a tiny model (~30 s)
    python bench/peers.py --job smollm2 --tools workbench,workbench-baseline,trl,plain   # + fast paths off

Same model, data, LoRA configuration, tokens per optimizer step, maximum sequence length, one epoch,
precision and threads for every tool: the precision the workbench's `auto` resolves to on this machine
(bf16 autocast over bf16 weights where the CPU computes bf16 natively, else float32), printed in the header. The data set is generated here (instruction rows, short and
long answers mixed). Each tool runs in its own process, interleaved A B C A B C, so peak RSS is per
tool and load drifts hit all of them alike. Per tool: the best over repeats of the process and job
wall times (other work on the machine only ever adds time), CPU seconds, real (non-padding) tokens/s,
peak RSS, the eval loss on the same held-out rows (one shared evaluation for all tools) and MFU against
a matmul probe of this machine in bf16 and fp32; then the ratios workbench/TRL and workbench/plain.

Each peer gets its fastest documented settings for this job: TRL packs (`packing=True`, best-fit
decreasing, padding-free) without gradient checkpointing (measured faster than its unpacked, length-
grouped and checkpointed variants; `--trl-unpacked`, `--trl-sampling`, `--trl-checkpointing` run those);
the plain loop packs greedily with the same block-diagonal attention. `--batch` samples per step for
unpacked TRL; the packing tools take `--packs` sequences of max_seq_len per step, the same tokens per
step on average (see the steps column). The tool `workbench-baseline` is the same loop with
`training.fast_paths=false` (the libraries' own attention, loss and LoRA paths): what the fast paths are worth.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # peers_data / peers_tools sit beside this file

JOBS = {
    # model: a bench model size (built here) or a builtin name; rows sized so the slowest tool takes ~1-2 min
    "builtin-512": dict(model="builtin-512", train_rows=700, eval_rows=64, max_seq_len=512, batch=8, packs=2,
                        lr=1e-3),
    "smollm2": dict(model="builtin:smollm2-135m", train_rows=160, eval_rows=32, max_seq_len=512, batch=8, packs=2,
                    lr=5e-4),
    # a GPU job (bench/gpu_check.py): the Llama-3-shaped 1.24B model, rows packed into 2 × 2048 tokens a step
    "gpu-1b": dict(model="bench:llama3-1b", train_rows=1500, eval_rows=16, max_seq_len=2048, batch=32, packs=2,
                   lr=2e-4),
    "quick": dict(model="builtin-quick", train_rows=48, eval_rows=8, max_seq_len=256, batch=4, packs=1, lr=1e-3),
}
LORA = dict(r=16, alpha=32, dropout=0.05, target_modules="all-linear")
TOOL_NAMES = ("workbench", "workbench-baseline", "trl", "plain")  # baseline: training.fast_paths=false


# -- the parent: build inputs, run the tools interleaved, print the table ---------------------------------


def resolve_model(name: str) -> str:
    if name == "bench:llama3-1b":
        import llama3_1b

        return str(llama3_1b.path())
    if name.startswith("builtin:"):
        from workbench.builtin import resolve_builtin

        return str(resolve_builtin(name))
    from peers_data import model_folder

    return str(model_folder(name))


def job_spec(args, work: Path) -> dict:
    from peers_data import write_data

    job = {**JOBS["quick" if args.quick else args.job]}
    for key in ("train_rows", "eval_rows", "max_seq_len", "batch", "packs", "lr"):
        if getattr(args, key, None) is not None:
            job[key] = getattr(args, key)
    train, evaluation = write_data(work / "data", job["train_rows"], job["eval_rows"])
    spec = {**LORA, "model": resolve_model(job["model"]), "model_name": job["model"], "train": str(train),
            "eval": str(evaluation), "max_seq_len": job["max_seq_len"], "batch": job["batch"],
            "packs_per_step": job["packs"], "lr": job["lr"], "warmup_ratio": 0.05, "seed": 42,
            "threads": args.threads, "train_rows": job["train_rows"], "eval_rows": job["eval_rows"],
            "device": device(), **job_precision(args.threads)}
    if args.wb:
        spec["workbench_training"] = dict(_parse_override(o) for o in args.wb)
    spec["trl"] = {"gradient_checkpointing": args.trl_checkpointing, "train_sampling_strategy": args.trl_sampling,
                   "packing": not args.trl_unpacked}
    return spec


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def job_precision(threads: int) -> dict:
    """What the workbench's `auto` precision resolves to here: every tool then runs that precision."""
    import torch
    from workbench import Recipe
    from workbench.precision import local_kind, resolve

    torch.set_num_threads(threads)
    precision = resolve(Recipe(), local_kind())
    return {"model_dtype": precision.model_dtype, "mixed_precision": precision.mixed_precision,
            "precision_reason": precision.reason}


def _parse_override(text: str) -> tuple[str, object]:
    import yaml

    key, _, value = text.partition("=")
    return key, yaml.safe_load(value)


def run_child(spec: dict, tool: str, work: Path, index: int) -> dict:
    """One tool in a fresh process; process_s runs from the spawn to the adapter being saved."""
    out = work / f"{tool}-{index}"
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps({**spec, "tool": tool, "out": str(out)}))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(spec["threads"])}
    spawned, used = time.time(), _children_cpu_s()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    result_path = out / "result.json"
    if done.returncode != 0 or not result_path.exists():
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"tool": tool, "error": tail, "stderr": done.stderr[-4000:]}
    result = json.loads(result_path.read_text())
    result["process_s"] = round(result.pop("ended_at") - spawned, 2)
    result["cpu_s"] = round(_children_cpu_s() - used, 2)  # the whole process, shared evaluation included
    return result


def _children_cpu_s() -> float:
    """CPU seconds of finished child processes: less sensitive than wall time to other work on the machine."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured_peaks(threads: int) -> dict:
    """This machine's matmul peak (FLOP/s) in bf16 and fp32 with the benchmark's threads, best of a few tries;
    on a known GPU its data-sheet figure (what MFU is quoted against)."""
    import torch
    from workbench.metrics import _matmul_probe, peak_flops

    if torch.cuda.is_available():
        return {name: peak_flops("cuda", dtype, threads)[0] for name, dtype in (("bf16", "bfloat16"),
                                                                              ("fp32", "float32"))}

    torch.set_num_threads(threads)
    return {name: max(_matmul_probe("cpu", dtype, size=1024, seconds=1.0) for _ in range(2))
            for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def summarise(runs: list[dict], peaks: dict) -> dict:
    """Per tool: the best time over repeats (other work on the machine only ever adds time), medians otherwise."""
    def best(key):
        return min(r[key] for r in runs)

    def med(key):
        return statistics.median(r[key] for r in runs)

    loop_s = best("loop_s")
    flops = runs[0]["flops"]
    return {"tool": runs[0]["tool"], "settings": runs[0]["settings"], "repeats": len(runs),
            "process_s": best("process_s"), "job_s": best("job_s"), "loop_s": loop_s, "cpu_s": best("cpu_s"),
            "job_s_all": [r["job_s"] for r in runs], "tokens": runs[0]["tokens"], "steps": runs[0]["steps"],
            "tokens_per_s": runs[0]["tokens"] / loop_s, "peak_rss_mb": med("peak_rss_mb"),
            "eval_loss": med("eval_loss"), "flops": flops, "startup_s": runs[0].get("startup_s"),
            "finish_s": runs[0].get("finish_s"),
            "mfu_bf16": flops / loop_s / peaks["bf16"], "mfu_fp32": flops / loop_s / peaks["fp32"]}


def print_table(spec: dict, rows: list[dict], peaks: dict, loads: list[str]) -> None:
    print(f"\njob: {spec['model_name']} | {spec['train_rows']} train rows, {spec['eval_rows']} held-out rows | "
          f"LoRA r={spec['r']} alpha={spec['alpha']} dropout={spec['dropout']} {spec['target_modules']} | "
          f"max_seq_len {spec['max_seq_len']} | {spec['batch']} samples/step (packing tools: "
          f"{spec['packs_per_step']} packs/step) | lr {spec['lr']} cosine | 1 epoch | {spec['threads']} threads")
    print(f"precision: {spec['model_dtype']} weights, autocast {spec['mixed_precision']} ({spec['precision_reason']})")
    print(f"measured peak: bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s, fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s "
          f"(1024² matmul, {spec['threads']} threads) | load average: {' -> '.join(loads)}")
    head = (f"{'tool':10} {'process s':>9} {'job s':>7} {'loop s':>7} {'cpu s':>7} {'steps':>5} {'tokens':>7} {'tokens/s':>8} "
            f"{'peak MB':>8} {'eval loss':>9} {'MFU bf16':>8} {'MFU fp32':>8}")
    print(head)
    for r in rows:
        if "error" in r:
            print(f"{r['tool']:10} failed: {r['error']}")
            continue
        print(f"{r['tool']:10} {r['process_s']:>9.1f} {r['job_s']:>7.1f} {r['loop_s']:>7.1f} {r['cpu_s']:>7.1f} {r['steps']:>5} "
              f"{r['tokens']:>7} {r['tokens_per_s']:>8.0f} {r['peak_rss_mb']:>8.0f} {r['eval_loss']:>9.4f} "
              f"{100 * r['mfu_bf16']:>7.1f}% {100 * r['mfu_fp32']:>7.1f}%")
    print("(times: best of the repeats; memory and loss: medians; job = load model, prepare data, one epoch, save adapter; loop = the training "
          "loop; cpu = CPU seconds of the whole process, shared evaluation included; tokens/s = real tokens / loop s; "
          "peak = process peak RSS when the job ended on a CPU, max_memory_allocated on a GPU)")
    for r in rows:
        if "error" not in r:
            print(f"  {r['tool']}: {r['settings']}; job s per repeat {r['job_s_all']}")
    for r in rows:  # what a user waits for besides the loop: imports, loading, tokenizing, saving, estimates
        if "error" not in r:
            inside = f" (train() before its first step {r['startup_s']:.1f} s, after its last {r['finish_s']:.1f} s)" \
                if r.get("startup_s") is not None else ""
            print(f"  outside the loop, {r['tool']}: {r['process_s'] - r['loop_s']:.1f} s of {r['process_s']:.1f} s{inside}")
    print_ratios(rows)


def print_ratios(rows: list[dict]) -> None:
    by_tool = {r["tool"]: r for r in rows if "error" not in r}
    pairs = [(a, b) for a in ("workbench", "workbench-baseline") for b in ("trl", "plain") if a in by_tool and b in by_tool]
    for name, peer in pairs:
        ours, other = by_tool[name], by_tool[peer]
        loss = 100 * (ours["eval_loss"] / other["eval_loss"] - 1)
        print(f"{name}/{peer}: process time {ours['process_s'] / other['process_s']:.2f}x, "
              f"job time {ours['job_s'] / other['job_s']:.2f}x, loop time {ours['loop_s'] / other['loop_s']:.2f}x, "
              f"cpu time {ours['cpu_s'] / other['cpu_s']:.2f}x, "
              f"tokens/s {ours['tokens_per_s'] / other['tokens_per_s']:.2f}x, "
              f"peak memory {ours['peak_rss_mb'] / other['peak_rss_mb']:.2f}x, eval loss {loss:+.1f}%")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=[j for j in JOBS if j != "quick"], default="builtin-512")
    parser.add_argument("--quick", action="store_true", help="a tiny model and a few rows: a smoke run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tools", help="comma-separated, from workbench,workbench-baseline,trl,plain (default: "
                        "workbench,trl,plain)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train-rows", dest="train_rows", type=int)
    parser.add_argument("--eval-rows", dest="eval_rows", type=int)
    parser.add_argument("--max-seq-len", dest="max_seq_len", type=int)
    parser.add_argument("--batch", type=int, help="samples per optimizer step (TRL, unpacked)")
    parser.add_argument("--packs", type=int, help="packed sequences per optimizer step (workbench, plain)")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--trl-checkpointing", action="store_true",
                        help="gradient checkpointing, TRL's own default (slower, leaner); off by default: faster")
    parser.add_argument("--trl-unpacked", action="store_true",
                        help="TRL without its packing (padded batches of --batch samples); packed is its fastest here")
    parser.add_argument("--trl-sampling", default="random", choices=["random", "group_by_length"])
    parser.add_argument("--wb", action="append", default=[], metavar="KEY=VALUE",
                        help="extra workbench training.* setting, e.g. --wb gradient_checkpointing=true")
    parser.add_argument("--out", help="also write the per-run and summary rows to this JSON file")
    parser.add_argument("--table", metavar="JSON", help="print the table of an earlier --out file again")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(Path(args.child))
    if args.table:
        return reprint(Path(args.table))

    tools = args.tools.split(",") if args.tools else [t for t in TOOL_NAMES if t != "workbench-baseline"]
    unknown = [t for t in tools if t not in TOOL_NAMES]
    if unknown:
        parser.error(f"unknown tool(s) {unknown}; known: {', '.join(TOOL_NAMES)}")
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        work = Path(tmp)
        spec = job_spec(args, work)
        loads = [load_average()]
        peaks = measured_peaks(args.threads)
        runs = {tool: [] for tool in tools}
        for repeat in range(args.repeats):
            for tool in tools:  # interleaved: A B C A B C
                print(f"repeat {repeat + 1}/{args.repeats}: {tool} ... (load {load_average()})", file=sys.stderr,
                      flush=True)
                runs[tool].append(run_child(spec, tool, work, repeat))
        loads.append(load_average())
    rows = []
    for tool in tools:
        failed = [r for r in runs[tool] if "error" in r]
        rows.append(failed[0] if failed else summarise(runs[tool], peaks))
    print_table(spec, rows, peaks, loads)
    if args.out:
        Path(args.out).write_text(json.dumps({"spec": spec, "peaks": peaks, "load_average": loads, "summary": rows,
                                              "runs": runs}, indent=2))
    for r in rows:
        if "error" in r:
            print(f"\n{r['tool']} failed:\n{r['stderr']}", file=sys.stderr)
    if any("error" in r for r in rows):
        raise SystemExit(1)


def reprint(path: Path) -> None:
    saved = json.loads(path.read_text())
    rows = [summarise(runs, saved["peaks"]) for runs in saved["runs"].values() if all("error" not in r for r in runs)]
    print_table(saved["spec"], rows, saved["peaks"], saved["load_average"])


def child(spec_path: Path) -> None:
    from workbench.quiet import quiet_libraries

    quiet_libraries()
    from peers_tools import run_tool

    spec = json.loads(spec_path.read_text())
    result = run_tool(spec)
    (spec_path.parent / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
