"""The UI in a real browser: Debian's Chromium driven by Playwright for Python.

Starts the app on 127.0.0.1 (free port) over a temporary workspace holding a copy of recipes/, then
edits a field and watches the YAML follow, edits the YAML and watches the form follow, launches a tiny
run, waits for it, finds it in Compare with its figures and asks it a question in Chat. A screenshot of
each tab is saved under $WORKBENCH_ARTIFACTS/ui/ (default: the test's tmp_path/ui/).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
RUN_TIMEOUT_MS = 180_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install it with `apt-get install -y chromium`")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright for Python is not installed")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("gradio")
    from ui.app import launch

    root = tmp_path_factory.mktemp("workspace")
    shutil.copytree(ROOT / "recipes", root / "recipes")
    port = _free_port()
    demo = launch("127.0.0.1", port, None, root, block=False)
    yield f"http://127.0.0.1:{port}/", root
    demo.close()


@pytest.fixture
def shots(tmp_path) -> Path:
    folder = Path(os.environ.get("WORKBENCH_ARTIFACTS") or tmp_path) / "ui"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _open(browser, url):
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.set_default_timeout(30_000)
    page.goto(url)
    page.wait_for_selector("#recipe-yaml .cm-content")  # the code editor loads last
    return page


def _type(page, selector: str, text: str) -> None:
    """Real keystrokes: Gradio's `input` event follows the user's typing (page.fill does not fire it)."""
    page.click(selector)
    page.keyboard.press("Control+A")
    page.keyboard.type(text, delay=20)


def _choose(page, selector: str, value: str) -> None:
    page.click(selector)
    page.keyboard.type(value, delay=10)
    page.keyboard.press("Enter")
    page.keyboard.press("Escape")


def _wait_text(page, selector: str, text: str, timeout: float = 30_000) -> None:
    page.wait_for_function(
        "([sel, text]) => { const el = document.querySelector(sel); return !!el && el.innerText.includes(text); }",
        arg=[selector, text], timeout=timeout)


def _tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def _shot(page, path: Path) -> None:
    page.wait_for_timeout(800)  # let Gradio's loading fades finish
    page.screenshot(path=str(path), full_page=True)


def test_configure_launch_watch_compare_and_chat(browser, served, shots):
    url, root = served
    page = _open(browser, url)
    _shot(page, shots / "1-configure.png")

    # open a recipe, then edit a field: the YAML follows
    _choose(page, "#recipe-choice input", "recipes/tiny.yaml")
    page.click("#load-recipe")
    _wait_text(page, "#recipe-yaml .cm-content", "name: tiny")
    assert page.input_value("#f-adapter-r input") == "8"
    _type(page, "#f-name input", "ui-tiny")
    _wait_text(page, "#recipe-yaml .cm-content", "name: ui-tiny")
    _type(page, "#f-adapter-r input", "0")
    _wait_text(page, "#recipe-status", "adapter.r: Input should be greater than 0")  # the CLI's validator
    _wait_text(page, "#problems-adapter", "adapter.r: Input should be greater than 0")  # inline, in its section
    _shot(page, shots / "2-configure-error.png")
    _type(page, "#f-adapter-r input", "4")
    _wait_text(page, "#recipe-yaml .cm-content", "r: 4")
    _type(page, "#f-training-threads input", "1")  # one torch thread: the browser shares these cores
    _wait_text(page, "#recipe-yaml .cm-content", "threads: 1")
    _wait_text(page, "#recipe-status", "valid recipe")

    # edit the YAML: the form follows
    text = page.inner_text("#recipe-yaml .cm-content").replace("r: 4\n", "r: 6\n", 1)
    page.click("#recipe-yaml .cm-content")
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(text)
    page.wait_for_function("document.querySelector('#f-adapter-r input').value === '6'")
    _shot(page, shots / "3-configure-edited.png")

    # estimate (the estimator may not be part of this version yet: then the tab says so)
    _tab(page, "Estimate")
    page.click("#estimate-btn")
    page.wait_for_function(
        "document.querySelector('#estimate-plot img') || document.body.innerText.includes('not installed')")
    _shot(page, shots / "4-estimate.png")

    # launch, and pick the job up again from a freshly opened page while it runs
    _tab(page, "Train")
    page.click("#launch-btn")
    _wait_text(page, "#train-msg", "launched ui-tiny")
    other = _open(browser, url)
    _tab(other, "Train")
    _wait_text(other, "#job-status", "ui-tiny")
    other.close()
    _wait_text(page, "#job-status", "completed", timeout=RUN_TIMEOUT_MS)
    _wait_text(page, "#job-progress", "/ 20 steps")
    page.wait_for_selector("#loss-plot img")
    page.wait_for_selector("#tps-plot img")
    _shot(page, shots / "5-train.png")
    assert (root / "runs" / "ui-tiny" / "adapter" / "adapter_config.json").exists()

    # compare: the run is listed with its figures
    _tab(page, "Compare")
    _choose(page, "#compare-runs input", "ui-tiny")
    _wait_text(page, "#compare-table", "ui-tiny")
    table = page.inner_text("#compare-table")
    assert "completed" in table and "single" in table and "tokens/s" in table
    page.wait_for_selector("#compare-memory img")
    page.wait_for_selector("#compare-loss img")
    page.click("#export-csv")
    _wait_text(page, "#compare-csv", ".csv")
    _shot(page, shots / "6-compare.png")

    # chat: base and tuned answers side by side
    _tab(page, "Chat")
    _choose(page, "#chat-run input", "ui-tiny")
    _type(page, "#chat-prompt textarea", "What is 2 + 3?")
    page.click("#chat-ask")
    _wait_text(page, "body", "answered with ui-tiny", timeout=60_000)
    _shot(page, shots / "7-chat.png")
    page.close()


def _finished_run(root: Path, name: str, objective: str) -> None:
    """A finished run and the UI's record of the job that made it, written as the trainer and the UI write them."""
    import json
    import time

    from workbench import Recipe

    recipe = "recipes/tiny-dpo.yaml" if objective != "sft" else "recipes/tiny.yaml"
    run = root / "runs" / name
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text(Recipe.load(ROOT / recipe).override(f"name={name}").to_yaml())
    rows = [{"step": s, "loss": 0.7 - 0.05 * s, "tokens_per_s": 900.0} for s in (1, 2, 3, 4)]
    if objective != "sft":
        rows = [{**r, "reward_margin": 0.3 * r["step"], "reward_accuracy": 0.5 + 0.1 * r["step"]} for r in rows]
        rows += [{"step": 4, "eval_loss": 0.5, "eval_reward_margin": 1.17, "eval_reward_accuracy": 0.75}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"status": "completed", "steps": 4, "total_steps": 4, "objective": objective}
    if objective != "sft":
        summary.update(eval_reward_margin_final=1.17, eval_reward_accuracy_final=0.75)
    (run / "run.json").write_text(json.dumps({"env": {}, "summary": summary}))
    job = root / ".workbench-ui" / "jobs" / name
    job.mkdir(parents=True)
    (job / "job.json").write_text(json.dumps({"name": name, "run_dir": f"runs/{name}", "pid": 0,
                                              "command": ["train", f"runs/{name}/recipe.yaml", "--no-progress"],
                                              "started": time.time() - 3600, "log": f".workbench-ui/jobs/{name}/log"}))


