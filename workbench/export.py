"""Use what a run produced: generate text with the tuned (or the base) model."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import WorkbenchError


@torch.no_grad()
def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 64, chat: bool | None = None) -> str:
    """Greedy answer to one prompt; the chat template is used when the tokenizer has one."""
    chat = bool(tokenizer.chat_template) if chat is None else chat
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    device = next(model.parameters()).device
    ids = ids.to(device)
    was_training = model.training
    model.eval()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.train(was_training)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def load_for_inference(source: str | Path, base: bool = False):
    """(model, tokenizer) from a run directory (its adapter, or its base with base=True) or a model path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import resolve_model_path
    from .runs import load_run

    source = Path(source)
    if (source / "run.json").exists():
        run = load_run(source)
        model_path = resolve_model_path(run.recipe["model"]["path"])
        full_model = source / "model"
        if not base and full_model.exists():
            return _load(full_model)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if not base:
            if not run.adapter_dir.exists():
                raise WorkbenchError(f"{source}: the run has no adapter/ (did it finish?)")
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, run.adapter_dir)
        return model, tokenizer
    return _load(resolve_model_path(str(source)))


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def generate(source: str | Path, prompt: str, base: bool = False, max_new_tokens: int = 64) -> str:
    """Answer a prompt with a run's tuned model (or its base), or with any model path."""
    model, tokenizer = load_for_inference(source, base=base)
    return generate_text(model, tokenizer, prompt, max_new_tokens=max_new_tokens)


def merge(run_dir: str | Path, out: str | Path | None = None, dtype: str = "bfloat16") -> Path:
    """Fold a run's adapter into its base model and save a plain transformers folder.

    The base is loaded unquantized in `dtype` even for QLoRA runs: merging into 4-bit weights would
    round the adapter's update away, so a QLoRA adapter merges into the dequantized base.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import DTYPES, resolve_model_path
    from .runs import load_run

    run = load_run(run_dir)
    out = Path(out) if out else run.path / "merged"
    if dtype not in DTYPES:
        raise WorkbenchError(f"--dtype: must be one of {', '.join(DTYPES)}, got {dtype}")
    full_model = run.path / "model"
    if full_model.exists():  # full fine-tuning: the model is already whole
        model = AutoModelForCausalLM.from_pretrained(full_model, dtype=DTYPES[dtype])
        tokenizer = AutoTokenizer.from_pretrained(full_model)
    else:
        if not run.adapter_dir.exists():
            raise WorkbenchError(f"{run.path}: the run has no adapter/ (did it finish?)")
        base_path = resolve_model_path(run.recipe["model"]["path"])
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=DTYPES[dtype])
        model = PeftModel.from_pretrained(base, run.adapter_dir).merge_and_unload()
        tokenizer = AutoTokenizer.from_pretrained(run.adapter_dir)
    staging = out.with_name(out.name + ".tmp")
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    staging.rename(out)
    return out
