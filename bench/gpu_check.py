"""The GPU story in one command: speed, memory and MFU of LoRA, QLoRA and checkpointing at 2,048 and 8,192 tokens,
each attention kernel, packed and unpacked, the estimator beside every measured peak, and the same job through
TRL's SFTTrainer and a plain loop, written to a JSON file and a Markdown table.

    python bench/gpu_check.py                      # one GPU: about 8 minutes on an H100/H200-class card
    python bench/gpu_check.py --dry-run            # any CPU: tiny shapes through every part (CI runs this)
    python bench/gpu_check.py --out results/ --budget-s 480 --steps 30

Needs torch with CUDA, transformers, peft, accelerate, bitsandbytes (QLoRA), datasets and trl (the peer rows);
flash-attn adds its row when installed. The model is the Llama-3-shaped 1.24B of bench/llama3_1b.py (128k
vocabulary, random weights, built on the spot: no download). Each configuration trains in its own process
(`workbench train`), so each peak is its own; tokens/s and MFU are the median of the logged windows after the
first (compilation and warm-up stay out), peak memory is torch.cuda.max_memory_allocated. Rows that would
overrun --budget-s are listed as skipped, so the whole check fits a lent machine's time.

Goals, checked in the output: MFU >= 40% of the bf16 data-sheet peak for 1B LoRA at 2,048 tokens; at least
1.5x TRL SFTTrainer's tokens/s at no more than its peak memory; the estimate within +-10% of every measured peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

MFU_GOAL, TRL_SPEED_GOAL, ESTIMATE_TOLERANCE = 0.40, 1.5, 0.10
QLORA = ["adapter.method=qlora", "quantization.bits=4"]


def cases(short: int, long: int) -> list[tuple[str, str, int, int, list[str]]]:
    """(part, name, max_seq_len, micro-batch, overrides): the same tokens per step at both lengths, in the order
    they run (what the goals need first: a lent machine's time may end before the last row)."""
    return [
        ("a", "lora", short, 2, []),
        ("a", "qlora-nf4", short, 2, QLORA),
        ("a", "lora+checkpointing", short, 2, ["training.gradient_checkpointing=true"]),
        ("d", "lora, compiled layers", short, 2, ["training.compile=true"]),
        ("a", "lora", long, 1, []),
        ("a", "qlora-nf4", long, 1, QLORA),
        ("a", "lora+checkpointing", long, 1, ["training.gradient_checkpointing=true"]),
        ("d", "lora, sdpa (dense mask)", short, 2, ["model.attn=sdpa"]),
        ("d", "lora, unpacked (padded)", short, 2, ["data.packing=false"]),
        ("d", "lora, flash-attn varlen", short, 2, ["model.attn=flash_attention_2"]),
    ]


def train_overrides(model_path: str, seq: int, batch: int, steps: int, data: tuple[Path, Path],
                    overrides: list[str]) -> list[str]:
    """recipes/quickstart.yaml's overrides for one row (the tests re-estimate the recorded rows with these)."""
    return [f"model.path={model_path}", f"data.train={data[0]}", f"data.eval={data[1]}", f"data.max_seq_len={seq}",
            "data.packing=true", f"training.max_steps={steps}", "training.epochs=1000",
            f"training.micro_batch_size={batch}", "training.grad_accum=1", "output.save_every=null",
            "output.eval_every=null", "output.log_every=5", "output.sample_prompts=[]", *overrides]


def environment() -> dict:
    import torch

    from workbench.model.attention import flash_attn_installed, flex_attention_available

    gpu = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if gpu else f"CPU ({platform.processor() or platform.machine()})",
            "torch": torch.__version__, "cuda": torch.version.cuda, "flash_attn": flash_attn_installed(),
            "flex_attention": flex_attention_available(), "python": platform.python_version()}


def why_not(overrides: list[str], device_kind: str) -> str | None:
    """The workbench's own refusal of a kernel this machine cannot train with (workbench/model/attention.py)."""
    from workbench import Recipe
    from workbench.model.attention import resolve
    from workbench.base.errors import RecipeError

    try:
        resolve(Recipe().override(*[o for o in overrides if o.startswith(("model.", "data.", "training."))]),
                device_kind)
    except RecipeError as err:
        return str(err)
    return None