def test_a_preference_run_shows_its_reward_plot_and_compare_columns(browser, served, shots):
    url, root = served
    _finished_run(root, "pref-dpo", "dpo")
    _finished_run(root, "pref-sft", "sft")
    page = _open(browser, url)
    _tab(page, "Train")
    _type(page, "#job-choice input", "pref-sft")  # replaces the job the page chose (the latest)
    page.keyboard.press("Enter")
    _wait_text(page, "#job-status", "pref-sft")
    page.wait_for_selector("#loss-plot img")
    assert not page.is_visible("#preference-plot")  # an SFT run: no reward plot
    _type(page, "#job-choice input", "pref-dpo")
    page.keyboard.press("Enter")
    _wait_text(page, "#job-status", "reward margin 1.200")
    page.wait_for_selector("#preference-plot img")
    _shot(page, shots / "8-train-preference.png")

    _tab(page, "Compare")
    _choose(page, "#compare-runs input", "pref-dpo")
    _choose(page, "#compare-runs input", "pref-sft")
    _wait_text(page, "#compare-table", "pref-sft")
    table = page.inner_text("#compare-table")
    assert "objective" in table and "dpo" in table and "eval reward margin (final)" in table and "1.17" in table
    _shot(page, shots / "9-compare-preference.png")
    page.close()


def test_the_data_preview_shows_trained_tokens_lengths_and_truncation(browser, served, shots):
    url, root = served
    page = _open(browser, url)
    page.click("#data-preview .label-wrap")  # the closed accordion
    page.click("#preview-data-btn")
    page.wait_for_selector("#preview-rows mark.wb-trained")
    page.wait_for_selector("#preview-plot img")
    status = page.inner_text("#preview-status")
    assert "200 rows (chat)" in status and "packing:" in status, status
    trained = page.inner_text("#preview-rows mark.wb-trained >> nth=0")
    masked = page.inner_text("#preview-rows .wb-masked >> nth=0")
    assert "<|im_start|>user" in masked and "<|im_start|>" not in trained  # the prompt is masked, the answer not
    _shot(page, shots / "10-configure-data-preview.png")
    page.close()


def _status(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_server_serves_no_workspace_files_and_enforces_auth(served, tmp_path):
    from ui.app import launch

    url, root = served
    for path in (root / "recipes/tiny.yaml", Path("/etc/passwd"), ROOT / "pyproject.toml"):
        assert _status(f"{url}gradio_api/file={path}") in (403, 404), path
    port = _free_port()
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    demo = launch(port=port, auth="ann:secret", root=tmp_path, block=False)
    try:
        assert demo.server_name == "127.0.0.1"  # the default host
        assert _status(f"http://127.0.0.1:{port}/config") == 401
        assert _status(f"http://127.0.0.1:{port}/gradio_api/info") == 401
    finally:
        demo.close()


def test_the_served_app_refuses_a_rebound_host_and_a_foreign_origin(served):
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends Host: evil.example."""
    import http.client
    from urllib.parse import urlsplit

    url, _ = served
    port = urlsplit(url).port

    def status(headers):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/config", headers=headers)
        return connection.getresponse().status

    assert status({}) == 200
    assert status({"Host": "evil.example"}) == 403
    assert status({"Origin": "http://evil.example"}) == 403
