"""Adapter methods and memory savers side by side: peak memory and tokens/s as ratios to plain LoRA.

    python bench/methods.py                         # SmolLM2-135M, precision auto, CPU (about 6 minutes)
    python bench/methods.py --model builtin:tiny --steps 3 --only lora,qlora   # a quick smoke run
    python bench/methods.py --model bench:llama3-1b --steps 2 --batch 1 --seq 512 --only lora,qlora-nf4,qlora-nf4-upcast
                                                    # a Llama-3-shaped 1.24B model (bench/llama3_1b.py)

Each configuration trains in its own process (peak RSS is a per-process high-water mark) on the same
recipe, data and number of steps; the figures come from each run's run.json. Precision is the recipe's
`auto`, resolved for this machine (bf16 where the CPU computes it natively, else float32) and printed in
the header, so the figures are reproducible on either kind of CPU. Each row also shows the estimator's
prediction for that run (`predicted_peak_memory_mb` in its run.json) and its ratio to the measured peak.
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

CONFIGS = {
    "lora": [],
    "lora+checkpointing": ["training.gradient_checkpointing=true"],
    "lora+adamw_8bit": ["training.optimizer=adamw_8bit"],
    "rslora": ["adapter.rslora=true"],
    "dora": ["adapter.method=dora"],
    # how the adapter starts (workbench/spec/adapter_init.py) and LoRA+: same recipe, same steps
    "init-gaussian": ["adapter.init=gaussian"],
    "init-pissa": ["adapter.init=pissa"],
    "init-olora": ["adapter.init=olora"],
    "init-eva": ["adapter.init=eva"],
    "init-corda": ["adapter.init=corda"],
    "lora-plus-16": ["adapter.lora_plus_ratio=16"],
    "qlora-nf4": ["adapter.method=qlora", "quantization.bits=4"],
    # peft's k-bit preparation: embeddings, head and norms in float32 (the default keeps the model dtype)
    "qlora-nf4-upcast": ["adapter.method=qlora", "quantization.bits=4", "quantization.upcast_frozen=true"],
    "qlora-int8": ["adapter.method=qlora", "quantization.bits=8"],
    "full": ["adapter.method=full", "training.lr=1e-5"],
    "full+adamw_8bit": ["adapter.method=full", "training.lr=1e-5", "training.optimizer=adamw_8bit"],
}


def model_path(model: str) -> str:
    """builtin:... and hub names as they are; bench:llama3-1b is built here (bench/llama3_1b.py)."""
    if model == "bench:llama3-1b":
        sys.path.insert(0, str(Path(__file__).parent))
        import llama3_1b

        return str(llama3_1b.path())
    return model


def run_config(name: str, overrides: list[str], args, out: Path) -> dict:
    command = [sys.executable, "-m", "workbench", "train", str(ROOT / "recipes/quickstart.yaml"), "--no-progress",
               f"name={name.replace('+', '-')}", f"output.dir={out}/{{name}}", f"model.path={model_path(args.model)}",
               f"training.max_steps={args.steps}", "training.epochs=100", "output.save_every=null",
               "output.eval_every=null", "output.sample_prompts=[]", f"training.micro_batch_size={args.batch}",
               f"data.max_seq_len={args.seq}", f"training.threads={args.threads}", "output.log_every=1", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ})
    if done.returncode != 0:
        return {"name": name, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    run = out / name.replace("+", "-")
    summary = json.loads((run / "run.json").read_text())["summary"]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first_loss = next((row["loss"] for row in logged if "loss" in row), None)
    return {"name": name, "peak_memory_mb": summary["peak_memory_mb"], "tokens_per_s": summary["tokens_per_s"],
            "startup_s": summary.get("startup_s"), "first_loss": first_loss,
            "predicted_peak_memory_mb": summary.get("predicted_peak_memory_mb"),
            "trainable_params": summary["trainable_params"], "final_loss": summary["final_loss"],
            "precision": f"{summary['model_dtype']} weights, mixed_precision {summary['mixed_precision']}",
            "precision_reason": summary["precision_reason"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", help="comma-separated configuration names (default: all)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")

    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for name in names:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            rows.append(run_config(name, CONFIGS[name], args, Path(tmp)))

    base = next((r for r in rows if r["name"] == "lora" and "error" not in r), None)
    precision = f"{base['precision']} ({base['precision_reason']})" if base else "see each run"
    print(f"\n{args.model}, {args.steps} steps x {args.batch} x {args.seq} tokens, {args.threads} threads, {precision}")
    print(f"{'configuration':20} {'trainable':>12} {'peak MB':>9} {'x lora':>7} {'tokens/s':>9} {'x lora':>7} "
          f"{'predicted MB':>12} {'pred/meas':>9} {'start-up s':>10} {'loss first -> last':>19}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:20} failed: {r['error']}")
            continue
        mem = f"{r['peak_memory_mb'] / base['peak_memory_mb']:.2f}" if base else "-"
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        predicted = r.get("predicted_peak_memory_mb")
        against = f"{predicted / r['peak_memory_mb']:.2f}" if predicted else "-"
        startup = f"{r['startup_s']:.1f}" if r.get("startup_s") is not None else "-"
        losses = f"{r['first_loss']:.3f} -> {r['final_loss']:.3f}" if r.get("first_loss") is not None else "-"
        print(f"{r['name']:20} {r['trainable_params']:>12,} {r['peak_memory_mb']:>9.0f} {mem:>7} "
              f"{r['tokens_per_s']:>9.0f} {speed:>7} {predicted or 0:>12.0f} {against:>9} {startup:>10} {losses:>19}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if any("error" in r for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
