"""Score a run on held-out data, the tuned model beside its base.

Two kinds of numbers:
- eval loss and perplexity: token-weighted over the answer tokens, with exactly the tokenization
  and prompt masking that training used (`workbench.data.tokens.tokenize_row`), so they are comparable
  with the run's own eval_loss;
- answer accuracy: the greedy answer to each prompt against the reference (the last assistant
  message / output / completion): exact match (both stripped) and "contains" (the reference appears
  in the answer, ignoring case and runs of white space).

The result is saved in run.json under "evaluation", where `workbench runs` and the UI read it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from workbench.base.errors import DataError, RecipeError, WorkbenchError
from workbench.base.quiet import leaves_the_process_as_found
from workbench.data.batches import Collator
from workbench.data.prepared import held_out_indices
from workbench.data.rows import Rows, load_rows
from workbench.data.tokens import IGNORE, tokenize_row
from workbench.model.inference import load_for_inference, stop_token_ids
from workbench.model.lm_loss import lm_loss_sum
from workbench.rundir.runs import RunDir, load_run
from workbench.spec.formats import detect, format_of
from workbench.spec.objectives import objective_of
from workbench.spec.recipe import DataSection
from workbench.training.objectives import right_side, sample_logps, sequence_rewards

EXAMPLES_SAVED = 20  # answers kept in run.json for people to read (the scores use every row)


@dataclass
class Example:
    input_ids: list[int]  # the whole sample, as training saw it
    labels: list[int]
    targets: int
    prompt_ids: list[int] | None  # everything before the last answer (None: nothing to answer)
    question: str | None
    reference: str | None


@leaves_the_process_as_found
def evaluate(run_dir: str | Path, data: str | Path | None = None, base: bool = False, max_new_tokens: int = 64,
             limit: int | None = None, batch_size: int = 8, save: bool = True) -> dict:
    """Evaluate a run's tuned model (and its base beside it with base=True) on held-out rows.

    data: a file in any supported layout (default: the recipe's data.eval, or the rows its
    data.eval_split held out of train); its row format is the recipe's when the columns fit, else
    detected from the columns. Returns
    {"tuned": {eval_loss, perplexity, exact_match, contains, ...}, "base": {...} or None, ...}.
    """
    started = time.perf_counter()
    for flag, value in (("--limit", limit), ("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size)):
        if value is not None and value <= 0:
            raise RecipeError(f"{flag}: must be a positive number, got {value}")
    run = load_run(run_dir)
    cfg = DataSection.model_validate(run.recipe.get("data", {}))
    parts, path = eval_rows(cfg, data, seed=run.recipe.get("training", {}).get("seed", 42))
    parts = [(rows, part_cfg.model_copy(update={"format": detect(rows.dataset.column_names, part_cfg.format)}))
             for rows, part_cfg in parts]
    cfg = parts[0][1]

    training = run.recipe.get("training", {})
    objective = objective_of(training.get("objective"))
    reward_model = objective.scores_sequences
    if reward_model and base:
        raise RecipeError("--base: a reward model's base has no trained score head to score with; evaluate the "
                          "run without --base")
    model, tokenizer = load_for_inference(run.path, generates=not reward_model)
    fmt = format_of(cfg.format)
    if reward_model or fmt.preference or fmt.unpaired:
        if reward_model:  # how often it scores the chosen answer higher
            result = evaluate_rewards(model, tokenizer, parts, limit, batch_size)
        else:
            beta_field = objective.reward_scale
            beta = training.get(beta_field, 0.1) if beta_field else 0.1
            score_rows = evaluate_unpaired if fmt.unpaired else evaluate_preferences
            result = score_rows(model, tokenizer, parts, run.path, beta, limit, batch_size)
            result["beta_source"] = f"training.{beta_field}" if beta_field else "default"
        result.update(data=path, run_steps=run.summary.get("steps"), wall_s=round(time.perf_counter() - started, 2),
                      objective=objective.name)
        if save:
            RunDir(run.path).update_json(evaluation=result)
        return result
    examples = build_examples(parts, tokenizer, limit)
    result = {
        "data": path, "format": "+".join(dict.fromkeys(c.format for _, c in parts)), "rows": len(examples),
        "rows_without_targets": sum(1 for e in examples if e.targets == 0),
        "max_new_tokens": max_new_tokens, "limit": limit, "run_steps": run.summary.get("steps"),
        "device": str(next(model.parameters()).device),
        "evaluated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    tuned, tuned_answers = score(model, tokenizer, examples, max_new_tokens, batch_size)
    base_scores = base_answers = None
    if base:
        if hasattr(model, "disable_adapter"):  # a PEFT model: the base is the same weights, adapter off
            with model.disable_adapter():
                base_scores, base_answers = score(model, tokenizer, examples, max_new_tokens, batch_size)
        else:  # full fine-tuning replaced the weights: load the base itself, this model freed first
            del model
            base_model, _ = load_for_inference(run.path, base=True)
            base_scores, base_answers = score(base_model, tokenizer, examples, max_new_tokens, batch_size)
    # Both keys always written: update_json merges, and a stale "base" must not survive a re-run.
    result.update(tuned=tuned, base=base_scores, examples=_examples(examples, tuned_answers, base_answers))
    result["wall_s"] = round(time.perf_counter() - started, 2)
    if save:
        RunDir(run.path).update_json(evaluation=result)
    return result


# -- rows to examples -------------------------------------------------------------------------


def eval_rows(cfg: DataSection, data: str | Path | None, seed: int) -> tuple[list[tuple[Rows, DataSection]], str]:
    """The rows to evaluate, in parts each read with its settings, and how to name them: `data`, else
    data.eval, else what eval_split held out of each training source."""
    if data is not None:
        return [(load_rows(str(data), cfg.split), cfg)], str(data)
    if cfg.eval:
        return [(load_rows(cfg.eval, cfg.split), cfg)], cfg.eval
    if not cfg.eval_split:
        raise WorkbenchError("the run's recipe has neither data.eval nor data.eval_split: pass --data FILE")
    # tokenize_data holds out of each source's (limited) rows: the same indices are the very rows it held out
    parts = []
    for source in cfg.sources:
        rows = load_rows(source.path, cfg.split)
        count = len(rows.dataset) if cfg.limit is None else min(cfg.limit, len(rows.dataset))
        picked = held_out_indices(count, cfg.eval_split, seed)[1]
        held_out = Rows(rows.dataset.select(picked), rows.source, lambda k, rows=rows, picked=picked:
                        rows.where(picked[k]), rows.fingerprint)
        parts.append((held_out, cfg.model_copy(update={"train": source.path, "format": source.format})))
    return parts, f"{cfg.train_name} (the {cfg.eval_split:g} held out)"


def _each_row(parts: list[tuple[Rows, DataSection]], limit: int | None):
    """(row, file:line, its settings): a row of each part in turn, so that `limit` rows sample every source."""
    taken = 0
    for i in range(max(len(rows.dataset) for rows, _ in parts)):
        for rows, cfg in parts:
            if i >= len(rows.dataset):
                continue
            if limit is not None and taken >= limit:
                return
            yield rows.dataset[i], rows.where(i), cfg
            taken += 1


def build_examples(parts: list[tuple[Rows, DataSection]], tokenizer, limit: int | None = None) -> list[Example]:
    examples = []
    for row, where, cfg in _each_row(parts, limit):
        sample = tokenize_row(row, tokenizer, cfg, where)  # the training tokenization, prompt masks included
        question, reference = question_and_reference(row, cfg, where)
        examples.append(Example(sample["input_ids"], sample["labels"], sample["targets"],
                                _prompt_ids(row, tokenizer, cfg, where) if reference else None,
                                question, reference))
    if not examples:
        raise DataError(f"{' + '.join(rows.source for rows, _ in parts)}: no rows to evaluate")
    return examples


def question_and_reference(row: dict, cfg: DataSection, where: str) -> tuple[str | None, str | None]:
    return format_of(cfg.format).reference(row, cfg.system_prompt, where)


def _prompt_ids(row: dict, tokenizer, cfg: DataSection, where: str) -> list[int]:
    """Token ids up to the last answer, segment by segment as training tokenizes them."""
    segments = format_of(cfg.format).segments(row, tokenizer, cfg.system_prompt, where)
    last = max(i for i, (_, is_answer) in enumerate(segments) if is_answer)
    ids: list[int] = []
    for text, _ in segments[:last]:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


# -- scoring ----------------------------------------------------------------------------------


def score(model, tokenizer, examples: list[Example], max_new_tokens: int, batch_size: int) -> tuple[dict, list]:
    loss_sum, targets = loss_sum_and_targets(model, tokenizer, examples, batch_size)
    asked = [k for k, e in enumerate(examples) if e.prompt_ids is not None]
    answers = greedy_answers(model, tokenizer, [examples[k].prompt_ids for k in asked], max_new_tokens, batch_size)
    references = [examples[k].reference for k in asked]
    exact = sum(a.strip() == r.strip() for a, r in zip(answers, references))
    contains = sum(_normal(r) in _normal(a) for a, r in zip(answers, references))
    loss = loss_sum / targets if targets else None
    scores = {
        "eval_loss": round(loss, 6) if loss is not None else None,
        "perplexity": round(math.exp(min(loss, 700)), 4) if loss is not None else None,
        "target_tokens": targets, "answered": len(asked),
        "exact_match": round(exact / len(asked), 4) if asked else None,
        "contains": round(contains / len(asked), 4) if asked else None,
    }
    per_example = [None] * len(examples)
    for k, answer in zip(asked, answers):
        per_example[k] = answer
    return scores, per_example


@torch.no_grad()
def loss_sum_and_targets(model, tokenizer, examples: list[Example], batch_size: int) -> tuple[float, int]:
    """Summed next-token loss over every answer token, and how many there were (token-weighted)."""
    collate = Collator(tokenizer.pad_token_id)
    device = next(model.parameters()).device
    samples = sorted((e for e in examples if e.targets), key=lambda e: len(e.input_ids))  # less padding
    loss_sum, targets = 0.0, 0
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        batch = _on(device, collate([{"input_ids": e.input_ids, "labels": e.labels,
                                      "position_ids": list(range(len(e.input_ids)))} for e in chunk]))
        loss_sum += float(lm_loss_sum(model, batch))
        targets += int((batch["labels"] != IGNORE).sum())
    return loss_sum, targets


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 8) -> list[str]:
    """Greedy answers, generated in batches of left-padded prompts (new tokens follow every prompt)."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    stops = stop_token_ids(model, tokenizer)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    answers = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
            mask[row, width - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=stops)
        for row, i in enumerate(chunk):
            new = out[row, width:].tolist()
            cut = next((k for k, t in enumerate(new) if t in stops), len(new))  # what follows is padding
            answers[i] = tokenizer.decode(new[:cut], skip_special_tokens=True).strip()
    return answers


