"""The same LoRA job with lora-workbench, TRL's SFTTrainer and a plain PyTorch + peft loop, side by side.

    python bench/peers.py --job builtin-512 --repeats 2     # Llama, hidden 512, 8 layers (~10 minutes)
    python bench/peers.py --job smollm2 --repeats 2         # SmolLM2-135M-Instruct (~12 minutes)
    python bench/peers.py --quick                           # a smoke run with a tiny model (~30 s)
    python bench/peers.py --job smollm2 --tools workbench,workbench-baseline,trl,plain   # + fast paths off
    python bench/peers.py --objective dpo --job smollm2     # DPO: workbench vs TRL's DPOTrainer (~8 minutes)
    python bench/peers.py --objective dpo --quick           # the DPO smoke run (~30 s)

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

The DPO job (`--objective dpo`, with any --job or --quick): the same preference job with the workbench
(`training.objective: dpo`, `data.format: preference`) and TRL's DPOTrainer, both LoRA through peft with the
same configuration (dropout 0: TRL's DPO switches dropout off by default, `disable_dropout=True`), the same
beta, sigmoid loss, the reference = the base model with the adapter switched off (no second copy), the same
preference rows (peers_data.py: a right answer against a near miss, short and long mixed), the same pairs
per optimizer step (`--batch`), max length per sequence (`max_seq_len`), one epoch, precision and threads.
The goal: the workbench in at most 0.5x TRL's job time and at most its peak memory (the last line says
whether it is met). Besides time and memory, each tool's own final train loss (the mean of its last 10
per-step losses, from its own log) and the DPO loss and reward accuracy of the held-out pairs, computed for
both by one function (peers_tools.eval_dpo: one pair at a time, no padding, the reference with the adapter off).
The plain loop is left out of the DPO job (it is an SFT loop; a DPO loop of one's own is the workbench's
objectives.py over again).

TRL's settings for the DPO job, its fastest documented ones on a CPU (measured on SmolLM2-135M, 16 pairs,
4 pairs per step, 2 threads, an idle machine; job s / loop s / peak MB):
  - per_device_train_batch_size=1 with gradient_accumulation_steps=4: 61 / 60 / 3671 (chosen and rejected
    of one pair padded together: almost no padding). Batches of 2 pairs: 76 / 74 / 6587; of 4 pairs (no
    accumulation): 118 / 116 / 10737, padding to the batch's longest sequence is what costs. `--micro-batch`
    sets the pairs per forward for both tools (default 1);
  - gradient_checkpointing=False (DPOConfig's default is True): with it 81 / 80 / 2709, leaner but 1.3x slower
    (`--trl-checkpointing` runs it);
  - precompute_ref_log_probs=False: with it 64 / 43 / 3514, the loop is shorter but the same reference
    forwards run before it, so the job is not faster (`--trl-precompute` runs it);
  - padding_free: unavailable in TRL 1.16 (DPOConfig says it warns and falls back to padding), not set;
  - train_sampling_strategy="group_by_length" fails on DPO's tokenized columns ("Can only automatically infer
    lengths for datasets whose items are dictionaries with an 'input_ids' key"; and with one pair per forward
    there is nothing to group), so random sampling;
  - its fused LM head (log-probabilities in chunks, no full logits) is TRL's default, kept.
The workbench runs the same layout by default: `micro_batch_size` 1 x `grad_accum` 4, a pair per row (chosen
then rejected, per-sample attention), the same optimizer steps over the same pairs as TRL's (51 / 49 / 3151 in
the measurement above; 4 pairs per forward: 82 / 80 / 7861). `--wb-packed` packs pairs into rows of
2 x max_seq_len instead (47 / 45 / 3903, 6 steps: the same pairs per step only on average). Those figures
predate shared prompts: on a CPU the workbench's pair holds its prompt once (the rejected answer continues it),
15,659 of the smollm2 job's 20,441 tokens; the tokens column counts both whole sequences for both tools, and
MFU counts the FLOPs each tool's loop computed.
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
    # shapes held out from tuning: many short alpaca-style rows (~10 per packed 256-token row), single samples
    # near max_seq_len (packing gains nothing), and a wide shallow model (large matmuls, little else)
    "short": dict(model="small-256", rows="short", train_rows=2000, eval_rows=64, max_seq_len=256, batch=8,
                  packs=1, lr=1e-3),
    "long": dict(model="small-256", rows="long", train_rows=96, eval_rows=16, max_seq_len=512, batch=4, packs=4,
                 lr=1e-3),
    "wide": dict(model="wide-1024", train_rows=160, eval_rows=32, max_seq_len=512, batch=8, packs=2, lr=5e-4),
}
# the DPO job (--objective dpo): preference pairs; batch = pairs per optimizer step for both tools; beta is DPO's
DPO_JOBS = {
    "builtin-512": dict(model="builtin-512", train_rows=192, eval_rows=32, max_seq_len=512, batch=8, packs=2,
                        lr=5e-4, beta=0.1),
    "smollm2": dict(model="builtin:smollm2-135m", train_rows=64, eval_rows=16, max_seq_len=512, batch=4, packs=1,
                    lr=2e-4, beta=0.1),
    # (not run yet) on a GPU, several pairs per forward: padding is cheap there, small kernels are not
    "gpu-1b": dict(model="bench:llama3-1b", train_rows=512, eval_rows=16, max_seq_len=1024, batch=16, packs=4,
                   lr=5e-5, beta=0.1, micro_batch=4),
    "quick": dict(model="builtin-quick", train_rows=32, eval_rows=8, max_seq_len=256, batch=4, packs=1, lr=1e-3,
                  beta=0.1),
}
LORA = dict(r=16, alpha=32, dropout=0.05, target_modules="all-linear")
DPO_LORA_DROPOUT = 0.0  # TRL's DPO switches dropout off (disable_dropout=True): both tools run without it
# baseline: training.fast_paths=false; trl-unpacked: TRL's SFTTrainer on padded batches of --batch samples
TOOL_NAMES = ("workbench", "workbench-baseline", "trl", "trl-unpacked", "plain")
DPO_TOOL_NAMES = ("workbench", "workbench-baseline", "trl")  # the plain loop is an SFT loop


# -- the parent: build inputs, run the tools interleaved, print the table ---------------------------------


def resolve_model(name: str) -> str:
    if name == "bench:llama3-1b":
        import llama3_1b

        return str(llama3_1b.path())
    if name.startswith("builtin:"):
        from workbench.base.builtin import resolve_builtin

        return str(resolve_builtin(name))
    from peers_data import model_folder

    return str(model_folder(name))


def job_spec(args, work: Path) -> dict:
    from peers_data import write_data, write_preference_data

    dpo = args.objective == "dpo"
    job = {**(DPO_JOBS if dpo else JOBS)["quick" if args.quick else args.job or "builtin-512"]}
    for key in ("train_rows", "eval_rows", "max_seq_len", "batch", "packs", "lr", "beta"):
        if getattr(args, key, None) is not None:
            job[key] = getattr(args, key)
    if dpo:
        train, evaluation = write_preference_data(work / "data", job["train_rows"], job["eval_rows"])
    else:
        train, evaluation = write_data(work / "data", job["train_rows"], job["eval_rows"], job.get("rows", "mixed"))
    lora = {**LORA, "dropout": DPO_LORA_DROPOUT} if dpo else LORA
    spec = {**lora, "model": resolve_model(job["model"]), "model_name": job["model"], "train": str(train),
            "eval": str(evaluation), "max_seq_len": job["max_seq_len"], "batch": job["batch"],
            "packs_per_step": job["packs"], "lr": job["lr"], "warmup_ratio": 0.05, "seed": 42,
            "threads": args.threads, "train_rows": job["train_rows"], "eval_rows": job["eval_rows"],
            "device": device(), **job_precision(args.threads, args.precision)}
    if args.wb:
        spec["workbench_training"] = dict(_parse_override(o) for o in args.wb)
    spec["trl"] = {"gradient_checkpointing": args.trl_checkpointing, "train_sampling_strategy": args.trl_sampling,
                   "packing": not args.trl_unpacked}
    spec["objective"] = args.objective
    if dpo:
        spec["beta"] = job["beta"]
        spec["wb_packing"] = args.wb_packed
        spec["micro_batch"] = args.micro_batch or job.get("micro_batch", 1)
        if spec["batch"] % spec["micro_batch"]:
            raise SystemExit(f"--batch {spec['batch']} must be a multiple of --micro-batch {spec['micro_batch']}")
        spec["trl"]["precompute_ref_log_probs"] = args.trl_precompute
    return spec


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def job_precision(threads: int, precision: str = "auto") -> dict:
    """What the workbench's `auto` precision resolves to here (or the one asked for): every tool runs it."""
    import torch
    from workbench import Recipe
    from workbench.hardware.current import local_kind
    from workbench.hardware.precision import resolve

    torch.set_num_threads(threads)
    asked = {"auto": [], "fp32": ["model.dtype=float32", "training.mixed_precision=no"],
             "bf16": ["model.dtype=bfloat16", "training.mixed_precision=bf16"]}[precision]
    precision = resolve(Recipe().override(*asked), local_kind())
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
    spawned, used, busy = time.time(), _children_cpu_s(), machine_busy_s()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    result_path = out / "result.json"
    if done.returncode != 0 or not result_path.exists():
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"tool": tool, "error": tail, "stderr": done.stderr[-4000:]}
    result = json.loads(result_path.read_text())
    result["process_s"] = round(result.pop("ended_at") - spawned, 2)
    result["cpu_s"] = round(_children_cpu_s() - used, 2)  # the whole process, shared evaluation included
    if busy is not None:  # what other processes took from the machine meanwhile: > a few % and the times are off
        result["others_cpu_s"] = round(max(0.0, machine_busy_s() - busy - result["cpu_s"]), 1)
    return result


