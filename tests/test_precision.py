"""`auto` precision: the fastest correct precision for the device, one decision read by every part."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench import Recipe, RecipeError, estimate
from workbench.distributed.accelerator import configure_threads
from workbench.hardware import probes
from workbench.hardware.precision import cpu_half, resolve, resolve_recipe
from workbench.hardware.probes import PROBE_ENV

NO_NATIVE_BF16 = "bf16=0.8,fp32=39"  # an AVX2-only CPU, as measured
NATIVE_BF16 = "bf16=700,fp32=150"  # a CPU with AVX-512 BF16 / AMX


@pytest.fixture
def slow_bf16(monkeypatch):
    monkeypatch.setenv(PROBE_ENV, NO_NATIVE_BF16)


@pytest.fixture
def fast_bf16(monkeypatch):
    monkeypatch.setenv(PROBE_ENV, NATIVE_BF16)


def test_auto_on_a_cpu_without_native_bf16_is_float32(slow_bf16):
    p = resolve(Recipe(), "cpu")
    assert (p.model_dtype, p.mixed_precision) == ("float32", "no")
    assert "no native bf16" in p.reason and "0.8" in p.reason and "39" in p.reason
    assert p.warnings == ()


def test_auto_on_a_cpu_with_native_bf16_is_bf16(fast_bf16):
    p = resolve(Recipe(), "cpu")
    assert (p.model_dtype, p.mixed_precision) == ("bfloat16", "bf16")
    assert "native bf16" in p.reason and p.warnings == ()


def test_auto_on_gpus_follows_their_tensor_cores():
    assert resolve(Recipe(), "cuda", bf16=True).mixed_precision == "bf16"
    old_gpu = resolve(Recipe(), "cuda", bf16=False)
    assert (old_gpu.model_dtype, old_gpu.mixed_precision) == ("float16", "fp16")
    # fp16 autocast trains fp32 master weights: full fine-tuning keeps float32 weights
    full = resolve(Recipe(adapter={"method": "full"}), "cuda", bf16=False)
    assert (full.model_dtype, full.mixed_precision) == ("float32", "fp16")


def test_an_explicit_bf16_on_a_slow_cpu_runs_but_warns_with_the_factor_and_the_fix(slow_bf16):
    p = resolve(Recipe(model={"dtype": "bfloat16"}, training={"mixed_precision": "bf16"}), "cpu")
    assert (p.model_dtype, p.mixed_precision) == ("bfloat16", "bf16")
    (warning,) = p.warnings
    assert "about 49x slower" in warning and "model.dtype=auto training.mixed_precision=auto" in warning


def test_one_explicit_field_decides_the_other(slow_bf16, monkeypatch):
    assert resolve(Recipe(training={"mixed_precision": "no"}), "cpu").model_dtype == "float32"
    assert resolve(Recipe(model={"dtype": "float32"}), "cpu").mixed_precision == "no"
    monkeypatch.setenv(PROBE_ENV, NATIVE_BF16)
    p = resolve(Recipe(model={"dtype": "float32"}), "cpu")  # fp32 master weights, bf16 autocast
    assert (p.model_dtype, p.mixed_precision) == ("float32", "bf16")
    assert resolve(Recipe(training={"mixed_precision": "no"}), "cpu").model_dtype == "float32"


def test_qlora_compute_dtype_follows_the_autocast(slow_bf16, monkeypatch):
    qlora = Recipe(adapter={"method": "qlora"})
    assert resolve(qlora, "cpu").compute_dtype == "float32"
    monkeypatch.setenv(PROBE_ENV, NATIVE_BF16)
    assert resolve(qlora, "cpu").compute_dtype == "bfloat16"
    resolved, _ = resolve_recipe(qlora, "cpu")
    assert resolved.quantization.compute_dtype == "bfloat16" and resolved.model.dtype == "bfloat16"


def test_the_probe_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.delenv(PROBE_ENV, raising=False)
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(probes, "_memo", {})  # nothing measured yet in this process
    half = cpu_half()
    cached = json.loads((tmp_path / "estimator" / "cpu_precision.json").read_text())
    (rates,) = cached.values()
    assert rates["bf16"] > 0 and rates["fp32"] > 0 and "probe" in half.reason
    # the decision is the measurement's: bf16 only where it beats fp32
    assert (half.half == "bf16") == (rates["bf16"] >= 1.2 * rates["fp32"])
    probes._memo.clear()  # a new process: it reads the disk
    assert "cached" in cpu_half().reason


def test_the_mfu_peak_is_probed_at_length_once_then_briefly_and_only_ever_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path))
    timed = []

    def rate(device_type, dtype, size, seconds, repeats=1):
        timed.append(seconds)
        return {1: 100.0, 2: 80.0, 3: 120.0}[len(timed)]

    monkeypatch.setattr(probes, "matmul_rate", rate)
    # the first run of this key times half a second; later ones a tenth, and a low reading never lowers the peak
    assert [probes.matmul_peak("cpu", "float32", 1) for _ in range(3)] == [100.0, 100.0, 120.0]
    assert timed == [0.5, 0.1, 0.1]
    assert list(json.loads((tmp_path / "estimator" / "matmul_peak.json").read_text()).values()) == [120.0]
    for overwritten in ("[]", "null", '{"%s": "fast"}' % next(iter(json.loads(
            (tmp_path / "estimator" / "matmul_peak.json").read_text())))):  # a table someone overwrote
        (tmp_path / "estimator" / "matmul_peak.json").write_text(overwritten)
        timed.clear()
        assert probes.matmul_peak("cpu", "float32", 1) == 100.0 and timed == [0.5]  # measured again, at length


def test_the_estimator_resolves_auto_for_the_device_it_plans_for(slow_bf16):
    recipe = Recipe.load("recipes/tiny.yaml")
    assert estimate(recipe, device="h100").device["precision"]["mixed_precision"] == "bf16"
    assert estimate(recipe, device="t4").device["precision"]["mixed_precision"] == "fp16"
    cpu = estimate(recipe, device="cpu")
    assert cpu.device["precision"]["mixed_precision"] == "no"
    assert "no native bf16" in cpu.device["precision"]["precision_reason"]
    forced = estimate(recipe.override("training.mixed_precision=bf16"), device="cpu")
    assert any("slower than float32" in note for note in forced.notes)


def test_the_launcher_passes_the_resolved_mode(slow_bf16):
    from workbench.distributed.launcher import plan_launch

    plan = plan_launch("recipes/tiny.yaml", nproc=2)
    assert plan.command[plan.command.index("--mixed_precision") + 1] == "no"


SPELLINGS = {"no": "no", "false": "no", "False": "no", "fp32": "no", "FP32": "no", "float32": "no", "none": "no",
             "off": "no", "bf16": "bf16", "bfloat16": "bf16", "BF16": "bf16", "fp16": "fp16", "float16": "fp16",
             "auto": "auto"}


@pytest.mark.parametrize("typed,meant", SPELLINGS.items())
def test_overrides_read_as_a_user_types_them(typed, meant):
    recipe = Recipe.load("recipes/tiny.yaml", [f"training.mixed_precision={typed}"])
    assert recipe.training.mixed_precision == meant


@given(st.sampled_from(sorted(SPELLINGS)), st.sampled_from(["", " "]), st.booleans())
@settings(max_examples=40, deadline=None)
def test_precision_spellings_fuzzed(typed, pad, upper):
    text = pad + (typed.upper() if upper else typed) + pad
    assert Recipe.load("recipes/tiny.yaml", [f"training.mixed_precision={text}"]).training.mixed_precision \
        == SPELLINGS[typed]


@given(st.text(min_size=1, max_size=12).filter(lambda t: t.strip().lower() not in
                                                {s.lower() for s in SPELLINGS} | {"null", "~", "half", "full"}))
@settings(max_examples=60, deadline=None)
def test_unknown_precisions_name_the_field(text):
    with pytest.raises(RecipeError, match="training.mixed_precision"):
        Recipe.from_dict({"training": {"mixed_precision": text}})


def test_dtype_spellings():
    assert Recipe.load("recipes/tiny.yaml", ["model.dtype=bf16"]).model.dtype == "bfloat16"
    assert Recipe.load("recipes/tiny.yaml", ["model.dtype=fp32"]).model.dtype == "float32"


def test_threads_respect_omp_num_threads_and_say_why(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert configure_threads(None) == (1, "OMP_NUM_THREADS")
        assert configure_threads(2) == (2, "training.threads")
        monkeypatch.delenv("OMP_NUM_THREADS")
        threads, why = configure_threads(None)
        assert threads >= 1 and "cores" in why
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_a_run_records_its_precision_and_the_warning(tiny_recipe, monkeypatch):
    from workbench import train

    monkeypatch.setenv(PROBE_ENV, NO_NATIVE_BF16)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    auto = train(tiny_recipe.override("training.max_steps=2", "training.threads=null", "model.dtype=auto",
                                      "training.mixed_precision=auto"), progress_bar=False)
    s = auto.summary
    assert (s["model_dtype"], s["mixed_precision"]) == ("float32", "no")
    assert "no native bf16" in s["precision_reason"] and s["warnings"] == []
    assert (s["threads"], s["threads_reason"]) == (1, "OMP_NUM_THREADS")
    saved = Recipe.load(auto.run_dir / "recipe.yaml")  # the run saves what it ran
    assert (saved.model.dtype, saved.training.mixed_precision) == ("float32", "no")

    forced = train(tiny_recipe.override("name=forced", "training.max_steps=2", "model.dtype=auto",
                                        "training.mixed_precision=bf16"),
                   progress_bar=False)
    s = forced.summary
    assert (s["model_dtype"], s["mixed_precision"]) == ("bfloat16", "bf16")
    assert any("about 49x slower than float32" in w for w in s["warnings"])
