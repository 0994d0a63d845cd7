"""Model cards: the README.md the Hugging Face Hub shows for an adapter or merged model folder.

Everything in a card is read back from the run directory (recipe.yaml, run.json, metrics.jsonl), so a card
can be written again at any time: when the adapter is saved, once the run's final figures are in, and
before a push (with the repository id in the loading snippet).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

from workbench.rundir.run_summary import RunSummary
from workbench.rundir.runs import load_run
from workbench.spec.chat_templates import TEMPLATES
from workbench.spec.objectives import Objective, objective_of


KINDS = ("adapter", "merged")
HUB_DATA_PREFIX = "hub:"  # how data/pipeline.py fingerprints a hub data set instead of hashing a file
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
PREFERENCE_FIGURES = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")
EVALUATE_FIGURES = {"eval_loss": "loss", "perplexity": "perplexity", "exact_match": "exact_match",
                    "contains": "contains", "preference_accuracy": "accuracy", "logps_desirable": "logps_desirable",
                    "logps_undesirable": "logps_undesirable", "logp_margin": "logp_margin", "kl": "kl",
                    "reward_accuracy": "reward_accuracy", "reward_margin": "reward_margin"}


# -- writing ----------------------------------------------------------------------------------


def write_model_card(folder: str | Path, run_dir: str | Path, kind: str = "adapter",
                     repo_id: str | None = None) -> Path:
    """Write `folder/README.md`, the model card of the adapter (kind="adapter") or merged model
    (kind="merged") that `run_dir` produced. `repo_id` names the hub repository in the loading snippet."""
    if kind not in KINDS:
        raise ValueError(f"kind: must be one of {', '.join(KINDS)}, got {kind!r}")
    folder = Path(folder)
    path = folder / "README.md"
    card = render_model_card(load_run(run_dir), kind, folder, repo_id, kept=user_front_matter(path))
    path.write_text(card, encoding="utf-8")
    return path


USER_KEYS = ("license", "license_name", "license_link", "base_model", "base_model_relation", "language", "datasets")


def user_front_matter(card: Path) -> dict:
    """The keys a user sets by hand in an existing card (the licence, the hub's base model, the language):
    written again, the card keeps them."""
    import yaml

    try:
        text = card.read_text(encoding="utf-8")
        if not text.startswith("---\n"):
            return {}
        meta = yaml.safe_load(text[4:text.index("\n---", 4)])
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    if not isinstance(meta, dict) or "lora-workbench" not in (meta.get("tags") or []):
        return {}  # not a card of ours (peft's save_pretrained writes a stub card of its own first)
    return {k: meta[k] for k in USER_KEYS if meta.get(k) is not None}


def write_model_card_or_warn(folder: str | Path, run_dir: str | Path, kind: str = "adapter") -> Path | None:
    """write_model_card for the savers: the adapter or model is already safe on disk, so a card that cannot
    be written is a warning, never a failed save."""
    try:
        return write_model_card(folder, run_dir, kind)
    except Exception as err:  # noqa: BLE001  (whatever a damaged run.json makes of the card: never the save)
        warnings.warn(f"{Path(folder) / 'README.md'}: model card not written ({err})", stacklevel=2)
        return None


def refresh_model_cards(run_dir: str | Path) -> None:
    """The card saved with the adapter predates the run's final figures: write it again once they are in."""
    run_dir = Path(run_dir)
    for folder, kind in ((run_dir / "adapter", "adapter"), (run_dir / "model", "merged")):
        if folder.is_dir():
            write_model_card_or_warn(folder, run_dir, kind)


# -- the card ---------------------------------------------------------------------------------


def render_model_card(run, kind: str, folder: Path, repo_id: str | None = None, kept: dict | None = None) -> str:
    """The card's text: YAML front matter (`kept`: the keys a user set by hand win), then the body in Markdown."""
    recipe, summary = run.recipe, run.summary
    sections = [
        _title(run, kind, folder),
        _licence_note((kept or {}).get("license")),
        _method_section(recipe, summary),
        _objective_section(recipe, summary),
        _data_section(recipe, summary),
        _training_section(recipe, summary),
        _results_section(summary, run.metrics, run.env),
        _evaluation_section(run.evaluation),
        _recipe_section(run.path),
        _loading_section(recipe, kind, repo_id),
    ]
    body = "\n\n".join(s for s in sections if s)
    return f"---\n{front_matter_yaml(run, kind, kept)}---\n\n{body}\n"


def front_matter_yaml(run, kind: str, kept: dict | None = None) -> str:
    import yaml

    recipe, summary = run.recipe, run.summary
    base = hub_model_id(_section(recipe, "model").get("path", ""))
    licence = "other"  # the user sets it in the card (kept when the card is written again)
    datasets = [d for d in (_hub_data_id(recipe, summary, role) for role in ("train", "eval")) if d]
    results = _eval_results(recipe, summary, run.evaluation)
    meta = {
        "base_model": base,
        "base_model_relation": ("adapter" if kind == "adapter" else "finetune") if base else None,
        "library_name": "peft" if kind == "adapter" and not _is_full(recipe) else "transformers",
        "license": licence,
        "tags": card_tags(recipe, summary),
        "datasets": list(dict.fromkeys(datasets)) or None,
        "pipeline_tag": _pipeline(recipe)["type"],
        "model-index": [{"name": recipe.get("name") or run.name, "results": results}] if results else None,
    }
    meta.update(kept or {})
    return yaml.safe_dump({k: v for k, v in meta.items() if v is not None}, sort_keys=False, allow_unicode=True)


def _reward_loading_section(recipe: dict, kind: str, where: str) -> str:
    """A reward model loads as a sequence classifier with one output; a conversation is scored as training scored
    its pairs: rendered whole with the chat template saved beside it."""
    score = ("conversation = [{\"role\": \"user\", \"content\": \"What is 2 plus 3?\"},\n"
             "                {\"role\": \"assistant\", \"content\": \"2 plus 3 is 5.\"}]\n"
             "ids = tokenizer.apply_chat_template(conversation, return_tensors=\"pt\", return_dict=True)\n"
             "reward = model(**ids).logits[0, 0].item()")
    if kind == "merged":
        code = ("from transformers import AutoModelForSequenceClassification, AutoTokenizer\n\n"
                f"model = AutoModelForSequenceClassification.from_pretrained({where})\n"
                f"tokenizer = AutoTokenizer.from_pretrained({where})\n{score}")
        return ("## Use it\n\nA reward model: a transformers sequence classifier with one output, the reward (no peft "
                f"needed):\n\n```python\n{code}\n```")
    model = _section(recipe, "model")
    path, options = model.get("path", ""), _hub_options(model)
    builtin = isinstance(path, str) and path.startswith("builtin:")
    base_path = f"resolve_model_path({_literal(path)})" if builtin else _literal(path)
    code = ("from peft import PeftModel\nfrom transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
            + ("from workbench.model.loading import resolve_model_path  # builds the builtin base model\n" if builtin else "")
            + f"\ntokenizer = AutoTokenizer.from_pretrained({where})  # the tokenizer training used\n"
            f"base = AutoModelForSequenceClassification.from_pretrained({base_path}, num_labels=1, "
            f"pad_token_id=tokenizer.pad_token_id{options})\n"
            f"model = PeftModel.from_pretrained(base, {where})  # the adapter and the trained score head\n{score}")
    return ("## Use it\n\nA reward model: the base as a sequence classifier with one output, then the adapter "
            f"with its score head:\n\n```python\n{code}\n```\n\nThe reward is read at the conversation's last "
            "token that is not the pad token (a classifier's own pooling), as in training.")


def card_tags(recipe: dict, summary: dict) -> list[str]:
    """The tags the hub filters on: the method, peft, the objective, and this tool."""
    adapter = _section(recipe, "adapter")
    method = adapter.get("method", "lora")
    tags = [] if method == "full" else ["lora"] + ([method] if method in ("qlora", "dora") else [])
    if adapter.get("rslora") and method != "full":
        tags.append("rslora")
    if method != "full":
        tags.append("peft")
    return [*tags, _objective(recipe, summary).name, "lora-workbench"]


def hub_model_id(path: str) -> str | None:
    """`path` when it names a hub model (owner/name), None for a builtin or a local folder."""
    if not isinstance(path, str) or path.startswith(("builtin:", ".", "/", "~")) or path.count("/") != 1:
        return None
    return path if _valid_repo_id(path) and not Path(path).expanduser().exists() else None


# -- body sections ----------------------------------------------------------------------------


def _title(run, kind: str, folder: Path) -> str:
    recipe = run.recipe
    name, base = recipe.get("name") or run.name, _base_name(recipe)
    if _is_full(recipe):
        what = f"A full fine-tune of {_code(base)} (every weight trained)"
    elif kind == "adapter":
        what = f"A {_method_name(recipe)} adapter for {_code(base)}"
    else:
        what = f"{_code(base)} with a {_method_name(recipe)} adapter merged into its weights"
    dtype = _folder_dtype(folder) if kind == "merged" else None
    lines = [f"# {name}", "", f"{what}, trained with lora-workbench (objective {_code(_objective(recipe, run.summary).name)})."]
    if dtype:
        lines.append(f"Weights saved in {dtype}.")
    lines += ["", f"- **Base model:** {_code(base)}{_base_note(base)}"]
    return "\n".join(lines)


def _licence_note(licence: str | None) -> str | None:
    if licence not in (None, "other"):
        return None
    return ("> **Licence: not set.** The front matter says `license: other` until you set it. This model derives "
            "from its base model: set `license:` to the base model's licence (and `license_name` / `license_link` "
            "for a custom one) in this card before sharing it; writing the card again keeps what you set.")


def _method_section(recipe: dict, summary: dict) -> str:
    adapter, quant = _section(recipe, "adapter"), _section(recipe, "quantization")
    if _is_full(recipe):
        rows = [("method", "full fine-tuning"),
                ("trainable parameters", _share(summary.get("trainable_params"), summary.get("params")))]
    else:
        rows = [("method", _method_name(recipe)), ("r", adapter.get("r")), ("alpha", adapter.get("alpha")),
                ("scaling", _scaling(adapter)),
                ("dropout", adapter.get("dropout")), ("target modules", _modules(adapter.get("target_modules"))),
                ("modules trained in full", _modules(adapter.get("modules_to_save"))),
                ("trainable parameters", _share(summary.get("trainable_params"), summary.get("params")))]
        init = adapter.get("init") or "default"
        if init in ("pissa", "olora"):
            init += " (saved converted: a rank-2r adapter of the published base)"
        rows.insert(5, ("initialisation", init))
        if adapter.get("lora_plus_ratio") is not None:
            rows.insert(6, ("LoRA+ (B's learning rate / A's)", adapter.get("lora_plus_ratio")))
            # only named targets can hold an embedding layer (the presets are Linears); a run recorded before the
            # setting existed has none to show
            if isinstance(adapter.get("target_modules"), list) and adapter.get("lora_plus_lr_embedding") is not None:
                rows.insert(7, ("LoRA+ learning rate of adapted embedding layers", adapter["lora_plus_lr_embedding"]))
    if adapter.get("method") == "qlora" and quant:
        rows.append(("base weights during training", f"{quant.get('bits')}-bit {quant.get('type')}"
                     + (", double quantization" if quant.get("double_quant") else "")))
    return "## Method\n\n" + _table(("setting", "value"), rows)


def _objective_section(recipe: dict, summary: dict) -> str:
    objective = _objective(recipe, summary)
    settings = objective.settings_text(_section(recipe, "training"))
    text = f"## Objective\n\n{_code(objective.name)}: {objective.summary}." + (f" {settings}." if settings else "")
    if objective.samples_answers:
        text += _rewards_text(_section(recipe, "training").get("grpo"), summary)
    return text


def _count(value) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else "?"


def _rewards_text(grpo, summary: dict) -> str:
    """The rewards a GRPO run was trained on, with their weights, and the reward it ended at (a recipe is read
    back from the run's folder: anything unexpected in it reads as nothing)."""
    grpo = grpo if isinstance(grpo, dict) else {}
    rewards, weights = grpo.get("rewards"), grpo.get("reward_weights")
    if not isinstance(rewards, list) or not rewards:
        return ""
    names = [r if isinstance(r, str) else r.get("name") if isinstance(r, dict) else None for r in rewards]
    weights = weights if isinstance(weights, list) and len(weights) == len(names) else [1.0] * len(names)
    listed = ", ".join(f"{_code(str(name))} (weight {weight:g})" for name, weight in zip(names, weights)
                       if isinstance(name, str) and isinstance(weight, (int, float)))
    final = summary.get("reward_final")
    ended = f" The last logged reward: {final:.3f}." if isinstance(final, (int, float)) else ""
    return (f" Rewards: {listed}, {_count(grpo.get('num_generations'))} answers sampled per prompt.{ended}"
            if listed else "")


def _data_section(recipe: dict, summary: dict) -> str:
    data = _section(recipe, "data")
    if isinstance(data.get("train"), list):  # several sources mixed (summary.mix: what each gave)
        mix = [part if isinstance(part, dict) else {} for part in summary.get("mix") or []]
        rows = [(f"train ({source.get('format') or data.get('format')}, weight {source.get('weight', 1):g})",
                 _code(source.get("path")), (mix[k] if k < len(mix) else {}).get("samples"), "")
                for k, source in enumerate(data["train"]) if isinstance(source, dict)]
        rows.append(("train, mixed", "", summary.get("train_samples"), _digest(summary.get("train_sha256"))))
    else:
        rows = [("train", f"{_code(data.get('train'))}", "streamed" if summary.get("streaming")
                 else summary.get("train_samples"), _digest(summary.get("train_sha256")))]
    if data.get("eval"):
        rows.append(("eval", f"{_code(data['eval'])}", summary.get("eval_samples"), _digest(summary.get("eval_sha256"))))
    elif data.get("eval_split"):
        rows.append(("eval", f"{data['eval_split']} of train, held out", summary.get("eval_samples"),
                     "(as train)"))
    table = _table(("role", "data", "rows", "SHA-256"), rows)
    loss_on = "" if data.get("format") == "preference" else f", loss on {data.get('train_on', 'completions')}"
    settings = (f"Format {_code(data.get('format'))}, sequences of up to {data.get('max_seq_len')} tokens"
                f"{', packed' if data.get('packing') else ''}{loss_on}"
                + (f", first {data['limit']} rows" if data.get("limit") else "")
                + (", read as a stream" if data.get("streaming") else "") + ".")
    if data.get("chat_template"):
        template = data["chat_template"]  # a registered name, or a file: named by its file name, not where it lay
        settings += (f" Chat template {_code(template if template in TEMPLATES else Path(template).name)} in place "
                     "of the base tokenizer's "
                     "(saved beside the weights as `chat_template.jinja`).")
    return f"## Data\n\n{table}\n\n{settings}"


def _training_section(recipe: dict, summary: dict) -> str:
    t = _section(recipe, "training")
    length = f"{t['max_steps']} steps" if t.get("max_steps") else f"{t.get('epochs')} epochs"
    world = summary.get("world_size") or 1
    rows = [("length", length), ("micro batch x accumulation x devices",
                                 f"{t.get('micro_batch_size')} x {t.get('grad_accum')} x {world}"),
            ("learning rate", f"{t.get('lr')} ({t.get('scheduler')}, warmup {t.get('warmup_ratio')})"),
            ("optimizer", f"{t.get('optimizer')}, weight decay {t.get('weight_decay')}"),
            ("gradient clipping", t.get("max_grad_norm")),
            ("model dtype", summary.get("model_dtype") or _section(recipe, "model").get("dtype")),
            ("mixed precision", summary.get("mixed_precision") or t.get("mixed_precision")),
            ("gradient checkpointing", t.get("gradient_checkpointing")),
            ("strategy", summary.get("strategy")), ("seed", t.get("seed"))]
    return "## Training\n\n" + _table(("setting", "value"), rows)


def _results_section(summary: dict, metrics: list[dict], env: dict) -> str:
    """The run's own measurements: summary first, metrics.jsonl where the summary is not written yet."""
    train_rows = [m for m in metrics if m.get("loss") is not None]
    eval_rows = [m for m in metrics if m.get("eval_loss") is not None]
    last = train_rows[-1] if train_rows else {}
    s = RunSummary.read(summary)
    rows = [("steps", _first(s.steps, last.get("step"))),
            ("tokens trained", _first(s.tokens, last.get("tokens"))),
            ("tokens/s", s.tokens_per_s),
            ("peak memory (MB)", s.peak_memory_mb),
            ("MFU (fraction of peak FLOP/s)", s.mfu),
            ("wall time (s)", s.wall_s),
            ("final train loss", _first(s.final_loss, last.get("loss"))),
            ("eval loss before", _first(s.eval_loss_first, eval_rows[0]["eval_loss"] if eval_rows else None)),
            ("eval loss after", _first(s.eval_loss_final, eval_rows[-1]["eval_loss"] if len(eval_rows) > 1
                                       else None))]
    rows += _preference_rows(summary)
    where = _measured_on(summary, env)
    status = s.status
    note = "" if status == "completed" else f"\n\nThe run's status is {_code(status)}: figures may be incomplete."
    return f"## Results\n\nMeasured by the run{where}.\n\n" + _table(("figure", "value"), rows) + note


def _preference_rows(summary: dict) -> list[tuple]:
    rows = []
    for figure in PREFERENCE_FIGURES:
        for prefix, label in (("", "train"), ("eval_", "eval")):
            value = summary.get(f"{prefix}{figure}_final")
            if value is not None:
                rows.append((f"{figure.replace('_', ' ')} ({label}, final)", value))
    return rows


def _evaluation_section(evaluation: dict) -> str | None:
    """What `workbench evaluate` stored in run.json: the tuned model beside its base."""
    tuned, base = _section(evaluation, "tuned"), _section(evaluation, "base")
    figures = [k for k in EVALUATE_FIGURES if tuned.get(k) is not None or base.get(k) is not None]
    if not figures:
        return None
    rows = [(k, base.get(k), tuned.get(k)) for k in figures]
    what = "pairs" if "preference_accuracy" in figures or objective_of(evaluation.get("objective")).scores_sequences \
        else "rows"
    intro = (f"`workbench evaluate` on {evaluation.get('rows')} {what} of {_code(evaluation.get('data'))}"
             f" (after step {evaluation.get('run_steps')}).")
    return f"## Evaluation\n\n{intro}\n\n" + _table(("figure", "base", "tuned"), rows)


def _recipe_section(run_path: Path) -> str | None:
    try:
        text = (run_path / "recipe.yaml").read_text()
    except OSError:
        return None
    return f"## Recipe\n\nThe complete recipe (`recipe.yaml`) of the run:\n\n```yaml\n{text.rstrip()}\n```"


def _loading_section(recipe: dict, kind: str, repo_id: str | None) -> str:
    where = _literal(repo_id or "path/to/this/folder")
    if not _objective(recipe, {}).generates:
        return _reward_loading_section(recipe, kind, where)
    if kind == "merged" or _is_full(recipe):
        code = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f"model = AutoModelForCausalLM.from_pretrained({where})\n"
                f"tokenizer = AutoTokenizer.from_pretrained({where})")
        return f"## Use it\n\nA plain transformers model (no peft needed):\n\n```python\n{code}\n```"
    model = _section(recipe, "model")
    path, options = model.get("path", ""), _hub_options(model)
    builtin = isinstance(path, str) and path.startswith("builtin:")
    base_line = (f"base = AutoModelForCausalLM.from_pretrained(resolve_model_path({_literal(path)}){options})" if builtin
                 else f"base = AutoModelForCausalLM.from_pretrained({_literal(path)}{options})")
    code = ("from peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            + ("from workbench.model.loading import resolve_model_path  # builds the builtin base model\n" if builtin else "")
            + f"\n{base_line}\nmodel = PeftModel.from_pretrained(base, {where})\n"
            f"tokenizer = AutoTokenizer.from_pretrained({where})  # the tokenizer training used")
    text = f"## Use it\n\nLoad the base model, then the adapter on top of it with peft:\n\n```python\n{code}\n```"
    if _section(recipe, "adapter").get("method") == "qlora":
        text += ("\n\nThe adapter was trained on quantized base weights; it loads onto the unquantized base as "
                 "above (pass a `BitsAndBytesConfig` to quantize it again). `workbench merge` folds it in.")
    rope = model.get("rope_scaling")
    if isinstance(rope, dict):
        text += ("\n\nThe adapter was trained with"
                 f" the base's positions stretched ({_code(rope.get('type'))} RoPE "
                 f"scaling, factor {rope.get('factor')}): load the base with the same `rope_parameters` in its "
                 "config (`workbench.model.loading.load_config` writes them), or the tuned model differs from the one "
                 "trained. A merged model (`workbench merge`) carries them in its config.")
    return text


