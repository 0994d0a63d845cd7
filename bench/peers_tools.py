"""One tool, one job, in this process: lora-workbench, TRL's SFTTrainer or DPOTrainer, or a plain PyTorch + peft loop.

`python bench/peers.py` starts each tool in a process of its own (peak RSS is a per-process high-water mark)
through `run_tool(spec)`, which returns what every tool reports the same way: the job's wall time (load,
prepare, one epoch, save), the training loop's time, real tokens, peak RSS when training ended, model FLOPs
and the eval loss on the held-out rows, computed by one shared function for all tools (for the DPO job: the
DPO loss and reward accuracy of the held-out pairs against the base model, `eval_dpo`, plus each tool's own
final train loss from its own per-step log).
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.data.tokens import IGNORE
from workbench.hardware.current import peak_rss_bytes

# What each tool is given beyond the job itself, printed with the results.
SETTINGS = {
    "workbench": "packing: true (best-fit), {packs} packs of {seq} per step",
    "trl": "SFTTrainer, packing={packing} (bfd, padding-free when true), per_device_train_batch_size={batch}, "
           "gradient_checkpointing={gradient_checkpointing}, train_sampling_strategy={train_sampling_strategy}, "
           "prompt-completion rows (completion-only loss), fused LM head (TRL's default)",
    "plain": "greedy packing, position_ids restart per sample (block-diagonal attention), {packs} packs per step, "
             "full logits + F.cross_entropy",
    "workbench-dpo": "objective: dpo, beta {beta}, reference = the base with the adapter off, {batching}",
    "trl-dpo": "DPOTrainer, per_device_train_batch_size={micro} x gradient_accumulation_steps={accumulate} = {batch} "
               "pairs per step (chosen and rejected padded into one batch), "
               "gradient_checkpointing={gradient_checkpointing}, precompute_ref_log_probs={precompute_ref_log_probs}, "
               "train_sampling_strategy={train_sampling_strategy}, padding_free=False (unavailable in TRL {version}), "
               "reference = the base with the adapter off (peft), fused LM head (TRL's default), "
               "disable_dropout=True (TRL's default)",
}


def peak_rss_mb() -> float:
    return peak_rss_bytes() / 2**20


def peak_memory(spec: dict) -> float:
    """MB: the process's peak RSS on a CPU; on a GPU, max_memory_allocated (what the workbench records there)."""
    return torch.cuda.max_memory_allocated() / 2**20 if spec.get("device") == "cuda" else peak_rss_mb()


def prompt_completion(row: dict) -> dict:
    """A chat row as TRL's prompt-completion layout (its documented way to learn only the answer)."""
    messages = row["messages"]
    return {"prompt": messages[:-1], "completion": messages[-1:]}


def read_rows(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def lora_config(spec: dict):
    from peft import LoraConfig

    return LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"],
                      target_modules=spec["target_modules"], task_type="CAUSAL_LM")


def load_model(spec: dict):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["model_dtype"]),
                                                attn_implementation="sdpa").to(spec.get("device", "cpu"))


def autocast(spec: dict):
    """The job's autocast (bf16 where this CPU computes it natively), or none: every tool runs the same precision."""
    return torch.autocast(spec.get("device", "cpu"), dtype=torch.bfloat16, enabled=spec["mixed_precision"] == "bf16")


def load_tokenizer(spec: dict):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# -- shared measurement ----------------------------------------------------------------------


