"""What every training process holds before its model, measured in a fresh process:
`python -m workbench.training.runtime_probe` prints {"peak_rss_bytes": N, "deepspeed_bytes": M}: M, what importing
DeepSpeed adds, is held only by runs that use it (probes.cpu_runtime_bytes runs this)."""

from __future__ import annotations

import importlib.util
import json

import datasets
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import workbench.training.entry
from workbench.base.builtin import CHATML_TEMPLATE
from workbench.distributed.accelerator import unwrap
from workbench.hardware.current import peak_rss_bytes, rss_bytes


def main() -> None:
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token="<eos>")
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 8}).map(lambda row: row)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    # Every run unwraps its model, and Accelerate's unwrap imports DeepSpeed where it is installed (~140 MiB).
    unwrap(accelerator, model)
    ids = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    peak, before = peak_rss_bytes(), rss_bytes()
    added = 0
    if importlib.util.find_spec("deepspeed") is not None:
        import deepspeed  # noqa: F401

        added = max(0, rss_bytes() - before)
    print(json.dumps({"peak_rss_bytes": peak, "deepspeed_bytes": added}))


if __name__ == "__main__":
    main()
