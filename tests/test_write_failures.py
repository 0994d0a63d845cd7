"""A write that fails (a full disk, `ulimit -f`) ends the command with one line naming the path and the cause, and
leaves no temporary folder behind. safetensors reports such a write as its own error, which is no OSError."""

import json
import subprocess
import sys

import pytest

from conftest import FP32, ROOT
from workbench import Recipe, train

# The command runs in a child under a file size limit (RLIMIT_FSIZE, what `ulimit -f` sets). SIGXFSZ ignored: a
# write past the limit then fails with EFBIG, as on a full disk, instead of killing the process.
UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
from workbench.base.builtin import resolve_builtin
resolve_builtin("builtin:tiny")  # built and cached before the limit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from workbench.frontends.cli import main
raise SystemExit(main(sys.argv[2:]))
"""
ADAPTER_BYTES_AT_MOST = 64_000  # the tiny adapter's weights are larger, its run files smaller


def under_limit(limit: int, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", UNDER_A_FILE_SIZE_LIMIT, str(limit), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


TRAIN = ["train", str(ROOT / "recipes/tiny.yaml"), "training.max_steps=2", "output.eval_every=null",
         "training.threads=1", "--no-progress", *FP32]


def test_the_final_adapter_save_that_fails_names_the_adapter_and_leaves_no_staging(tmp_path):
    run = tmp_path / "tiny"
    line = one_error_line(under_limit(ADAPTER_BYTES_AT_MOST, *TRAIN, f"output.dir={run}", "output.save_every=null"))
    assert line == f"error: {run / 'adapter'}: cannot write (File too large)"
    assert not (run / ".tmp-adapter").exists() and not (run / "adapter").exists()
    assert json.loads((run / "run.json").read_text())["summary"]["status"] == "failed"


def test_a_checkpoint_that_fails_names_it_and_leaves_no_staging(tmp_path):
    run = tmp_path / "tiny"
    line = one_error_line(under_limit(ADAPTER_BYTES_AT_MOST, *TRAIN, f"output.dir={run}", "output.save_every=1"))
    assert line.startswith(f"error: {run / 'checkpoints' / 'step-1'}: cannot write (")
    assert list((run / "checkpoints").iterdir()) == []


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    recipe = Recipe.load(ROOT / "recipes/tiny.yaml").override(
        f"output.dir={out}/{{name}}", "training.max_steps=2", "output.save_every=null", "output.eval_every=null",
        "training.threads=1", *FP32)
    return train(recipe, progress_bar=False).run_dir


def test_a_merge_that_fails_names_its_output_and_leaves_no_staging(tiny_run, tmp_path):
    out = tmp_path / "merged"
    line = one_error_line(under_limit(1_000_000, "merge", str(tiny_run), "--out", str(out)))
    assert line == f"error: --out: {out}: cannot write (File too large)"
    assert list(tmp_path.iterdir()) == []  # neither the model nor its staging folder


def test_an_export_that_fails_names_its_output_and_leaves_no_staging(tiny_run, tmp_path):
    out = tmp_path / "gguf" / "tiny.gguf"
    line = one_error_line(under_limit(1_000_000, "export", str(tiny_run), "--out", str(out)))
    assert line == f"error: --out: {out}: cannot write (File too large)"
    assert list(tmp_path.iterdir()) == []