def _normal(text: str) -> str:
    return " ".join(text.split()).casefold()


def _examples(examples: list[Example], tuned: list, base: list | None) -> list[dict]:
    kept = []
    for k, e in enumerate(examples):
        if e.reference is None:
            continue
        item = {"question": e.question, "reference": e.reference, "tuned": tuned[k]}
        if base is not None:
            item["base"] = base[k]
        kept.append(item)
        if len(kept) == EXAMPLES_SAVED:
            break
    return kept


# -- preference pairs -------------------------------------------------------------------------


def evaluate_preferences(model, tokenizer, parts: list[tuple[Rows, DataSection]], run_path, beta: float,
                         limit: int | None, batch_size: int) -> dict:
    """Held-out pairs, the tuned model beside its base: how often each gives the chosen answer the higher
    log-probability (preference_accuracy) and by how much on average (logp_margin); for the tuned model also
    DPO's implicit rewards against the base (reward_accuracy, reward_margin, with the run's dpo_beta)."""
    pairs, without_targets = [], 0
    for row, where, cfg in _each_row(parts, limit):
        example = tokenize_row(row, tokenizer, cfg, where)
        if example["targets"]:
            pairs.append(example)
        else:  # an answer lost to data.max_seq_len, or two answers truncation made the same
            without_targets += 1
    if not pairs:
        raise DataError(f"{' + '.join(rows.source for rows, _ in parts)}: no pair to evaluate (every one lost an "
                        "answer to data.max_seq_len)")
    device = str(next(model.parameters()).device)
    tuned = pair_logps(model, tokenizer, pairs, batch_size)
    base = on_base(model, run_path, lambda m: pair_logps(m, tokenizer, pairs, batch_size))
    rewards = beta * ((tuned[0] - base[0]) - (tuned[1] - base[1]))
    return {"format": parts[0][1].format, "rows": len(pairs), "rows_without_targets": without_targets, "limit": limit,
            "beta": beta,
            "device": device,
            "evaluated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "tuned": {**_preference_scores(*tuned), "reward_accuracy": round(float((rewards > 0).float().mean()), 4),
                      "reward_margin": round(float(rewards.mean()), 4)},
            "base": _preference_scores(*base), "examples": []}