def machine_busy_s() -> float | None:
    """CPU seconds all processes of the machine have used (Linux /proc/stat), None where there is no /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(limit_s: float, window_s: float = 10.0) -> str:
    """Wait (at most limit_s) until the machine's CPUs were at least 90% idle over window_s: on a shared machine,
    other jobs oversubscribing the cores make every tool several times slower, unevenly."""
    started = time.time()
    while True:
        before = machine_busy_s()
        if before is None:
            return "n/a"
        time.sleep(window_s)
        share = (machine_busy_s() - before) / (window_s * os.cpu_count())
        waited = time.time() - started
        if share <= 0.1 or waited >= limit_s:
            return f"{100 * share:.0f}% busy after waiting {waited:.0f} s"


def _children_cpu_s() -> float:
    """CPU seconds of finished child processes: less sensitive than wall time to other work on the machine."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured_peaks(threads: int, seconds: float = 1.0) -> dict:
    """This machine's matmul peak (FLOP/s) in bf16 and fp32 with the benchmark's threads, best of a few tries of
    `seconds` each; on a known GPU its data-sheet figure (what MFU is quoted against)."""
    import torch
    from workbench.hardware.catalogue import peak_flops, peak_probe_size
    from workbench.hardware.probes import matmul_rate

    if torch.cuda.is_available():
        return {name: peak_flops("cuda", dtype, threads)[0] for name, dtype in (("bf16", "bfloat16"),
                                                                              ("fp32", "float32"))}

    torch.set_num_threads(threads)
    return {name: max(matmul_rate("cpu", dtype, size=peak_probe_size("cpu", dtype), seconds=seconds, repeats=4)
                      for _ in range(2))
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
    dpo = {key: med(key) for key in ("eval_reward_accuracy", "eval_reward_margin") if key in runs[0]}
    if "pairs" in runs[0]:
        dpo["pairs"] = runs[0]["pairs"]
    if runs[0].get("train_loss") is not None:
        dpo["train_loss"] = med("train_loss")
    return {**dpo, "tool": runs[0]["tool"], "settings": runs[0]["settings"], "repeats": len(runs),
            "process_s": best("process_s"), "job_s": best("job_s"), "loop_s": loop_s, "cpu_s": best("cpu_s"),
            "job_s_all": [r["job_s"] for r in runs], "others_cpu_s_all": [r.get("others_cpu_s") for r in runs],
            "tokens": runs[0]["tokens"], "steps": runs[0]["steps"],
            "tokens_per_s": runs[0]["tokens"] / loop_s, "peak_rss_mb": med("peak_rss_mb"),
            "eval_loss": med("eval_loss"), "flops": flops, "startup_s": runs[0].get("startup_s"),
            "finish_s": runs[0].get("finish_s"), "floor_mb": _median_of(runs, "floor_mb"),
            "mfu_bf16": flops / loop_s / peaks["bf16"], "mfu_fp32": flops / loop_s / peaks["fp32"]}


def _median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def print_table(spec: dict, rows: list[dict], peaks: dict, loads: list[str]) -> None:
    if spec.get("objective") == "dpo":
        return print_dpo_table(spec, rows, peaks, loads)
    print(f"\njob: {spec['model_name']} | {spec['train_rows']} train rows, {spec['eval_rows']} held-out rows | "
          f"LoRA r={spec['r']} alpha={spec['alpha']} dropout={spec['dropout']} {spec['target_modules']} | "
          f"max_seq_len {spec['max_seq_len']} | {spec['batch']} samples/step (packing tools: "
          f"{spec['packs_per_step']} packs/step) | lr {spec['lr']} cosine | 1 epoch | {spec['threads']} threads")
    print(f"precision: {spec['model_dtype']} weights, autocast {spec['mixed_precision']} ({spec['precision_reason']})")
    print(f"measured peak: bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s, fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s "
          f"(1024² matmul, {spec['threads']} threads) | load average: {' -> '.join(loads)}")
    head = (f"{'tool':12} {'process s':>9} {'job s':>7} {'loop s':>7} {'cpu s':>7} {'steps':>5} {'tokens':>7} {'tokens/s':>8} "
            f"{'peak MB':>8} {'eval loss':>9} {'MFU bf16':>8} {'MFU fp32':>8}")
    print(head)
    for r in rows:
        if "error" in r:
            print(f"{r['tool']:12} failed: {r['error']}")
            continue
        print(f"{r['tool']:12} {r['process_s']:>9.1f} {r['job_s']:>7.1f} {r['loop_s']:>7.1f} {r['cpu_s']:>7.1f} {r['steps']:>5} "
              f"{r['tokens']:>7} {r['tokens_per_s']:>8.0f} {r['peak_rss_mb']:>8.0f} {r['eval_loss']:>9.4f} "
              f"{100 * r['mfu_bf16']:>7.1f}% {100 * r['mfu_fp32']:>7.1f}%")
    print("(times: best of the repeats; memory and loss: medians; job = load model, prepare data, one epoch, save adapter; loop = the training "
          "loop; cpu = CPU seconds of the whole process, shared evaluation included; tokens/s = real tokens / loop s; "
          "peak = process peak RSS when the job ended on a CPU, max_memory_allocated on a GPU)")
    for r in rows:
        if "error" not in r:
            print(f"  {r['tool']}: {r['settings']}; job s per repeat {r['job_s_all']}{others(r)}")
    print_outside(rows)
    print_floors(rows)
    print_ratios(rows)


def others(row: dict) -> str:
    """The CPU seconds other processes took while this tool ran: where they are more than a few percent of the
    tool's own, the machine was shared and its times are too high."""
    taken = [x for x in row.get("others_cpu_s_all", []) if x is not None]
    return f"; other processes' CPU s meanwhile {taken}" if taken else ""


def print_outside(rows: list[dict]) -> None:
    for r in rows:  # what a user waits for besides the loop: imports, loading, tokenizing, saving, estimates
        if "error" not in r:
            inside = f" (train() before its first step {r['startup_s']:.1f} s, after its last {r['finish_s']:.1f} s)" \
                if r.get("startup_s") is not None else ""
            print(f"  outside the loop, {r['tool']}: {r['process_s'] - r['loop_s']:.1f} s of {r['process_s']:.1f} s{inside}")


def print_floors(rows: list[dict]) -> None:
    """What each tool held when its training loop began: the memory a short job pays whatever its steps do."""
    floors = [f"{r['tool']} {r['floor_mb']:.0f} of {r['peak_rss_mb']:.0f} MB" for r in rows
              if "error" not in r and r.get("floor_mb")]
    if floors:
        print(f"  peak memory when the loop began, of the job's peak: {'; '.join(floors)}")


def print_dpo_table(spec: dict, rows: list[dict], peaks: dict, loads: list[str]) -> None:
    micro = spec.get("micro_batch", spec["batch"])
    packing = f"{micro} per forward x {spec['batch'] // micro} accumulated"
    if spec.get("wb_packing"):
        packing += f"; workbench packed: {spec['packs_per_step']} packs of 2 x {spec['max_seq_len']}/step"
    print(f"\nDPO job: {spec['model_name']} | {spec['train_rows']} train pairs, {spec['eval_rows']} held-out pairs | "
          f"beta {spec['beta']} sigmoid, reference = base with the adapter off | LoRA r={spec['r']} "
          f"alpha={spec['alpha']} dropout={spec['dropout']} {spec['target_modules']} | max_seq_len {spec['max_seq_len']} "
          f"per sequence | {spec['batch']} pairs/step ({packing}) | lr {spec['lr']} cosine | 1 epoch | "
          f"{spec['threads']} threads")
    print(f"precision: {spec['model_dtype']} weights, autocast {spec['mixed_precision']} ({spec['precision_reason']})")
    print(f"measured peak: bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s, fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s "
          f"(1024² matmul, {spec['threads']} threads) | load average: {' -> '.join(loads)}")
    print(f"{'tool':10} {'process s':>9} {'job s':>7} {'loop s':>7} {'cpu s':>7} {'steps':>5} {'pairs':>5} "
          f"{'tokens':>7} {'tokens/s':>8} {'peak MB':>8} {'train loss':>10} {'eval loss':>9} {'eval acc':>8} "
          f"{'MFU bf16':>8} {'MFU fp32':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['tool']:10} failed: {r['error']}")
            continue
        train_loss = f"{r['train_loss']:>10.4f}" if r.get("train_loss") is not None else f"{'n/a':>10}"
        print(f"{r['tool']:10} {r['process_s']:>9.1f} {r['job_s']:>7.1f} {r['loop_s']:>7.1f} {r['cpu_s']:>7.1f} "
              f"{r['steps']:>5} {r['pairs']:>5} {r['tokens']:>7} {r['tokens_per_s']:>8.0f} {r['peak_rss_mb']:>8.0f} "
              f"{train_loss} {r['eval_loss']:>9.4f} {100 * r['eval_reward_accuracy']:>7.1f}% "
              f"{100 * r['mfu_bf16']:>7.1f}% {100 * r['mfu_fp32']:>7.1f}%")
    print("(times: best of the repeats; memory and losses: medians; job = load model, prepare data, one epoch, save "
          "adapter; loop = the training loop; cpu = CPU seconds of the whole process, shared evaluation included; "
          "tokens = real tokens of both sequences of every pair; tokens/s = tokens / loop s; peak = process peak RSS "
          "when the job ended on a CPU, max_memory_allocated on a GPU; train loss = the tool's own per-step DPO loss, "
          "mean of its last 10 steps; eval loss / acc = DPO loss and reward accuracy (chosen reward > rejected) of the "
          "held-out pairs, one shared function; MFU counts the reference forward where it runs in the loop)")
    for r in rows:
        if "error" not in r:
            print(f"  {r['tool']}: {r['settings']}; job s per repeat {r['job_s_all']}{others(r)}")
    print_outside(rows)
    print_ratios(rows, dpo=True)


def print_ratios(rows: list[dict], dpo: bool = False) -> None:
    by_tool = {r["tool"]: r for r in rows if "error" not in r}
    pairs = [(a, b) for a in ("workbench", "workbench-baseline") for b in ("trl", "trl-unpacked", "plain")
             if a in by_tool and b in by_tool]
    for name, peer in pairs:
        ours, other = by_tool[name], by_tool[peer]
        loss = 100 * (ours["eval_loss"] / other["eval_loss"] - 1)
        line = (f"{name}/{peer}: process time {ours['process_s'] / other['process_s']:.2f}x, "
                f"job time {ours['job_s'] / other['job_s']:.2f}x, loop time {ours['loop_s'] / other['loop_s']:.2f}x, "
                f"cpu time {ours['cpu_s'] / other['cpu_s']:.2f}x, "
                f"tokens/s {ours['tokens_per_s'] / other['tokens_per_s']:.2f}x, "
                f"peak memory {ours['peak_rss_mb'] / other['peak_rss_mb']:.2f}x, eval loss {loss:+.1f}%")
        if dpo:
            accuracy = 100 * (ours["eval_reward_accuracy"] - other["eval_reward_accuracy"])
            line += f", eval reward accuracy {accuracy:+.1f} points"
        print(line)
    if dpo and "workbench" in by_tool and "trl" in by_tool:
        ours, other = by_tool["workbench"], by_tool["trl"]
        time_ratio, memory_ratio = ours["job_s"] / other["job_s"], ours["peak_rss_mb"] / other["peak_rss_mb"]
        print(f"goal (workbench job time <= 0.5x TRL's, peak memory <= TRL's): time {time_ratio:.2f}x "
              f"{'met' if time_ratio <= 0.5 else 'NOT met'}, memory {memory_ratio:.2f}x "
              f"{'met' if memory_ratio <= 1 else 'NOT met'}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=[j for j in JOBS if j != "quick"], help="the job (default builtin-512)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and a few rows: a smoke run")
    parser.add_argument("--objective", choices=["sft", "dpo"], default="sft",
                        help="dpo: the job's preference version, workbench vs TRL's DPOTrainer (no plain loop)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tools", help="comma-separated, from workbench,workbench-baseline,trl,plain (default: "
                        "workbench,trl,plain)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="every tool's precision: auto = what the workbench's auto resolves to on this CPU")
    parser.add_argument("--shapes", help="comma-separated jobs (e.g. short,long,wide) run one after another at every "
                        "--precisions, then one table of ratios; adds trl-unpacked to the default tools")
    parser.add_argument("--precisions", help="with --shapes: comma-separated, from auto,fp32,bf16 (default fp32,bf16)")
    parser.add_argument("--train-rows", dest="train_rows", type=int)
    parser.add_argument("--eval-rows", dest="eval_rows", type=int)
    parser.add_argument("--max-seq-len", dest="max_seq_len", type=int)
    parser.add_argument("--batch", type=int, help="samples per optimizer step (TRL, unpacked)")
    parser.add_argument("--packs", type=int, help="packed sequences per optimizer step (workbench, plain)")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--beta", type=float, help="DPO's beta (--objective dpo)")
    parser.add_argument("--micro-batch", dest="micro_batch", type=int,
                        help="DPO: pairs per forward for both tools, accumulated to --batch pairs per step (default 1: "
                        "no padding between pairs, the fastest for both on a CPU)")
    parser.add_argument("--trl-checkpointing", action="store_true",
                        help="gradient checkpointing, TRL's own default (slower, leaner); off by default: faster")
    parser.add_argument("--trl-unpacked", action="store_true",
                        help="TRL without its packing (padded batches of --batch samples); packed is its fastest here")
    parser.add_argument("--trl-sampling", default="random", choices=["random", "group_by_length"])
    parser.add_argument("--trl-precompute", action="store_true",
                        help="DPO: TRL's precompute_ref_log_probs=True (reference log-probs before the loop)")
    parser.add_argument("--wb-packed", action="store_true",
                        help="DPO: the workbench packs pairs (--packs per step) instead of --batch pairs per step")
    parser.add_argument("--wb", action="append", default=[], metavar="KEY=VALUE",
                        help="extra workbench training.* setting, e.g. --wb gradient_checkpointing=true")
    parser.add_argument("--wait-quiet", dest="wait_quiet", type=float, default=0, metavar="S",
                        help="before each run wait up to S seconds for the machine to be idle (shared machines)")
    parser.add_argument("--probe-s", dest="probe_s", type=float, default=1.0, metavar="S",
                        help="seconds of each try of the CPU matmul probe that MFU is quoted against (default 1; a "
                        "smoke run that reads no MFU can take 0.1)")
    parser.add_argument("--out", help="also write the per-run and summary rows to this JSON file")
    parser.add_argument("--table", metavar="JSON", help="print the table of an earlier --out file again")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return child(Path(args.child))
    if args.table:
        return reprint(Path(args.table))
    if args.shapes and (args.job or args.quick):
        parser.error("--shapes names the jobs itself: leave out --job and --quick")
    if args.precisions and not args.shapes:
        parser.error("--precisions goes with --shapes; one job takes --precision")
    args.job, args.precisions = args.job or "builtin-512", args.precisions or "fp32,bf16"

    known = DPO_TOOL_NAMES if args.objective == "dpo" else TOOL_NAMES
    default = [t for t in known if t != "workbench-baseline" and (t != "trl-unpacked" or args.shapes)]
    tools = args.tools.split(",") if args.tools else default
    unknown = [t for t in tools if t not in known]
    if unknown:
        parser.error(f"unknown tool(s) {unknown} for --objective {args.objective}; known: {', '.join(known)}")
    if args.shapes:
        return run_shapes(args, tools, parser)
    spec, rows, peaks, loads, runs = run_job(args, tools)
    print_table(spec, rows, peaks, loads)
    if args.out:
        Path(args.out).write_text(json.dumps({"spec": spec, "peaks": peaks, "load_average": loads, "summary": rows,
                                              "runs": runs}, indent=2))
    report_failures(rows)


def run_job(args, tools: list[str]) -> tuple[dict, list[dict], dict, list[str], dict]:
    """One job, every tool in a process of its own, interleaved over the repeats: (spec, summary rows, the
    machine's matmul peaks, load averages, every run)."""
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        work = Path(tmp)
        spec = job_spec(args, work)
        loads = [load_average()]
        peaks = measured_peaks(args.threads, args.probe_s)
        runs = {tool: [] for tool in tools}
        for repeat in range(args.repeats):
            for tool in tools:  # interleaved: A B C A B C
                quiet = f", machine {wait_for_quiet(args.wait_quiet)}" if args.wait_quiet else ""
                print(f"{'quick' if args.quick else args.job} {args.precision}, repeat {repeat + 1}/{args.repeats}: {tool} ... "
                      f"(load {load_average()}{quiet})", file=sys.stderr, flush=True)
                runs[tool].append(run_child(spec, tool, work, repeat))
        loads.append(load_average())
    rows = []
    for tool in tools:
        failed = [r for r in runs[tool] if "error" in r]
        rows.append(failed[0] if failed else summarise(runs[tool], peaks))
    return spec, rows, peaks, loads, runs


def report_failures(rows: list[dict]) -> None:
    for r in rows:
        if "error" in r:
            print(f"\n{r['tool']} failed:\n{r['stderr']}", file=sys.stderr)
    if any("error" in r for r in rows):
        raise SystemExit(1)


def run_shapes(args, tools: list[str], parser) -> None:
    """Every job shape in --shapes at every precision in --precisions, each a job of its own (tools interleaved),
    then one table of the workbench's time and memory against each peer's."""
    if args.objective != "sft":
        parser.error("--shapes compares SFT jobs")
    shapes, precisions = args.shapes.split(","), args.precisions.split(",")
    wrong = [x for x in shapes if x not in JOBS] + [x for x in precisions if x not in ("auto", "fp32", "bf16")]
    if wrong:
        parser.error(f"unknown shape or precision {wrong}: shapes {', '.join(JOBS)}; precisions auto, fp32, bf16")
    if "bf16" in precisions and not _native_bf16():
        print("note: this CPU has no native bf16 matmul: every tool's bf16 job is many times slower than its float32 "
              "one (the workbench's auto precision would not choose it)", file=sys.stderr)
    jobs = []
    for shape in shapes:
        for precision in precisions:
            job_args = argparse.Namespace(**{**vars(args), "job": shape, "precision": precision, "quick": False})
            spec, rows, peaks, loads, runs = run_job(job_args, tools)
            print_table(spec, rows, peaks, loads)
            jobs.append({"shape": shape, "precision": precision, "spec": spec, "summary": rows, "runs": runs,
                         "peaks": peaks, "load_average": loads})
            if args.out:  # after every job: a long sweep stopped halfway keeps what it measured
                Path(args.out).write_text(json.dumps({"jobs": jobs}, indent=2))
    print_shapes_table(jobs)
    report_failures([r for job in jobs for r in job["summary"]])


def _native_bf16() -> bool:
    from workbench.hardware.precision import cpu_half

    return cpu_half().half is not None


def print_shapes_table(jobs: list[dict]) -> None:
    """One row per (shape, precision): each tool's process seconds, and the workbench's process time, job time and
    peak memory as ratios to each peer's. The goal: at most 0.5x the time of TRL's faster setup (packed or not), the
    process as a user waits for it, at most 1.0x its peak memory."""
    peers = [t for t in ("trl", "trl-unpacked", "plain") if any(t in _by_tool(j) for j in jobs)]
    print("\nall shapes: process seconds (spawn to adapter saved); workbench / peer as process time, job time (after "
          "imports: load, prepare, one epoch, save) and peak memory")
    print(f"{'shape':7} {'precision':9} {'wb s':>6} " + " ".join(f"{p + ' s':>15}" for p in peers) + " "
          + " ".join(f"{'wb/' + p + ' proc job peak':>29}" for p in peers) + "  goal (<= 0.5x time, <= 1x peak)")
    for job in jobs:
        tools = _by_tool(job)
        ours = tools.get("workbench")
        asked = job["precision"] if job["precision"] != "auto" else f"auto={job['spec']['model_dtype'][:4]}"
        line = f"{job['shape']:7} {asked:9} "
        failed = any(r["tool"] == "workbench" and "error" in r for r in job["summary"])
        line += f"{ours['process_s']:>6.1f} " if ours else f"{'failed' if failed else '-':>6} "
        line += " ".join(f"{tools[p]['process_s']:>15.1f}" if p in tools else f"{'-':>15}" for p in peers) + " "
        line += " ".join(f"{_ratio(ours, tools[p], 'process_s')} {_ratio(ours, tools[p], 'job_s')} "
                         f"{_ratio(ours, tools[p], 'peak_rss_mb')}" if ours and p in tools else f"{'-':>29}"
                         for p in peers)
        trls = [tools[p] for p in ("trl", "trl-unpacked") if p in tools]
        if ours and trls:
            fastest = min(trls, key=lambda r: r["process_s"])
            time_ratio = ours["process_s"] / fastest["process_s"]
            memory_ratio = ours["peak_rss_mb"] / fastest["peak_rss_mb"]
            met = time_ratio <= 0.5 and memory_ratio <= 1.0
            line += f"  {'met' if met else 'NOT met'} vs {fastest['tool']}"
        print(line)


def _ratio(ours: dict, peer: dict, key: str) -> str:
    return f"{ours[key] / peer[key]:>8.2f}x"


def _by_tool(job: dict) -> dict:
    return {r["tool"]: r for r in job["summary"] if "error" not in r}


def reprint(path: Path) -> None:
    try:
        saved = json.loads(path.read_text())
        jobs = saved.get("jobs", [saved]) if isinstance(saved, dict) else None
        keys = {"spec", "summary", "peaks", "load_average"} | ({"shape", "precision"} if "jobs" in saved else {"runs"})
        if not isinstance(jobs, list) or not all(isinstance(job, dict) and keys <= set(job) for job in jobs):
            raise ValueError("not a file that --out wrote")
    except (OSError, ValueError) as err:
        raise SystemExit(f"--table {path}: {err}") from None
    if "jobs" in saved:  # a --shapes sweep
        for job in saved["jobs"]:
            print_table(job["spec"], job["summary"], job["peaks"], job["load_average"])
        return print_shapes_table(saved["jobs"])
    rows = [summarise(runs, saved["peaks"]) for runs in saved["runs"].values() if all("error" not in r for r in runs)]
    print_table(saved["spec"], rows, saved["peaks"], saved["load_average"])


def child(spec_path: Path) -> None:
    from workbench.base.quiet import quiet_libraries

    quiet_libraries()
    from peers_tools import run_tool

    spec = json.loads(spec_path.read_text())
    result = run_tool(spec)
    (spec_path.parent / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