def run_case(name: str, seq: int, batch: int, overrides: list[str], args, data: tuple[Path, Path], out: Path,
             timeout_s: float) -> dict:
    folder = out / "runs"
    run_name = "".join(c if c.isalnum() else "-" for c in f"{name}-{seq}").strip("-")
    command = [sys.executable, "-m", "workbench", "train", str(ROOT / "recipes/quickstart.yaml"), "--no-progress",
               "--overwrite", f"name={run_name}", f"output.dir={folder}/{{name}}",
               *train_overrides(args.model_path, seq, batch, args.steps, data, overrides)]
    started = time.perf_counter()
    row = {"name": name, "seq": seq, "micro_batch": batch, "overrides": overrides}
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ},
                              timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        return {**row, "wall_s": round(time.perf_counter() - started, 1),
                "skipped": f"stopped: ran past the time budget ({timeout_s:.0f} s left)"}
    row["wall_s"] = round(time.perf_counter() - started, 1)
    if done.returncode != 0:
        return {**row, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    summary = json.loads((folder / run_name / "run.json").read_text())["summary"]
    windows = [json.loads(line) for line in (folder / run_name / "metrics.jsonl").read_text().splitlines()]
    speeds = [w["tokens_per_s"] for w in windows if w.get("tokens_per_s")][1:]  # after the warm-up window
    steady = statistics.median(speeds) if speeds else summary["tokens_per_s"]
    peak, predicted = summary["peak_memory_mb"], summary.get("predicted_peak_memory_mb")
    return {**row, "tokens_per_s": round(steady, 1),
            "mfu": round(summary["mfu"] * steady / max(summary["tokens_per_s"], 1e-9), 4),
            "peak_mb": peak, "peak_kind": summary["peak_memory_kind"], "predicted_mb": predicted,
            "estimate_ratio": round(predicted / peak, 3) if predicted and peak else None,
            "attention": summary.get("attention"), "packed_rows": summary.get("attention_packed_rows"),
            "precision": f"{summary.get('model_dtype')} / {summary.get('mixed_precision')}",
            "final_loss": summary.get("final_loss")}


def run_peers(args, out: Path, timeout_s: float) -> dict:
    """bench/peers.py: the workbench, TRL's SFTTrainer and a plain loop on one job, interleaved."""
    result = out / "peers.json"
    # the goal compares the workbench with TRL: the plain loop and the baseline are left to bench/peers.py
    job = (["--quick", "--train-rows", "16", "--eval-rows", "4", "--threads", "1", "--probe-s", "0.1"]
           if args.dry_run else ["--job", "gpu-1b"]) + ["--tools", "workbench,trl"]
    started = time.perf_counter()
    if timeout_s < 1:
        return {"error": "not run: the time budget was spent"}
    try:
        done = subprocess.run([sys.executable, str(HERE / "peers.py"), *job, "--out", str(result)],
                              capture_output=True, text=True, cwd=ROOT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped: ran past the time budget ({timeout_s:.0f} s left)"}
    if done.returncode != 0 or not result.exists():
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1], "wall_s": time.perf_counter() - started}
    rows = {r["tool"]: r for r in json.loads(result.read_text())["summary"] if "error" not in r}
    return {"wall_s": round(time.perf_counter() - started, 1), "text": done.stdout,
            "rows": {tool: {k: r[k] for k in ("tokens_per_s", "peak_rss_mb", "eval_loss", "loop_s", "mfu_bf16")}
                     for tool, r in rows.items()}}