def model_flops(model, lengths: list[int]) -> float:
    """Model FLOPs of one epoch over samples of these lengths, counted the way the workbench counts them."""
    from workbench.base.metrics import FlopCounter

    counter = FlopCounter(model, model.config)
    attended = sum(n * (n + 1) // 2 for n in lengths)
    return counter.step_flops(sum(lengths), attended)


def reference_samples(spec: dict, rows: list[dict], tokenizer) -> list[dict]:
    """Rows tokenized one way for every tool (the workbench's: chat template, loss on the answers)."""
    from workbench.data.tokens import tokenize_row
    from workbench.spec.recipe import DataSection

    cfg = DataSection(train="unused", format="chat", max_seq_len=spec["max_seq_len"], train_on="completions")
    return [tokenize_row(row, tokenizer, cfg, f"row {i}") for i, row in enumerate(rows)]


@torch.no_grad()
def eval_loss(model, samples: list[dict], spec: dict) -> float:
    """Mean next-token loss over every answer token of the held-out rows, one row at a time (no padding)."""
    model.eval()
    total, targets = 0.0, 0
    for sample in samples:
        ids = torch.tensor([sample["input_ids"]], device=model.device)
        labels = torch.tensor(sample["labels"][1:], device=model.device)
        with autocast(spec):
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        total += float(F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum"))
        targets += int((labels != IGNORE).sum())
    return total / max(targets, 1)


def stop_clock(started: float, spec: dict) -> dict:
    """Read when the job is done (adapter saved), before the shared evaluation adds time or memory."""
    return {"job_s": round(time.perf_counter() - started, 2), "peak_rss_mb": round(peak_memory(spec), 1),
            "ended_at": time.time()}


def finish(spec: dict, tool: str, clock: dict, loop_s: float, tokens: int, steps: int, model, lengths: list[int],
           settings: str) -> dict:
    """What every tool reports, the eval loss computed the same way for all."""
    tokenizer = load_tokenizer(spec)
    loss = eval_loss(model, reference_samples(spec, read_rows(spec["eval"]), tokenizer), spec)
    return {"tool": tool, "settings": settings, **clock, "loop_s": round(loop_s, 2), "tokens": tokens,
            "steps": steps, "flops": model_flops(model, lengths), "eval_loss": round(loss, 5),
            "threads": torch.get_num_threads()}


# -- (a) lora-workbench: the real path, workbench.train(Recipe) --------------------------------------


def workbench_recipe(spec: dict):
    from workbench import Recipe

    dpo = spec.get("objective") == "dpo"
    packing = spec.get("wb_packing", True) if dpo else True
    # DPO unpacked: micro-batches of `micro_batch` pairs, accumulated to exactly the job's pairs per step
    micro_batch = spec["packs_per_step"] if packing else spec.get("micro_batch", spec["batch"])
    accumulate = 1 if packing or not dpo else spec["batch"] // micro_batch
    objective = {"objective": "dpo", "dpo_beta": spec["beta"]} if dpo else {}
    return Recipe.from_dict({
        "name": "peers-workbench",
        "model": {"path": spec["model"], "dtype": spec["model_dtype"], "attn": "auto"},
        "adapter": {"method": "lora", "r": spec["r"], "alpha": spec["alpha"], "dropout": spec["dropout"],
                    "target_modules": spec["target_modules"]},
        "data": {"train": spec["train"], "format": "preference" if dpo else "chat", "max_seq_len": spec["max_seq_len"],
                 "packing": packing, "train_on": "completions"},
        "training": {"epochs": 1, "micro_batch_size": micro_batch, "grad_accum": accumulate, "lr": spec["lr"],
                     "scheduler": "cosine", "warmup_ratio": spec["warmup_ratio"], "max_grad_norm": 1.0,
                     "mixed_precision": spec["mixed_precision"], "seed": spec["seed"], "threads": spec["threads"],
                     **objective, **spec.get("workbench_training", {})},
        # DPO: a row per step, so each tool's final train loss is read from its own log the same way
        "output": {"dir": str(Path(spec["out"]) / "{name}"), "save_every": None, "eval_every": None,
                   "log_every": 1 if dpo else 10, "sample_prompts": []},
    })


def train_workbench(spec: dict):
    """The workbench's run of the job: (the recipe it ran, its TrainResult, the job's clock)."""
    import workbench as wb

    started = time.perf_counter()
    recipe = workbench_recipe(spec)
    if spec["tool"] == "workbench-baseline":  # the loop on the libraries' own paths: what the fast paths are worth
        recipe = recipe.override("training.fast_paths=false")
    result = wb.train(recipe, overwrite=True, progress_bar=False)
    return recipe, result, stop_clock(started, spec)


def run_workbench(spec: dict) -> dict:
    from peft import PeftModel

    if spec.get("objective") == "dpo":
        return run_workbench_dpo(spec)
    baseline = spec["tool"] == "workbench-baseline"
    _, result, clock = train_workbench(spec)
    summary = result.summary
    model = PeftModel.from_pretrained(load_model(spec), str(result.run_dir / "adapter"))
    tokenizer = load_tokenizer(spec)
    lengths = [len(s["input_ids"]) for s in reference_samples(spec, read_rows(spec["train"]), tokenizer)]
    settings = SETTINGS["workbench"].format(packs=spec["packs_per_step"], seq=spec["max_seq_len"])
    if spec.get("workbench_training"):
        settings += f", {spec['workbench_training']}"
    settings += ", training.fast_paths=false" if baseline else ", training.fast_paths=true (the default)"
    report = finish(spec, spec["tool"], clock, summary["train_s"], summary["tokens"], summary["steps"], model,
                    lengths, settings)
    report["own_mfu"] = summary["mfu"]
    report["startup_s"], report["finish_s"] = summary.get("startup_s"), summary.get("finish_s")
    report["floor_mb"] = summary.get("startup_peak_memory_mb")
    return report


# -- (b) TRL's SFTTrainer with peft ---------------------------------------------------------------


def run_trl(spec: dict) -> dict:
    import datasets
    from trl import SFTConfig, SFTTrainer

    if spec.get("objective") == "dpo":
        return run_trl_dpo(spec)
    started = time.perf_counter()
    tokenizer = load_tokenizer(spec)
    train = datasets.Dataset.from_list([prompt_completion(r) for r in read_rows(spec["train"])])
    trl_opts = {"gradient_checkpointing": False, "train_sampling_strategy": "random", "packing": False,
                **spec.get("trl", {})}
    if spec["tool"] == "trl-unpacked":
        trl_opts["packing"] = False
    # packed, a sequence holds several samples: as many sequences per step as the other packing tool
    batch = spec["packs_per_step"] if trl_opts["packing"] else spec["batch"]
    args = SFTConfig(
        output_dir=str(Path(spec["out"]) / "trl"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_train_epochs=1, learning_rate=spec["lr"], lr_scheduler_type="cosine",
        warmup_steps=spec["warmup_ratio"], weight_decay=0.0, max_grad_norm=1.0, max_length=spec["max_seq_len"],
        bf16=spec["mixed_precision"] == "bf16", use_cpu=spec.get("device", "cpu") == "cpu", logging_steps=10, save_strategy="no", eval_strategy="no",
        report_to="none", seed=spec["seed"], disable_tqdm=True, dataloader_num_workers=0, **trl_opts,
    )
    floor = FloorAtTrainBegin(spec)
    trainer = SFTTrainer(model=load_model(spec), args=args, train_dataset=train, processing_class=tokenizer,
                         peft_config=lora_config(spec), callbacks=[floor])
    lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    output = trainer.train()
    trainer.save_model()
    clock = stop_clock(started, spec)
    settings = SETTINGS["trl"].format(**trl_opts, batch=batch)
    return {**finish(spec, spec["tool"], clock, output.metrics["train_runtime"], sum(lengths), output.global_step,
                     trainer.model, lengths, settings), "floor_mb": floor.mb}


def FloorAtTrainBegin(spec: dict):
    """A trainer callback that reads the peak memory as the training loop begins (model, data, optimizer in place)."""
    from transformers import TrainerCallback

    class Floor(TrainerCallback):
        mb = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.mb = round(peak_memory(spec), 1)

    return Floor()


# -- (c) a plain PyTorch + peft loop ----------------------------------------------------------------


def plain_samples(rows: list[dict], tokenizer, max_len: int) -> list[dict]:
    """Chat template; loss on the answer tokens only; truncated to max_len."""
    samples = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        full = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
        labels = [IGNORE] * len(prompt) + full[len(prompt):]
        samples.append({"input_ids": full[:max_len], "labels": labels[:max_len]})
    return samples


def greedy_packs(samples: list[dict], max_len: int, seed: int) -> list[dict]:
    """Shuffle, then fill each pack in order until the next sample does not fit."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    packs, current = [], {"input_ids": [], "labels": [], "position_ids": []}
    for i in order:
        s = samples[i]
        if current["input_ids"] and len(current["input_ids"]) + len(s["input_ids"]) > max_len:
            packs.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        current["input_ids"] += s["input_ids"]
        current["labels"] += [IGNORE] + s["labels"][1:]  # no target crosses into the next sample
        current["position_ids"] += list(range(len(s["input_ids"])))
    packs.append(current)
    return packs


def plain_batch(packs: list[dict], pad_id: int) -> dict:
    width = max(len(p["input_ids"]) for p in packs)
    batch = {"input_ids": torch.full((len(packs), width), pad_id), "labels": torch.full((len(packs), width), IGNORE),
             "position_ids": torch.zeros((len(packs), width), dtype=torch.long)}
    for row, p in enumerate(packs):
        n = len(p["input_ids"])
        batch["input_ids"][row, :n] = torch.tensor(p["input_ids"])
        batch["labels"][row, :n] = torch.tensor(p["labels"])
        batch["position_ids"][row, :n] = torch.tensor(p["position_ids"])
        batch["position_ids"][row, n:] = torch.arange(width - n)  # padding: a sample of its own
    return batch


def run_plain(spec: dict) -> dict:
    from peft import get_peft_model
    from transformers import get_cosine_schedule_with_warmup

    started = time.perf_counter()
    torch.manual_seed(spec["seed"])
    tokenizer = load_tokenizer(spec)
    samples = plain_samples(read_rows(spec["train"]), tokenizer, spec["max_seq_len"])
    packs = greedy_packs(samples, spec["max_seq_len"], spec["seed"])
    model = get_peft_model(load_model(spec), lora_config(spec))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.0,
                                  **({"fused": True} if spec.get("device") == "cuda" else {"foreach": True}))
    size = spec["packs_per_step"]
    steps = math.ceil(len(packs) / size)
    scheduler = get_cosine_schedule_with_warmup(optimizer, round(spec["warmup_ratio"] * steps), steps)
    model.train()
    floor = round(peak_memory(spec), 1)
    loop_start = time.perf_counter()
    for step in range(steps):
        batch = {k: v.to(model.device, non_blocking=True)
                 for k, v in plain_batch(packs[step * size:(step + 1) * size], tokenizer.pad_token_id).items()}
        with autocast(spec):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        shifted = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), shifted.flatten(), ignore_index=IGNORE,
                               reduction="sum") / (shifted != IGNORE).sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    loop_s = time.perf_counter() - loop_start
    model.save_pretrained(str(Path(spec["out"]) / "plain-adapter"))
    clock = stop_clock(started, spec)
    lengths = [len(s["input_ids"]) for s in samples]
    settings = SETTINGS["plain"].format(packs=size)
    return {**finish(spec, "plain", clock, loop_s, sum(lengths), steps, model, lengths, settings), "floor_mb": floor}



# -- the DPO job: workbench (objective: dpo) and TRL's DPOTrainer ------------------------------------


def conversational_pair(row: dict) -> dict:
    """A {"prompt", "chosen", "rejected"} text row in TRL's conversational preference layout, so its chat template
    renders the pair as the workbench's does (a user turn, then the assistant's answer)."""
    return {"prompt": [{"role": "user", "content": row["prompt"]}],
            "chosen": [{"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "assistant", "content": row["rejected"]}]}


def reference_pairs(spec: dict, rows: list[dict], tokenizer, share_prompts: bool = False) -> list[dict]:
    """Pairs tokenized one way for every tool (the workbench's: chat template, loss on the answers, each sequence
    truncated to max_seq_len): one example per pair, chosen then rejected, positions restarting at the second
    (share_prompts: the rejected answer continuing the prompt, as the workbench trains on a CPU)."""
    from workbench.data.tokens import tokenize_row
    from workbench.spec.recipe import DataSection

    cfg = DataSection(train="unused", format="preference", max_seq_len=spec["max_seq_len"], train_on="completions")
    return [tokenize_row(row, tokenizer, cfg, f"row {i}", share_prompts) for i, row in enumerate(rows)]


def pair_lengths(pairs: list[dict]) -> list[int]:
    """The lengths of the sequences the pairs hold (two each): what the FLOPs are counted over."""
    lengths = []
    for pair in pairs:
        second = pair["position_ids"].index(0, 1)
        lengths += [second, len(pair["input_ids"]) - second]
    return lengths


def sequence_logps(model, pair: dict) -> torch.Tensor:
    """[chosen, rejected]: each answer's summed token log-probability, both sequences in one forward (positions
    restart at the second, so it attends only to itself)."""
    ids = torch.tensor([pair["input_ids"]], device=model.device)
    positions = torch.tensor(pair["position_ids"], device=model.device)
    logits = model(input_ids=ids, position_ids=positions[None], use_cache=False).logits[0, :-1].float()
    labels = torch.tensor(pair["labels"][1:], device=model.device)
    keep = (labels != IGNORE) & (positions[1:] == positions[:-1] + 1)  # no target crosses into the next sequence
    token_logps = logits.log_softmax(-1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * keep
    sample = (positions[1:] == 0).long().cumsum(0)  # 0: chosen, 1: rejected
    return torch.zeros(2, device=model.device).index_add(0, sample, token_logps)


@torch.no_grad()
def eval_dpo(model, pairs: list[dict], spec: dict) -> dict:
    """The DPO loss (sigmoid, beta of the job), reward margin and reward accuracy of the held-out pairs, one pair at
    a time (no padding); the reference is the same peft model with its adapter off, as both tools train against."""
    model.eval()
    beta = spec["beta"]
    losses, margins, correct = [], [], 0
    for pair in pairs:
        with autocast(spec):
            policy = sequence_logps(model, pair)
            with model.disable_adapter():
                reference = sequence_logps(model, pair)
        chosen, rejected = beta * (policy - reference)
        margin = float(chosen - rejected)
        losses.append(float(-F.logsigmoid(torch.tensor(margin))))
        margins.append(margin)
        correct += chosen > rejected
    count = max(len(pairs), 1)
    return {"eval_loss": round(sum(losses) / count, 5), "eval_reward_accuracy": round(float(correct) / count, 4),
            "eval_reward_margin": round(sum(margins) / count, 5)}


def last_steps_mean(losses: list[float], last: int = 10) -> float | None:
    """A tool's final train loss: the mean of its last `last` per-step losses (one step is too noisy)."""
    tail = [x for x in losses if x is not None][-last:]
    return round(sum(tail) / len(tail), 5) if tail else None


def finish_dpo(spec: dict, tool: str, clock: dict, loop_s: float, tokens: int, steps: int, pairs: int, model,
               lengths: list[int], settings: str, step_losses: list[float], reference_in_loop: bool = True,
               computed: tuple[int, int] | None = None) -> dict:
    """What both tools report for the DPO job, the held-out figures computed the same way for both. FLOPs (for
    MFU): over the two whole sequences of each pair, or `computed` (tokens, attended positions) where a tool
    computes fewer (the workbench's shared prompts)."""
    from workbench.base.metrics import FlopCounter

    tokenizer = load_tokenizer(spec)
    held_out = [p for p in reference_pairs(spec, read_rows(spec["eval"]), tokenizer) if p["targets"]]  # scorable
    figures = eval_dpo(model, held_out, spec)
    counter = FlopCounter(model, model.config)
    computed = computed or (sum(lengths), sum(n * (n + 1) // 2 for n in lengths))
    flops = counter.step_flops(*computed, extra_forwards=int(reference_in_loop))
    return {"tool": tool, "settings": settings, **clock, "loop_s": round(loop_s, 2), "tokens": tokens,
            "steps": steps, "pairs": pairs, "flops": flops, **figures,
            "train_loss": last_steps_mean(step_losses), "threads": torch.get_num_threads()}


def run_workbench_dpo(spec: dict) -> dict:
    from peft import PeftModel

    baseline = spec["tool"] == "workbench-baseline"
    recipe, result, clock = train_workbench(spec)
    summary = result.summary
    rows = read_rows(str(Path(result.run_dir) / "metrics.jsonl"))
    step_losses = [r["loss"] for r in rows if "loss" in r and "eval_loss" not in r]
    model = PeftModel.from_pretrained(load_model(spec), str(Path(result.run_dir) / "adapter"))
    tokenizer = load_tokenizer(spec)
    lengths = pair_lengths([p for p in reference_pairs(spec, read_rows(spec["train"]), tokenizer) if p["targets"]])
    computed = None
    if summary.get("shared_prompts"):  # what the loop computed: each pair's prompt once
        shared = [p for p in reference_pairs(spec, read_rows(spec["train"]), tokenizer, True) if p["targets"]]
        computed = (sum(len(p["input_ids"]) for p in shared), sum(q + 1 for p in shared for q in p["position_ids"]))
    packing = recipe.data.packing
    batching = (f"packing: true (best-fit, a pair stays whole), {spec['packs_per_step']} packs of 2 x "
                f"{spec['max_seq_len']} per step" if packing else
                f"packing: false, micro_batch_size={recipe.training.micro_batch_size} x grad_accum="
                f"{recipe.training.grad_accum} = {spec['batch']} pairs per step (a pair is one row: chosen then rejected, "
                "each attending to its own sequence only)")
    settings = SETTINGS["workbench-dpo"].format(beta=spec["beta"], batching=batching)
    if spec.get("workbench_training"):
        settings += f", {spec['workbench_training']}"
    settings += ", training.fast_paths=false" if baseline else ", training.fast_paths=true (the default)"
    if computed:
        settings += f" (each pair's prompt computed once: {computed[0]} of {sum(lengths)} tokens)"
    pairs = summary["train_samples"] - summary.get("train_empty", 0)
    # tokens: the pairs' whole sequences, as for TRL (the loop itself computed `computed[0]` of them)
    report = finish_dpo(spec, spec["tool"], clock, summary["train_s"], sum(lengths), summary["steps"], pairs,
                        model, lengths, settings, step_losses, computed=computed)
    report["own_mfu"] = summary["mfu"]
    report["startup_s"], report["finish_s"] = summary.get("startup_s"), summary.get("finish_s")
    report["floor_mb"] = summary.get("startup_peak_memory_mb")
    return report


def trl_dpo_options(spec: dict) -> dict:
    """TRL's settings for the job beyond what every tool shares: its fastest documented ones here by default
    (measured; see bench/peers.py), overridable from the command line."""
    return {"gradient_checkpointing": False, "precompute_ref_log_probs": False, "train_sampling_strategy": "random",
            **{k: v for k, v in spec.get("trl", {}).items()
               if k in ("gradient_checkpointing", "precompute_ref_log_probs", "train_sampling_strategy")}}


def run_trl_dpo(spec: dict) -> dict:
    import datasets
    import trl
    from trl import DPOConfig, DPOTrainer

    started = time.perf_counter()
    tokenizer = load_tokenizer(spec)
    train = datasets.Dataset.from_list([conversational_pair(r) for r in read_rows(spec["train"])])
    opts = trl_dpo_options(spec)
    micro = spec.get("micro_batch", spec["batch"])  # pairs per forward; accumulated to the job's pairs per step
    accumulate = spec["batch"] // micro
    args = DPOConfig(
        output_dir=str(Path(spec["out"]) / "trl"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulate, num_train_epochs=1, learning_rate=spec["lr"], lr_scheduler_type="cosine",
        warmup_steps=spec["warmup_ratio"], weight_decay=0.0, max_grad_norm=1.0, max_length=spec["max_seq_len"],
        beta=spec["beta"], loss_type=["sigmoid"], bf16=spec["mixed_precision"] == "bf16",
        use_cpu=spec.get("device", "cpu") == "cpu", logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", seed=spec["seed"], disable_tqdm=True, dataloader_num_workers=0, **opts,
    )
    trainer = DPOTrainer(model=load_model(spec), args=args, train_dataset=train, processing_class=tokenizer,
                         peft_config=lora_config(spec))
    data = trainer.train_dataset
    max_len = spec["max_seq_len"]
    lengths = []
    for prompt, chosen, rejected in zip(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"]):
        lengths += [min(len(prompt) + len(chosen), max_len), min(len(prompt) + len(rejected), max_len)]
    output = trainer.train()
    trainer.save_model()
    clock = stop_clock(started, spec)
    step_losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    settings = SETTINGS["trl-dpo"].format(batch=spec["batch"], micro=micro, accumulate=accumulate, version=trl.__version__, **opts)
    return finish_dpo(spec, "trl", clock, output.metrics["train_runtime"], sum(lengths), output.global_step,
                      len(data), trainer.model, lengths, settings, step_losses,
                      reference_in_loop=not opts["precompute_ref_log_probs"])

TOOLS = {"workbench": run_workbench, "workbench-baseline": run_workbench, "trl": run_trl, "trl-unpacked": run_trl,
         "plain": run_plain}


def run_tool(spec: dict) -> dict:
    torch.set_num_threads(spec["threads"])
    return TOOLS[spec["tool"]](spec)
