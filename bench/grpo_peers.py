"""The same GRPO job with lora-workbench (`training.objective: grpo`) and TRL's GRPOTrainer, side by side.

    python bench/grpo_peers.py                                            # builtin:tiny, 6 steps x 2 repeats (~2 min)
    python bench/grpo_peers.py --model builtin:smollm2-135m --steps 4     # the CPU demo's model (~5 min idle;
                                                                          # 17 min on a 2-core machine at load 4)
    python bench/grpo_peers.py --generations 4 --completion-length 8 --repeats 2

The job is recipes/grpo-smollm2-cpu.yaml's, shortened: each step answers `--prompts` prompts of
recipes/data/grpo_arith_train.jsonl `--generations` (G) times, at most `--completion-length` tokens each, at
temperature 1.0 (top_p 1, top_k 0), scores the answers with `format` (the answer is a number alone) and
`exact_answer` (the right number), and takes one optimizer step on the dapo loss (beta 0, epsilon 0.2, advantages
scaled by the group's std): one generation batch per step, on-policy (the ratio is 1). The same model, LoRA
(r 16, alpha 32, dropout 0, all linear layers), learning rate (7e-4, constant, no warmup), AdamW without weight
decay, gradient clipping at 1.0, seed, precision and threads for both tools. Precision: what the workbench's
`auto` resolves to on this machine (bf16 weights with bf16 autocast where the CPU computes bf16 natively, else
float32), or `--precision`; TRL's GRPOConfig gets the same (`bf16` set explicitly: its default would turn bf16
autocast on even over float32 weights). Gradient checkpointing off for both (TRL's base config turns it on by
default; the workbench recipe does not).

TRL gets the prompts as conversations (its chat template path, as the workbench renders `format: prompts` rows),
`per_device_train_batch_size` = prompts x G completions, `gradient_accumulation_steps` 1 (so steps_per_generation
1 and no separate old-logp pass), `num_generations` G, and two plain Python reward functions named `format` and
`exact_answer` that score the answer text as the workbench's built-ins do (they call the same functions from
workbench/spec/rewards.py on the assistant message's text).

How each tool's step is timed:
  - workbench: `workbench.train(Recipe)` with `output.log_every: 1`; a step's wall time is its metrics.jsonl
    window (from the previous row to this one: fetching the step's prompts, the rollout, the loss forward and
    backward, clipping, the optimizer), read back as the window's tokens / `tokens_per_s`; generation's share is
    the row's `generation_share` (the time in `model.generate`, cutting at EOS included, over the window);
  - TRL: a TrainerCallback's clock from `on_step_begin` to `on_step_end` (the same span: generation, rewards,
    the loss forward and backward, clipping, the optimizer; the prompts are fetched just before on_step_begin,
    a few microseconds); generation: TRL's own `profiling_context(..., "transformers.generate")` block, timed by
    a wrapper around it.
The first step of each run is warm-up and left out; the table shows the median of the other steps (the best
over `--repeats` runs: other work on the machine only adds time). Tokens generated/s: the answers' tokens (up to
and including the first EOS, what both tools keep), from each tool's `completions/mean_length`, over the
generation seconds. Each tool runs in a process of its own, interleaved (A B A B) over the repeats.

The goal: the workbench's step at most 0.7x TRL's on the CPU demo; the last line says whether it holds.

First measurements (2 cores of an Intel Xeon with AMX, bf16, other jobs beside it): builtin:tiny, defaults, on
a quiet moment: workbench 0.137 s/step, TRL 0.155 (0.88x; generation 58% and 50% of the step). The same job at
load 3-4 took ~2 s/step for both (1.05x): contention inflates every figure, so read ratios only from runs whose
"machine CPU s meanwhile" is close to twice the process time or less. builtin:smollm2-135m, 4 steps, at load 4:
workbench 56.6 s/step, TRL 36.2 (1.56x; TRL's per-repeat medians 70.5 and 36.2): not a reliable ratio; rerun it
on an idle machine (`--wait-quiet`). Neither run meets 0.7x.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # peers.py sits beside this file

DATA = ROOT / "recipes" / "data" / "grpo_arith_train.jsonl"
FORMAT_PATTERN = r"^\s*-?\d+\s*\.?\s*$"  # recipes/grpo-smollm2-cpu.yaml's `format` reward
LORA = dict(r=16, alpha=32, dropout=0.0, target_modules="all-linear")
TOOLS = ("workbench", "trl")
GOAL = 0.7  # workbench step time <= GOAL x TRL's


# -- the parent: build the spec, run the tools interleaved, print the table ---------------------------------------


def job_spec(args) -> dict:
    from peers import job_precision, resolve_model

    return {"model_name": args.model, "model": resolve_model(args.model), "data": str(DATA), "steps": args.steps,
            "prompts": args.prompts, "generations": args.generations, "completion_length": args.completion_length,
            "temperature": args.temperature, "loss_type": args.loss_type, "beta": 0.0, "epsilon": 0.2,
            "lr": args.lr, "max_seq_len": 128, "seed": 42, "threads": args.threads, **LORA,
            **job_precision(args.threads, args.precision)}


def run_child(spec: dict, tool: str, work: Path, index: int) -> dict:
    from peers import machine_busy_s

    out = work / f"{tool}-{index}"
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps({**spec, "tool": tool, "out": str(out)}))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(spec["threads"])}
    busy, spawned = machine_busy_s(), time.time()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    result_path = out / "result.json"
    if done.returncode != 0 or not result_path.exists():
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"tool": tool, "error": tail, "stderr": done.stderr[-4000:]}
    result = json.loads(result_path.read_text())
    result["process_s"] = round(time.time() - spawned, 1)
    after = machine_busy_s()
    if busy is not None and after is not None:  # all CPU time the machine spent meanwhile, this run's included
        result["machine_cpu_s"] = round(after - busy, 1)
    return result


def summarise(step_s: list[float], gen_s: list[float | None], gen_tokens: list[float | None],
              completions: int) -> dict:
    """Medians over the steps after the first (warm-up); gen_tokens: each step's answer tokens."""
    timed = slice(1, None) if len(step_s) > 1 else slice(None)
    steps, gens, tokens = step_s[timed], gen_s[timed], gen_tokens[timed]
    shares = [g / s for g, s in zip(gens, steps) if g is not None and s > 0]
    measured = [(g, t) for g, t in zip(gens, tokens) if g is not None and t is not None]
    generation = sum(g for g, _ in measured)
    return {"median_step_s": statistics.median(steps), "steps_timed": len(steps),
            "gen_share": statistics.median(shares) if shares else None,
            "gen_tokens_per_s": sum(t for _, t in measured) / generation if generation > 0 else None,
            "median_gen_s": statistics.median([g for g in gens if g is not None]) if shares else None,
            "mean_completion_tokens": statistics.mean([t for t in tokens if t is not None]) / completions
            if any(t is not None for t in tokens) else None}