def goals(rows: list[dict], peers: dict, gpu: bool) -> list[dict]:
    """Each goal with what was measured and whether it was met (None: not measured in this run)."""
    lora = next((r for r in rows if r["name"] == "lora" and r.get("mfu") is not None), None)
    checked = []
    mfu = lora["mfu"] if lora else None
    checked.append({"goal": f"MFU >= {MFU_GOAL:.0%} (1B LoRA, {lora['seq'] if lora else '?'} tokens)",
                    "measured": f"{mfu:.1%}" if mfu is not None else "n/a", "met": mfu >= MFU_GOAL if mfu else None})
    ours, trl = peers.get("rows", {}).get("workbench"), peers.get("rows", {}).get("trl")
    if ours and trl:
        speed, memory = ours["tokens_per_s"] / trl["tokens_per_s"], ours["peak_rss_mb"] / trl["peak_rss_mb"]
        checked.append({"goal": f">= {TRL_SPEED_GOAL}x TRL SFTTrainer tokens/s at <= its peak memory",
                        "measured": f"{speed:.2f}x tokens/s, {memory:.2f}x peak",
                        "met": speed >= TRL_SPEED_GOAL and memory <= 1.0})
    else:
        checked.append({"goal": f">= {TRL_SPEED_GOAL}x TRL SFTTrainer tokens/s at <= its peak memory",
                        "measured": peers.get("error", "n/a"), "met": None})
    ratios = [r["estimate_ratio"] for r in rows if r.get("estimate_ratio")]
    worst = max(ratios, key=lambda x: abs(x - 1)) if ratios else None
    checked.append({"goal": f"estimate within +-{ESTIMATE_TOLERANCE:.0%} of every measured peak",
                    "measured": f"worst estimate/measured {worst:.2f} over {len(ratios)} runs" if worst else "n/a",
                    "met": abs(worst - 1) <= ESTIMATE_TOLERANCE if worst else None})
    if not gpu:  # a CPU dry run checks the script, not the goals (they are GPU figures)
        for goal in checked:
            goal["met"] = None
    return checked


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU check: {env['device']}", "",
             f"torch {env['torch']} (CUDA {env['cuda']}), flash-attn {'yes' if env['flash_attn'] else 'no'}, "
             f"FlexAttention {'yes' if env['flex_attention'] else 'no'}; model {report['model']}; "
             f"{report['steps']} steps per run{' (dry run: tiny shapes on a CPU)' if report['dry_run'] else ''}", "",
             "| part | configuration | seq | micro-batch | attention (packed rows) | tokens/s | MFU | peak MB "
             "| estimate MB | estimate / peak |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['part']} | {r['name']} | {r['seq']} | {r['micro_batch']} | "
                         f"{r.get('skipped') or 'failed: ' + r['error']} | | | | | |")
            continue
        lines.append(f"| {r['part']} | {r['name']} | {r['seq']} | {r['micro_batch']} | {r['attention']} "
                     f"({r['packed_rows']}) | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_mb']:,.0f} | "
                     f"{r['predicted_mb'] or 0:,.0f} | {r['estimate_ratio'] or 0:.2f} |")
    peers = report["peers"]
    lines += ["", "Peers, the same job (bench/peers.py, interleaved):", ""]
    if "rows" in peers:
        lines += ["| tool | tokens/s | peak MB | eval loss |", "|---|---|---|---|"]
        lines += [f"| {tool} | {r['tokens_per_s']:,.0f} | {r['peak_rss_mb']:,.0f} | {r['eval_loss']:.4f} |"
                  for tool, r in peers["rows"].items()]
    else:
        lines.append(f"not measured: {peers.get('error')}")
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {g['measured']} | {'—' if g['met'] is None else 'yes' if g['met'] else 'NO'} |"
              for g in report["goals"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on a CPU: every part, in a minute or two")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for gpu_check.json/.md")
    parser.add_argument("--steps", type=int, help="optimizer steps per configuration (default 30; dry run 4)")
    parser.add_argument("--budget-s", type=float, help="skip what would run past this many seconds (default 480; "
                        "dry run 1800)")
    parser.add_argument("--no-peers", action="store_true", help="leave out the TRL / plain-loop comparison")
    args = parser.parse_args(argv)
    args.budget_s = args.budget_s if args.budget_s is not None else (1800 if args.dry_run else 480)
    if args.budget_s <= 0 or (args.steps is not None and args.steps < 1):
        parser.error("--budget-s must be positive and --steps at least 1")
    import torch

    gpu = torch.cuda.is_available()
    if not gpu and not args.dry_run:
        parser.error("no CUDA GPU here: run with --dry-run for the CPU check of the script itself")
    args.steps = args.steps or (4 if args.dry_run else 30)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    from peers_data import write_data

    if args.dry_run:
        from workbench.base.builtin import resolve_builtin

        args.model_path, model, (short, long) = str(resolve_builtin("builtin:tiny")), "builtin:tiny", (64, 128)
        data = write_data(out / "data", 48, 4)
    else:
        import llama3_1b

        args.model_path, model, (short, long) = str(llama3_1b.path()), "bench:llama3-1b (1.24B)", (2048, 8192)
        data = write_data(out / "data", 4000, 8)
    device_kind = "cuda" if gpu else "cpu"
    rows, spent = [], []
    peers_s = 0 if args.no_peers else (60 if args.dry_run else 180)  # kept for the peers at the end
    for part, name, seq, batch, overrides in cases(short, long):
        row = {"part": part, "name": name, "seq": seq, "micro_batch": batch, "overrides": overrides}
        reason = why_not(overrides, device_kind)
        if reason is None and args.dry_run and (seq == long or "training.compile=true" in overrides):
            reason = "dry run: the same code path as a row above (compiling is minutes of CPU; tests cover it)"
        if reason is None and "adapter.method=qlora" in overrides and not _bitsandbytes():
            reason = "bitsandbytes is not installed"
        elapsed = time.perf_counter() - started
        typical = statistics.median(spent) if spent else 0
        if reason is None and elapsed + typical + peers_s > args.budget_s:
            reason = f"time budget: --budget-s {args.budget_s:.0f} reached"
        if reason:
            rows.append({**row, "skipped": f"skipped: {reason}"})
        else:
            result = run_case(name, seq, batch, overrides, args, data, out,
                              args.budget_s - peers_s - (time.perf_counter() - started))
            spent.append(result["wall_s"])  # (a row stopped by the budget counts its time too)
            rows.append({"part": part, **result})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    peers = ({"error": "left out (--no-peers)"} if args.no_peers
             else run_peers(args, out, args.budget_s - (time.perf_counter() - started)))
    report = {"environment": environment(), "model": model, "steps": args.steps, "dry_run": args.dry_run,
              "rows": rows, "peers": {k: v for k, v in peers.items() if k != "text"},
              "wall_s": round(time.perf_counter() - started, 1)}
    report["goals"] = goals(rows, peers, gpu)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (out / "gpu_check.md").write_text(text)
    print(text)
    print(f"written: {out / 'gpu_check.json'}, {out / 'gpu_check.md'} ({report['wall_s']:.0f} s)")
    failed = [r for r in rows if "error" in r]
    return 1 if failed else 0


def _bitsandbytes() -> bool:
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None


if __name__ == "__main__":
    raise SystemExit(main())