def evaluate_rewards(model, tokenizer, parts: list[tuple[Rows, DataSection]], limit: int | None,
                     batch_size: int) -> dict:
    """Held-out pairs scored by a reward model: how often the chosen answer scores higher (reward_accuracy), by how
    much on average (reward_margin), and the mean scores. Its base has no trained score head: no base column."""
    pairs, without_targets = [], 0
    for row, where, cfg in _each_row(parts, limit):
        if not format_of(cfg.format).preference:
            raise DataError(f"{where}: a reward model is evaluated on preference pairs (prompt, chosen, rejected); "
                            f"this row is {cfg.format}")
        example = tokenize_row(row, tokenizer, cfg, where)
        if example["targets"] and not example["truncated"]:  # scored whole, as training left cut pairs out
            pairs.append(example)
        else:
            without_targets += 1
    if not pairs:
        raise DataError(f"{' + '.join(rows.source for rows, _ in parts)}: no pair to evaluate (every one is longer "
                        "than data.max_seq_len)")
    collate = Collator(tokenizer.pad_token_id)
    device = next(model.parameters()).device
    with torch.no_grad():
        rewards = torch.cat([sequence_rewards(model, _on(device, collate(pairs[start:start + batch_size])),
                                              tokenizer.pad_token_id).cpu()
                             for start in range(0, len(pairs), batch_size)])
    chosen, rejected = rewards[0::2], rewards[1::2]
    tuned = {"reward_accuracy": round(float((chosen > rejected).float().mean()), 4),
             "reward_margin": round(float((chosen - rejected).mean()), 4),
             "rewards_chosen": round(float(chosen.mean()), 4), "rewards_rejected": round(float(rejected.mean()), 4),
             "pairs": len(chosen)}
    return {"format": parts[0][1].format, "rows": len(pairs), "rows_without_targets": without_targets,
            "limit": limit, "device": str(device),
            "evaluated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "tuned": tuned, "base": None, "examples": []}


def evaluate_unpaired(model, tokenizer, parts: list[tuple[Rows, DataSection]], run_path, beta: float,
                      limit: int | None, batch_size: int) -> dict:
    """Held-out desirable and undesirable answers, the tuned model beside its base: each model's mean summed
    log-probability of either kind (logp_margin: desirable minus undesirable), and for the tuned model KTO's
    implicit rewards against the base. As in training, each row also answers its prompt with the previous row's
    answer, and those mismatched samples give the reference point z (`kl`); reward_accuracy is how often a row's
    reward lies on its label's side of beta * z."""
    rows = list(_each_row(parts, limit))
    if len(rows) < 2:
        raise DataError(f"{' + '.join(r.source for r, _ in parts)}: {len(rows)} unpaired row; the KL estimate answers "
                        "each row's prompt with another row's answer, so at least 2 rows are needed")
    answers = [format_of(cfg.format).unpaired_row(row, where, cfg.system_prompt).completion
               for row, where, cfg in rows]
    examples, without_targets = [], 0
    for i, (row, where, cfg) in enumerate(rows):
        example = tokenize_row(row, tokenizer, cfg, where, mismatched=answers[i - 1])  # TRL's rotation by one
        if example["targets"]:
            examples.append(example)
        else:  # the answer lost to data.max_seq_len
            without_targets += 1
    if not examples:
        raise DataError(f"{' + '.join(rows.source for rows, _ in parts)}: no row to evaluate (every one lost its "
                        "answer to data.max_seq_len)")
    device = str(next(model.parameters()).device)
    tuned = pair_logps(model, tokenizer, examples, batch_size)  # (answers, mismatched answers)
    base = on_base(model, run_path, lambda m: pair_logps(m, tokenizer, examples, batch_size))
    desirable = torch.tensor([e["desirable"][0] for e in examples])
    rewards = beta * (tuned[0] - base[0])
    kl = float((tuned[1] - base[1]).mean().clamp(min=0))
    tuned_scores = {**_unpaired_scores(tuned[0], desirable), "kl": round(kl, 4),
                    "reward_accuracy": round(float(right_side(rewards, beta * kl, desirable).float().mean()), 4)}
    if desirable.any() and (~desirable).any():
        tuned_scores["reward_margin"] = round(float(rewards[desirable].mean() - rewards[~desirable].mean()), 4)
    return {"format": parts[0][1].format, "rows": len(examples), "rows_without_targets": without_targets,
            "limit": limit, "beta": beta, "device": device,
            "evaluated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "tuned": tuned_scores, "base": _unpaired_scores(base[0], desirable), "examples": []}


def _unpaired_scores(logps: torch.Tensor, desirable: torch.Tensor) -> dict:
    scores = {"desirable": int(desirable.sum()), "undesirable": int((~desirable).sum())}
    if desirable.any():
        scores["logps_desirable"] = round(float(logps[desirable].mean()), 4)
    if (~desirable).any():
        scores["logps_undesirable"] = round(float(logps[~desirable].mean()), 4)
    if desirable.any() and (~desirable).any():
        scores["logp_margin"] = round(scores["logps_desirable"] - scores["logps_undesirable"], 4)
    return scores


def on_base(model, run_path, measure):
    """`measure` of the run's base model: a PEFT model with its adapter switched off (the same weights), or, where
    full fine-tuning replaced the weights, the base loaded itself."""
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            return measure(model)
    return measure(load_for_inference(run_path, base=True)[0])


@torch.no_grad()
def pair_logps(model, tokenizer, pairs: list[dict], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed answer log-probabilities of each pair, as training scores them (for unpaired
    rows: the answer and the mismatched answer)."""
    collate = Collator(tokenizer.pad_token_id)
    device = next(model.parameters()).device
    chosen, rejected = [], []
    for start in range(0, len(pairs), batch_size):
        batch = _on(device, collate(pairs[start:start + batch_size]))
        logps, _ = sample_logps(model, batch)
        chosen.append(logps[0::2].cpu())
        rejected.append(logps[1::2].cpu())
    return torch.cat(chosen), torch.cat(rejected)


def _on(device, batch: dict) -> dict:
    """A collated batch with its tensors on the device (the collator's counts are Python ints)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _preference_scores(chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    return {"preference_accuracy": round(float((chosen > rejected).float().mean()), 4),
            "logp_margin": round(float((chosen - rejected).mean()), 4), "pairs": len(chosen)}


# -- reading it back --------------------------------------------------------------------------


def format_evaluation(result: dict) -> str:
    """A short plain-text table of an evaluation, base beside tuned, for the CLI."""
    models = [name for name in ("base", "tuned") if result.get(name)]
    if "max_new_tokens" in result:
        lines = [f"evaluated {result['rows']} rows of {result['data']} ({result['format']}), "
                 f"greedy answers of up to {result['max_new_tokens']} tokens, on {result['device']}"]
        keys = ("eval_loss", "perplexity", "exact_match", "contains")
    elif objective_of(result.get("objective")).scores_sequences:
        lines = [f"evaluated {result['rows']} pairs of {result['data']} ({result['format']}) with the reward model, "
                 f"on {result['device']}"]
        keys = ("reward_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected")
    else:  # preference pairs, or unpaired desirable/undesirable answers
        unpaired = "preference_accuracy" not in result["tuned"]
        lines = [f"evaluated {result['rows']} {'rows' if unpaired else 'pairs'} of {result['data']} "
                 f"({result['format']}), on {result['device']}; rewards against the base with beta {result['beta']} "
                 f"({result.get('beta_source', 'default')})"]
        keys = (("logps_desirable", "logps_undesirable", "logp_margin", "kl", "reward_accuracy", "reward_margin")
                if unpaired else ("preference_accuracy", "logp_margin", "reward_accuracy", "reward_margin"))
    if result.get("rows_without_targets"):
        lines.append(f"  {result['rows_without_targets']} more left out: data.max_seq_len cut them")
    lines.append(f"  {'':<20}" + "".join(f"{name:>12}" for name in models))
    for key in keys:
        cells = "".join(f"{_cell(result[name].get(key)):>12}" for name in models)
        lines.append(f"  {key:<20}{cells}")
    for item in result.get("examples", [])[:3]:
        lines.append(f"  question: {item['question']}\n    reference: {item['reference']}")
        for name in models:
            lines.append(f"    {name + ':':<10} {item.get(name)}")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)