def print_table(spec: dict, runs: dict[str, list[dict]], loads: list[str]) -> None:
    import torch

    print(f"\nGRPO step time: {spec['model_name']}, {spec['steps']} steps of {spec['prompts']} prompts x "
          f"{spec['generations']} generations, max_completion_length {spec['completion_length']}, temperature "
          f"{spec['temperature']}, loss {spec['loss_type']}, beta {spec['beta']}, LoRA r {spec['r']} alpha "
          f"{spec['alpha']} ({spec['target_modules']}), rewards format + exact_answer")
    print(f"precision: {spec['model_dtype']} weights, mixed precision {spec['mixed_precision']} "
          f"({spec['precision_reason']}); {spec['threads']} threads; torch {torch.__version__}; "
          f"load average {loads[0]} -> {loads[-1]}")
    print(f"{'tool':10} {'median s/step':>13} {'gen share':>9} {'gen tokens/s':>12} {'gen s':>7} "
          f"{'answer tok':>10} {'steps':>5} {'per repeat (median s/step)':>27}")
    best = {}
    for tool, results in runs.items():
        good = [r for r in results if "error" not in r]
        if not good:
            print(f"{tool:10} failed: {results[0]['error']}")
            continue
        row = min(good, key=lambda r: r["summary"]["median_step_s"])
        best[tool] = row
        s = row["summary"]
        share = f"{100 * s['gen_share']:>8.1f}%" if s["gen_share"] is not None else f"{'n/a':>9}"
        rate = f"{s['gen_tokens_per_s']:>12.1f}" if s["gen_tokens_per_s"] else f"{'n/a':>12}"
        gen = f"{s['median_gen_s']:>7.3f}" if s["median_gen_s"] is not None else f"{'n/a':>7}"
        answer = f"{s['mean_completion_tokens']:>10.1f}" if s["mean_completion_tokens"] is not None else f"{'n/a':>10}"
        each = ", ".join(f"{r['summary']['median_step_s']:.3f}" for r in good)
        print(f"{tool:10} {s['median_step_s']:>13.3f} {share} {rate} {gen} {answer} {s['steps_timed']:>5} {each:>27}")
    print("(median over the steps after the first, best of the repeats; gen share = median of generation s / step s; "
          "gen tokens/s = answer tokens (up to and including EOS) / generation s; gen s = median generation seconds "
          "per step; answer tok = mean answer tokens per completion over the timed steps)")
    for tool, row in best.items():
        print(f"  {tool}: per-step s {row['step_s']}; generation s {row['gen_s']}; {row['settings']}; process "
              f"{row['process_s']} s" + (f", machine CPU s meanwhile {row['machine_cpu_s']}" if "machine_cpu_s" in row
                                        else ""))
    if "workbench" in best and "trl" in best:
        ratio = best["workbench"]["summary"]["median_step_s"] / best["trl"]["summary"]["median_step_s"]
        print(f"workbench/trl: step time {ratio:.2f}x; goal (<= {GOAL}x TRL's step time) "
              f"{'met' if ratio <= GOAL else 'NOT met'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny", help="builtin:tiny (default), builtin:smollm2-135m or a "
                        "model folder")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run; the first is warm-up")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (workbench micro_batch_size)")
    parser.add_argument("--generations", type=int, default=8, help="num_generations G")
    parser.add_argument("--completion-length", dest="completion_length", type=int, default=16,
                        help="max_completion_length")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--loss-type", dest="loss_type", default="dapo",
                        choices=["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
    parser.add_argument("--lr", type=float, default=7e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="both tools' precision: auto = what the workbench's auto resolves to on this CPU")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each tool, interleaved (default 2)")
    parser.add_argument("--wait-quiet", dest="wait_quiet", type=float, default=0, metavar="S",
                        help="before each run wait up to S seconds for the machine to be idle (shared machines)")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated, from workbench,trl")
    parser.add_argument("--out", help="also write every run's figures to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(Path(args.child))
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first step is warm-up)")
    tools = args.tools.split(",")
    if any(t not in TOOLS for t in tools):
        parser.error(f"--tools: from {', '.join(TOOLS)}")

    from peers import load_average, wait_for_quiet

    spec = job_spec(args)
    loads = [load_average()]
    runs = {tool: [] for tool in tools}
    with tempfile.TemporaryDirectory(prefix="grpo-peers-") as tmp:
        for repeat in range(args.repeats):
            for tool in tools:
                quiet = f", machine {wait_for_quiet(args.wait_quiet)}" if args.wait_quiet else ""
                print(f"repeat {repeat + 1}/{args.repeats}: {tool} ... (load {load_average()}{quiet})",
                      file=sys.stderr, flush=True)
                runs[tool].append(run_child(spec, tool, Path(tmp), repeat))
    loads.append(load_average())
    print_table(spec, runs, loads)
    if args.out:
        Path(args.out).write_text(json.dumps({"spec": spec, "runs": runs, "load_average": loads}, indent=2))
    failed = [r for results in runs.values() for r in results if "error" in r]
    for r in failed:
        print(f"\n{r['tool']} failed:\n{r['stderr']}", file=sys.stderr)
    if failed:
        raise SystemExit(1)


# -- the children: one tool, one run, in this process ---------------------------------------------------------------


def child(spec_path: Path) -> None:
    from workbench.base.quiet import quiet_libraries

    quiet_libraries()
    import torch

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    result = {"workbench": run_workbench, "trl": run_trl}[spec["tool"]](spec)
    result["summary"] = summarise(result["step_s"], result["gen_s"], result["gen_tokens"],
                                  spec["prompts"] * spec["generations"])
    (spec_path.parent / "result.json").write_text(json.dumps(result))


def workbench_recipe(spec: dict):
    from workbench import Recipe

    return Recipe.from_dict({
        "name": "grpo-peers-workbench",
        "model": {"path": spec["model"], "dtype": spec["model_dtype"], "attn": "auto"},
        "adapter": {"method": "lora", "r": spec["r"], "alpha": spec["alpha"], "dropout": spec["dropout"],
                    "target_modules": spec["target_modules"]},
        "data": {"train": spec["data"], "format": "prompts", "max_seq_len": spec["max_seq_len"], "packing": False},
        "training": {"objective": "grpo", "max_steps": spec["steps"], "micro_batch_size": spec["prompts"],
                     "grad_accum": 1, "lr": spec["lr"], "scheduler": "constant", "warmup_ratio": 0.0,
                     "weight_decay": 0.0, "max_grad_norm": 1.0, "gradient_checkpointing": False,
                     "mixed_precision": spec["mixed_precision"], "seed": spec["seed"], "threads": spec["threads"],
                     "grpo": {"num_generations": spec["generations"],
                              "max_completion_length": spec["completion_length"],
                              "temperature": spec["temperature"], "top_p": 1.0, "top_k": 0,
                              "loss_type": spec["loss_type"], "beta": spec["beta"], "epsilon": spec["epsilon"],
                              "scale_rewards": "group",
                              "rewards": [{"name": "format", "pattern": FORMAT_PATTERN}, "exact_answer"]}},
        "output": {"dir": str(Path(spec["out"]) / "{name}"), "save_every": None, "eval_every": None, "log_every": 1,
                   "sample_prompts": []},
    })


def run_workbench(spec: dict) -> dict:
    """workbench.train(Recipe); each step's time from its metrics.jsonl row (log_every 1)."""
    import workbench as wb

    recipe = workbench_recipe(spec)
    result = wb.train(recipe, overwrite=True, progress_bar=False)
    rows = [r for r in _jsonl(Path(result.run_dir) / "metrics.jsonl") if "tokens_per_s" in r and "step" in r]
    completions = spec["prompts"] * spec["generations"]
    step_s, gen_s, gen_tokens, rewards, previous = [], [], [], [], 0
    for row in rows:
        window = (row["tokens"] - previous) / row["tokens_per_s"]  # the row's window: its tokens / its tokens/s
        previous = row["tokens"]
        step_s.append(round(window, 4))
        share = row.get("generation_share")
        gen_s.append(round(share * window, 4) if share is not None else None)
        length = row.get("completions/mean_length")
        gen_tokens.append(length * completions if length is not None else None)
        rewards.append(row.get("reward"))
    summary = result.summary
    settings = (f"workbench.train, micro_batch_size {spec['prompts']} x grad_accum 1, training.fast_paths "
                f"{recipe.training.fast_paths}, fit_check {recipe.training.fit_check}, train_s {summary.get('train_s')}")
    return {"tool": "workbench", "step_s": step_s, "gen_s": gen_s, "gen_tokens": gen_tokens, "rewards": rewards,
            "settings": settings, "steps": len(rows)}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def answer_text(completion) -> str:
    """TRL hands conversational prompts' answers over as [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def trl_rewards() -> list:
    """Plain callables for TRL, scoring as the workbench's built-in `format` (the recipe's pattern) and
    `exact_answer` do; named so TRL logs rewards/format/mean and rewards/exact_answer/mean."""
    from workbench.spec.rewards import exact_answer, format_match

    def format_reward(completions, **_):
        return format_match([answer_text(c) for c in completions], FORMAT_PATTERN)

    def exact_answer_reward(completions, answer, **_):
        return exact_answer([answer_text(c) for c in completions], answer)

    format_reward.__name__, exact_answer_reward.__name__ = "format", "exact_answer"
    return [format_reward, exact_answer_reward]


def run_trl(spec: dict) -> dict:
    """GRPOTrainer.train(); each step timed by a callback (on_step_begin to on_step_end), generation by a wrapper
    around TRL's own profiling_context block of model.generate."""
    import datasets
    import torch
    import trl
    import trl.trainer.grpo_trainer as grpo_module
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    generation = []  # seconds of each model.generate block, in order

    own_profiling = grpo_module.profiling_context

    @contextlib.contextmanager
    def timed_profiling(trainer, name):
        started = time.perf_counter()
        with own_profiling(trainer, name):
            yield
        if name == "transformers.generate":
            generation.append((trainer.state.global_step, time.perf_counter() - started))

    grpo_module.profiling_context = timed_profiling

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self.started = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.started)

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train = datasets.Dataset.from_list(_jsonl(Path(spec["data"])))  # {"prompt": [user turn], "answer": "12"}
    completions = spec["prompts"] * spec["generations"]
    args = GRPOConfig(
        output_dir=str(Path(spec["out"]) / "trl"), per_device_train_batch_size=completions,
        gradient_accumulation_steps=1, num_generations=spec["generations"],
        max_completion_length=spec["completion_length"], temperature=spec["temperature"], top_p=1.0, top_k=0,
        loss_type=spec["loss_type"], beta=spec["beta"], epsilon=spec["epsilon"], scale_rewards="group",
        num_iterations=1, learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=spec["steps"], bf16=spec["mixed_precision"] == "bf16", fp16=False,
        gradient_checkpointing=False, use_cpu=True, logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", seed=spec["seed"], disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["model_dtype"]),
                                                 attn_implementation="sdpa")
    clock = StepClock()
    peft_config = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"],
                             target_modules=spec["target_modules"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=trl_rewards(), args=args, train_dataset=train,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[clock])
    trainer.train()
    logs = [r for r in trainer.state.log_history if "completions/mean_length" in r]
    gen_by_step = {}
    for step, seconds in generation:  # global_step when generating = the step's index (0-based)
        gen_by_step[step] = gen_by_step.get(step, 0.0) + seconds
    gen_s = [round(gen_by_step[i], 4) if i in gen_by_step else None for i in range(len(clock.times))]
    gen_tokens = [r["completions/mean_length"] * completions for r in logs]
    own = [r["step_time"] for r in logs[1:] if "step_time" in r]  # TRL's own: training_step only (no optimizer)
    settings = (f"GRPOTrainer (trl {trl.__version__}), per_device_train_batch_size {completions} x "
                f"gradient_accumulation_steps 1, optim {args.optim.value}, bf16={args.bf16}, "
                f"gradient_checkpointing={args.gradient_checkpointing}")
    if own:
        settings += f", TRL's own step_time metric (training_step, no optimizer) median {statistics.median(own):.3f} s"
    return {"tool": "trl", "step_s": [round(t, 4) for t in clock.times], "gen_s": gen_s, "gen_tokens": gen_tokens,
            "rewards": [r.get("reward") for r in logs], "settings": settings, "steps": len(clock.times)}


if __name__ == "__main__":
    main()
