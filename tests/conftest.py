import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.chdir(ROOT)  # recipes name their data relative to the project root
# Tests that compare numbers between runs pin float32; tests that merely train keep the recipes' `auto`.
FP32 = ("model.dtype=float32", "training.mixed_precision=no")


@pytest.fixture
def tiny_recipe(tmp_path):
    """The tiny recipe, writing into a temporary folder, small enough for a test (no dropout). float32 on
    every CPU, not the recipe's `auto`: tests built on it compare runs to tight tolerances."""
    from workbench import Recipe

    return Recipe.load(ROOT / "recipes/tiny.yaml").override(
        f"output.dir={tmp_path}/{{name}}", "output.save_every=null", "output.eval_every=null",
        "output.log_every=1", "training.threads=1", *FP32,
    )


@pytest.fixture(scope="session")
def tiny_path():
    from workbench.base.builtin import resolve_builtin

    return resolve_builtin("builtin:tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def tiny_bf16_path(tiny_path, tmp_path_factory):
    """builtin:tiny published in bfloat16, as Llama 3 and SmolLM2 are (its tokenizer and configs beside)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-bf16")
    for item in Path(tiny_path).iterdir():
        if item.is_file() and item.suffix not in (".safetensors", ".bin") and not item.name.endswith(".index.json"):
            shutil.copy(item, folder / item.name)
    AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.bfloat16).save_pretrained(folder)
    return folder


# Precision decisions of the two CPU kinds this suite runs on (workbench/hardware/precision.py decides by measured matmul
# rates, which PROBE_ENV injects): tests marked `both_precisions` run under each, on whatever CPU runs them, so a
# CPU of one kind catches what the other would see.
PRECISION_DECISIONS = {
    "bf16-native": "bf16=400,fp32=100",  # AVX-512 BF16 / AMX: bf16 matmuls 4x faster, `auto` trains in bf16
    "fp32-only": "bf16=0.8,fp32=39",  # AVX2 only: bf16 matmuls 50x slower, `auto` trains in float32
}


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("both_precisions"):
        metafunc.fixturenames.append("cpu_precision")
        metafunc.parametrize("cpu_precision", list(PRECISION_DECISIONS), indirect=True)


@pytest.fixture
def cpu_precision(request, monkeypatch):
    """The CPU precision decision a `both_precisions` test runs under (child processes inherit it)."""
    from workbench.hardware.probes import PROBE_ENV

    monkeypatch.setenv(PROBE_ENV, PRECISION_DECISIONS[request.param])
    return request.param
