"""Every refused combination of the compatibility matrix is refused, with what to change."""

import pytest
from transformers import LlamaConfig

from workbench import Recipe, RecipeError
from workbench.spec.compat import check_runtime


@pytest.mark.parametrize("data, message", [
    ({"adapter": {"method": "lora"}, "quantization": {}}, "quantization: only used with adapter.method: qlora or dora"),
    ({"adapter": {"method": "full"}, "quantization": {}}, "quantization: only used with adapter.method: qlora or dora"),
    ({"adapter": {"method": "full", "modules_to_save": ["lm_head"]}}, "adapter.modules_to_save: has no meaning"),
    ({"adapter": {"method": "full", "rslora": True}}, "adapter.rslora: only applies to LoRA"),
    ({"data": {"eval": "x.jsonl", "eval_split": 0.1}}, "data.eval_split: set either"),
    ({"training": {"mixed_precision": "fp16"}, "model": {"dtype": "bfloat16"}},
     "training.mixed_precision: fp16 autocast over bfloat16"),
    ({"training": {"gradient_checkpointing": True},
      "distributed": {"strategy": "fsdp", "fsdp": {"activation_checkpointing": True}}},
     "distributed.fsdp.activation_checkpointing: training.gradient_checkpointing is already on"),
    ({"adapter": {"method": "qlora"}, "quantization": {"bits": 8}, "distributed": {"strategy": "fsdp"}},
     "quantization.bits: 8-bit weights cannot be sharded"),
    ({"adapter": {"method": "qlora"}, "model": {"dtype": "bfloat16"}, "distributed": {"strategy": "fsdp"}},
     "quantization.quant_storage: sharding 4-bit weights needs them stored as the model dtype; "
     "set quantization.quant_storage: bfloat16"),
    ({"adapter": {"method": "qlora"}, "distributed": {"strategy": "fsdp"}},  # auto dtype: uint8 never matches
     "quantization.quant_storage: sharding 4-bit weights needs them stored as the model dtype; "
     "set model.dtype and quantization.quant_storage to the same dtype"),
    ({"adapter": {"method": "qlora"}, "distributed": {"strategy": "deepspeed", "deepspeed": {"stage": 3}}},
     "quantization.quant_storage: sharding 4-bit weights"),
    ({"training": {"optimizer": "adamw_8bit"}, "distributed": {"strategy": "deepspeed"}},
     "training.optimizer: adamw_8bit is a bitsandbytes optimizer; DeepSpeed needs adamw"),
])
def test_refused_recipes(data, message):
    with pytest.raises(RecipeError) as err:
        Recipe.from_dict(data)
    assert message in str(err.value)


@pytest.mark.parametrize("data", [
    {"adapter": {"method": "qlora"}},
    {"adapter": {"method": "dora"}, "quantization": {}},  # QDoRA
    {"adapter": {"method": "qlora"}, "quantization": {"quant_storage": "bfloat16"}, "distributed": {"strategy": "fsdp"}},
    {"training": {"mixed_precision": "fp16"}, "model": {"dtype": "float16"}},
])
def test_allowed_recipes(data):
    Recipe.from_dict(data)


def small_config(**kw):
    return LlamaConfig(**{"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4,
                          "num_key_value_heads": 2, **kw})


@pytest.mark.parametrize("data, device, config, message", [
    ({"training": {"mixed_precision": "fp16"}, "model": {"dtype": "float16"}}, "cpu", small_config(),
     "training.mixed_precision: fp16 needs a GPU"),
    ({"training": {"activation_offloading": True}}, "cpu", small_config(),
     "training.activation_offloading: moves activations from GPU to CPU memory"),
    ({"adapter": {"method": "qlora"}}, "cpu", small_config(hidden_size=96, num_attention_heads=3),
     "quantization: 4-bit layers on a CPU need widths that are multiples of 64, this model has hidden_size=96"),
])
def test_refused_at_runtime(data, device, config, message):
    with pytest.raises(RecipeError, match=message):
        check_runtime(Recipe.from_dict(data), device, config)


def test_allowed_at_runtime():
    check_runtime(Recipe.from_dict({"adapter": {"method": "qlora"}}), "cpu", small_config())
    check_runtime(Recipe.from_dict({"adapter": {"method": "qlora"}}), "cuda", small_config(hidden_size=96,
                                                                                           num_attention_heads=3))
