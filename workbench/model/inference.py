"""Use what a run produced: load it (or any model) for inference, check its adapter, generate text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workbench.base.errors import RecipeError, WorkbenchError, escaped
from workbench.base.quiet import leaves_the_process_as_found, quiet_libraries
from workbench.hardware.current import local_kind
from workbench.hardware.precision import DTYPE_OF, device_half
from workbench.model.loading import load_config, model_class, resolve_model_path, reward_config
from workbench.rundir.runs import load_run
from workbench.spec.chat_templates import TemplateFailure, render_ids

if TYPE_CHECKING:
    from workbench.spec.recipe import Recipe


# -- loading ----------------------------------------------------------------------------------


def inference_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (exact, and generation is short); the GPU's native half type (bf16 or fp16) to fit big models."""
    if device.type != "cuda":
        return torch.float32

    return getattr(torch, DTYPE_OF[device_half("cuda").half])


def load_for_inference(source: str | Path, base: bool = False, device: str | torch.device | None = None,
                       recipe: Recipe | None = None, generates: bool = True):
    """(model, tokenizer) in eval mode from a run directory (its tuned model, or its base with base=True)
    or from a model path (folder, builtin:NAME, hub id).

    The run's base model is the one its recipe names, read through the schema (`Run.checked_recipe`); `recipe`
    stands in for it when the caller has already read and checked that recipe (the UI: paths made absolute).

    A QLoRA run's adapter is applied to the base loaded unquantized, as `merge` does. A reward model's run
    (training.objective: reward) loads as the sequence classifier it trained, for callers that score
    (generates=False); one that would generate is refused.
    """
    from transformers import AutoModelForCausalLM

    quiet_libraries()
    device = torch.device(device if device is not None else local_kind())
    dtype = inference_dtype(device)
    source = Path(source)
    if not (source / "run.json").exists():
        path = resolve_model_path(str(source))
        refuse_classifier(path, source)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return model.to(device).eval(), tokenizer_of(path)

    run = load_run(source)
    full_model = run.dir.model
    if not base and full_model.exists():  # full fine-tuning saved the whole model
        model = AutoModelForCausalLM.from_pretrained(full_model, dtype=dtype)
        return model.to(device).eval(), tokenizer_of(full_model)
    recipe = recipe if recipe is not None else run.checked_recipe()
    model_cfg = recipe.model
    base_path = resolve_model_path(model_cfg.path)
    options = hub_options(model_cfg)
    if recipe.training.scores_sequences:
        if generates:
            raise WorkbenchError(f"{source}: a reward model (training.objective: reward) scores answers and writes "
                                 f"none; `workbench evaluate {source}` scores held-out pairs with it")
        options["config"] = reward_config(recipe, options.get("config"))
    model = model_class(recipe).from_pretrained(base_path, dtype=dtype, **options).to(device)
    # The adapter folder holds the tokenizer training used (pad token included): prefer it.
    tokenizer = tokenizer_of(run.adapter_dir if (run.adapter_dir / "tokenizer_config.json").exists() else base_path)
    if not base:
        check_adapter(source, run.adapter_dir)
        model = load_adapter(model, run.adapter_dir)
    return model.eval(), tokenizer


def refuse_classifier(path: str, source) -> None:
    """A model folder that holds a classifier (a merged reward model): loading it as a language model would draw a
    random LM head and write noise."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return
    if any(str(name).endswith(("ForSequenceClassification", "ForTokenClassification")) for name in architectures):
        raise WorkbenchError(f"{source}: holds a classifier ({architectures[0]}), such as a merged reward model; it "
                             "scores text and writes none")


def check_adapter(source, adapter_dir: Path) -> None:
    """One line, not a traceback, for a run with no adapter or a damaged one."""
    if not adapter_dir.is_dir():
        raise WorkbenchError(f"{escaped(source)}: the run has no adapter/ (did it finish?)")
    missing = [name for name in ("adapter_config.json", "adapter_model.safetensors")
               if not (adapter_dir / name).is_file()]
    if missing:
        raise WorkbenchError(f"{adapter_dir}: damaged adapter ({', '.join(missing)} missing); resume the run from "
                             "its last checkpoint (--resume) to write it again")
    config = adapter_dir / "adapter_config.json"
    try:
        if not isinstance(json.loads(config.read_text(encoding="utf-8")), dict):
            raise ValueError("not a mapping")
    except (OSError, ValueError) as err:
        raise WorkbenchError(f"{config}: damaged adapter (not a readable JSON mapping: {err}); {DAMAGED_ADVICE}") \
            from None
    check_weights(adapter_dir / "adapter_model.safetensors")
    check_adapter_config(config, adapter_dir / "adapter_model.safetensors")


def check_adapter_config(config_file: Path, weights: Path) -> None:
    """An adapter_config.json that peft can build a config from, whose rank is the rank of the saved weights:
    one line naming the file and what is wrong, not peft's KeyError or a page of shape mismatches."""
    from peft import PeftConfig
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    from safetensors import safe_open

    def damaged(reason: str) -> WorkbenchError:
        return WorkbenchError(f"{config_file}: damaged adapter ({reason}); {DAMAGED_ADVICE}")

    data = json.loads(config_file.read_text(encoding="utf-8"))
    peft_type = data.get("peft_type")
    if peft_type is None:
        raise damaged("no peft_type: not a PEFT adapter config")
    if not isinstance(peft_type, str) or peft_type not in PEFT_TYPE_TO_CONFIG_MAPPING:
        raise damaged(f"unknown peft_type {peft_type!r}")
    try:
        config = PeftConfig.from_pretrained(str(config_file.parent))
    except Exception as err:  # peft refuses a bad value in many ways (TypeError, ValueError, ...)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise damaged(f"peft cannot read it as a {peft_type} config: {first}") from None
    rank = getattr(config, "r", None)
    if peft_type != "LORA" or not isinstance(rank, int) or getattr(config, "rank_pattern", None):
        return  # per-module ranks: the load itself checks them (load_adapter)
    with safe_open(weights, framework="pt") as handle:
        for key in handle.keys():
            if key.endswith(".lora_A.weight") or key.endswith(".lora_B.weight"):
                saved = handle.get_slice(key).get_shape()[0 if key.endswith(".lora_A.weight") else 1]
                if saved != rank:
                    raise damaged(f"r is {rank} but {weights.name} holds rank-{saved} weights ({key})")