# -- small helpers ----------------------------------------------------------------------------


def _code(value) -> str:
    """An inline code span whatever the text holds: one line, fenced by more backticks than it contains."""
    text = " ".join(str(value).splitlines())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence} {text} {fence}" if fence != "`" or text.startswith("`") or text.endswith("`") else f"`{text}`"


def _literal(value) -> str:
    """A Python string literal of any text, for the snippets."""
    return json.dumps(str(value))


def _section(data: dict, name: str) -> dict:
    value = data.get(name) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}


def _is_full(recipe: dict) -> bool:
    return _section(recipe, "adapter").get("method") == "full"


def _objective(recipe: dict, summary: dict) -> Objective:
    return objective_of(summary.get("objective") or _section(recipe, "training").get("objective"))


def _method_name(recipe: dict) -> str:
    adapter = _section(recipe, "adapter")
    name = {"lora": "LoRA", "qlora": "QLoRA", "dora": "DoRA"}.get(adapter.get("method"), str(adapter.get("method")))
    return name + (" (rank-stabilised)" if adapter.get("rslora") else "")


def _scaling(adapter: dict) -> str | None:
    r, alpha = adapter.get("r"), adapter.get("alpha")
    if not isinstance(r, (int, float)) or not isinstance(alpha, (int, float)) or r <= 0:
        return None
    if adapter.get("rslora"):
        return f"alpha / sqrt(r) = {alpha / r ** 0.5:.4g}"
    return f"alpha / r = {alpha / r:.4g}"


def _modules(value) -> str | None:
    if isinstance(value, list):
        return ", ".join(f"{_code(v)}" for v in value)
    return f"{_code(value)}" if value else None


def _share(part, whole) -> str | None:
    if not isinstance(part, int):
        return None
    return f"{part} of {whole} ({100 * part / whole:.2f} %)" if isinstance(whole, int) and whole else str(part)


def _base_name(recipe: dict) -> str:
    return str(_section(recipe, "model").get("path") or "unknown")


def _base_note(base: str) -> str:
    if base.startswith("builtin:"):
        return " (built on the machine by lora-workbench, not a hub model)"
    if hub_model_id(base) is None:
        return " (a local folder: name the hub model it came from in `base_model` above)"
    return ""


def _hub_options(model: dict) -> str:
    options = ""
    if model.get("revision"):
        options += f", revision={_literal(model['revision'])}"
    if _says_yes(model.get("trust_remote_code")):
        options += ", trust_remote_code=True"
    return options


def _says_yes(value) -> bool:
    """A recipe flag as the schema reads it (the text "no" is False; bool("no") would be True)."""
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return False


def _folder_dtype(folder: Path) -> str | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


def _digest(fingerprint) -> str | None:
    if isinstance(fingerprint, str) and fingerprint.startswith(HUB_DATA_PREFIX):
        return f"hub data set (datasets fingerprint {_code(fingerprint.rsplit(':', 1)[-1])})"
    return f"{_code(fingerprint)}" if fingerprint else None


def _hub_data_id(recipe: dict, summary: dict, role: str) -> str | None:
    """A data path that is a hub data set id, for the card's `datasets` (local files are not listed)."""
    path = _section(recipe, "data").get(role)
    fingerprint = summary.get(f"{role}_sha256")
    if not isinstance(path, str) or not path:
        return None
    if isinstance(fingerprint, str):
        return path if fingerprint.startswith(HUB_DATA_PREFIX) else None
    return _hub_data_name(path)


def _valid_repo_id(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _eval_results(recipe: dict, summary: dict, evaluation: dict) -> list[dict]:
    """model-index results: the run's final held-out figures, and `workbench evaluate`'s tuned scores."""
    data = _section(recipe, "data")
    train = data.get("train")
    if isinstance(train, list):  # a mix: its sources' paths
        train = " + ".join(str(source.get("path")) for source in train if isinstance(source, dict))
    held_out = data.get("eval") or (train if data.get("eval_split") else None)
    results = []
    if held_out:
        figures = {"loss": summary.get("eval_loss_final"), "reward_accuracy": summary.get("eval_reward_accuracy_final"),
                   "reward_margin": summary.get("eval_reward_margin_final")}
        name = held_out if data.get("eval") else f"{held_out} (held out)"
        results.append(_result(str(held_out), name, figures, "eval", _pipeline(recipe)))
    tuned = _section(evaluation, "tuned")
    if tuned and evaluation.get("data"):
        figures = {EVALUATE_FIGURES[k]: tuned.get(k) for k in EVALUATE_FIGURES}
        results.append(_result(str(evaluation["data"]), str(evaluation["data"]), figures, "workbench evaluate",
                               _pipeline(recipe)))
    return [r for r in results if r["metrics"]]


def _result(dataset: str, name: str, figures: dict, source: str, task: dict) -> dict:
    """One model-index result: the hub wants a dataset type (a hub id; for a file, its format) and name."""
    kind = _hub_data_name(dataset) or Path(dataset).suffix.lstrip(".").replace("jsonl", "json")
    metrics = [{"type": metric, "value": value, "name": f"{metric.replace('_', ' ')} ({source})"}
               for metric, value in figures.items() if isinstance(value, (int, float)) and not isinstance(value, bool)]
    return {"task": task, "dataset": {"name": name, "type": kind or "local"}, "metrics": metrics}


def _pipeline(recipe: dict) -> dict:
    """The hub's task: a reward model classifies (scores) text, every other run generates it."""
    if not _objective(recipe, {}).generates:
        return {"type": "text-classification", "name": "Text Classification"}
    return {"type": "text-generation", "name": "Text Generation"}


def _hub_data_name(text: str) -> str | None:
    local = text.startswith((".", "/", "~")) or Path(text).suffix.lower() in FILE_SUFFIXES or Path(text).exists()
    return None if local or not _valid_repo_id(text) else text


def _measured_on(summary: dict, env: dict) -> str:
    devices = env.get("devices") if isinstance(env.get("devices"), list) else []
    parts = [f"on {', '.join(sorted(set(map(str, devices))))}"] if devices else []
    if summary.get("world_size"):
        parts.append(f"{summary['world_size']} process{'es' if summary['world_size'] != 1 else ''}")
    if summary.get("strategy"):
        parts.append(f"strategy {summary['strategy']}")
    if summary.get("peak_memory_kind"):
        parts.append(f"peak memory as {summary['peak_memory_kind']}")
    return f" ({', '.join(parts)})" if parts else ""


def _first(*values):
    return next((v for v in values if v is not None), None)


def _table(header: tuple, rows: list[tuple]) -> str:
    """A Markdown table of the rows whose values are known."""
    kept = [row for row in rows if any(v is not None for v in row[1:])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in kept]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value).replace("|", "\\|")