DAMAGED_ADVICE = "restore it from a copy, or train the run again (--overwrite)"


def check_weights(file: Path) -> None:
    """A safetensors file whose header reads and whose data covers what the header lists (a truncated copy,
    a disk that filled up, a download cut short fail here): one line naming it, before anything is loaded."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as handle:
            handle.keys()
    except (SafetensorError, OSError) as err:
        reason = str(err).removeprefix("Error while deserializing header: ")
        raise WorkbenchError(f"{file}: damaged adapter (not a complete safetensors file: {reason}); "
                             f"{DAMAGED_ADVICE}") from None


def load_adapter(model, adapter_dir: Path):
    """The PEFT adapter on `model`; weights that cannot be read are one line naming the file."""
    from peft import PeftModel
    from safetensors import SafetensorError

    try:
        return PeftModel.from_pretrained(model, adapter_dir)
    except RuntimeError as err:  # weights of other shapes than the model's: another base, an edited config
        if "size mismatch" not in str(err):
            raise
        first = next(line.strip() for line in str(err).splitlines() if "size mismatch" in line)
        raise WorkbenchError(f"{adapter_dir / 'adapter_model.safetensors'}: damaged adapter (it does not fit the "
                             f"base model: {first.rstrip('.')}); {DAMAGED_ADVICE}") from None
    except SafetensorError as err:
        raise WorkbenchError(f"{adapter_dir / 'adapter_model.safetensors'}: damaged adapter ({err}); "
                             f"{DAMAGED_ADVICE}") from None


def tokenizer_of(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding never reaches the output: reusing EOS is safe
    return tokenizer


def hub_options(model_cfg) -> dict:
    """from_pretrained's options for a run's base, from the recipe's validated model section (never the raw YAML,
    where bool("no") is True): its revision, remote code, and the config its model.rope_scaling stretched."""
    options = {"revision": model_cfg.revision, "trust_remote_code": model_cfg.trust_remote_code is True}
    if model_cfg.rope_scaling is not None:
        options["config"] = load_config(model_cfg)
    return options


def stop_token_ids(model, tokenizer) -> list[int]:
    """The tokenizer's EOS plus any the generation config names (chat models often have several)."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(i for i in ids if i is not None))


# -- generation -------------------------------------------------------------------------------


@dataclass
class Answer:
    text: str
    ended: bool  # the model stopped with an end-of-sequence token within the token budget


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 64, chat: bool | None = None) -> str:
    """Greedy answer to one prompt; the chat template is used when the tokenizer has one."""
    return answer(model, tokenizer, prompt, max_new_tokens, chat).text


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation rendered with the tokenizer's chat template for the model to answer; a template that runs
    past its budget or fails (a run's template is a file anyone may have written) is one line, not a hung server
    or a traceback."""
    try:
        return render_ids(tokenizer, messages, add_generation_prompt=True)
    except TemplateFailure as err:
        raise WorkbenchError(f"the model's chat template cannot render this conversation: {err}") from None


@torch.no_grad()
def answer(model, tokenizer, prompt: str, max_new_tokens: int = 64, chat: bool | None = None) -> Answer:
    """generate_text's answer, and whether the model ended it itself (a tuned model that never stops
    has not learned its chat template's end of turn)."""
    chat = bool(tokenizer.chat_template) if chat is None else chat
    if chat:
        ids = torch.tensor([prompt_ids(tokenizer, [{"role": "user", "content": prompt}])])
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    device = next(model.parameters()).device
    ids = ids.to(device)
    was_training = model.training
    model.eval()
    stops = stop_token_ids(model, tokenizer)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=stops)
    model.train(was_training)
    new = out[0, ids.shape[1]:].tolist()
    return Answer(tokenizer.decode(new, skip_special_tokens=True).strip(), any(t in stops for t in new))


@leaves_the_process_as_found
def generate(source: str | Path, prompt: str, base: bool = False, max_new_tokens: int = 64,
             recipe: Recipe | None = None) -> str:
    """Answer a prompt with a run's tuned model (or its base), or with any model path (`recipe`: see
    `load_for_inference`)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise RecipeError(f"--max-new-tokens: must be a positive whole number, got {max_new_tokens!r}")
    model, tokenizer = load_for_inference(source, base=base, recipe=recipe)
    return generate_text(model, tokenizer, prompt, max_new_tokens=max_new_tokens)
