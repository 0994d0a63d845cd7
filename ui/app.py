"""The Gradio page: Configure · Estimate · Train · Compare · Chat.

    from ui.app import build_app, launch
    launch("127.0.0.1", 7860, None, ".")      # what `workbench ui` calls

Layout and wiring only: what each control does is in ui/handlers.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: no telemetry look-ups

from pathlib import Path  # noqa: E402

import gradio as gr  # noqa: E402
from gradio import processing_utils  # noqa: E402
from gradio.components.plot import PlotData  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from . import form, style  # noqa: E402
from .handlers import SECTIONS, Handlers, status_html  # noqa: E402
from .workspace import Workspace  # noqa: E402

POLL_SECONDS = 2.0


class FigurePlot(gr.Plot):
    """A gr.Plot for any matplotlib Figure: Gradio spots matplotlib by module name, which the charts'
    Figure subclass (workbench.base.charts.WorkbenchFigure) does not carry."""

    is_template = True  # Gradio's mark for a subclass that keeps its parent's front-end component

    def postprocess(self, value):
        if isinstance(value, Figure):
            return PlotData(type="matplotlib", plot=processing_utils.encode_plot_to_base64(value, self.format))
        return super().postprocess(value)


def _skip(values):
    return [gr.skip() if v is form.SKIP else v for v in values]


def _widget(spec: form.FieldSpec, value):
    common = dict(label=spec.label, info=spec.description or None, elem_id="f-" + spec.key.replace(".", "-"),
                  interactive=True, min_width=180)
    value = None if value is form.SKIP else value
    if spec.kind == "dropdown":
        choices = [str(c) for c in spec.choices]
        return gr.Dropdown(choices=choices, value=value, **common)
    if spec.kind == "multiselect":
        return gr.Dropdown(choices=[str(c) for c in spec.choices], value=value or [], multiselect=True, **common)
    if spec.kind in ("checkbox", "toggle"):
        return gr.Checkbox(value=bool(value), **common)
    if spec.kind in ("int", "float") and spec.optional:
        return gr.Textbox(value=value, placeholder="empty: not set", max_lines=1, **common)
    if spec.kind == "int":
        return gr.Number(value=value, precision=0, **common)
    if spec.kind == "float":
        return gr.Number(value=value, step=0.0001 if spec.key == "training.lr" else 0.01, **common)
    placeholder = "comma-separated, or a YAML list [a, b]" if spec.kind in ("list", "str_or_list") else None
    if spec.optional and spec.kind == "text":
        placeholder = "empty: not set"
    return gr.Textbox(value=value, placeholder=placeholder, max_lines=1, **common)


def _form(values: list) -> tuple[dict, dict, dict]:
    """Every recipe field as a widget, one accordion per section: (widgets, accordions, problem boxes)."""
    widgets: dict[str, gr.components.Component] = {}
    accordions: dict[str, gr.Accordion] = {}
    problems: dict[str, gr.HTML] = {}

    def fields_of(prefix: tuple[str, ...]):
        return [(s, v) for s, v in zip(form.FIELDS, values) if s.section == prefix]

    def grid(items, per_row=3):
        toggles = [(s, v) for s, v in items if s.kind == "toggle"]
        for spec, value in toggles:
            widgets[spec.key] = _widget(spec, value)
        rest = [(s, v) for s, v in items if s.kind != "toggle"]
        for i in range(0, len(rest), per_row):
            with gr.Row(equal_height=True):
                for spec, value in rest[i:i + per_row]:
                    widgets[spec.key] = _widget(spec, value)

    for section in SECTIONS[1:]:
        with gr.Accordion(section, open=section in ("model", "adapter", "training")) as acc:
            accordions[section] = acc
            problems[section] = gr.HTML(visible=False, elem_id=f"problems-{section}")
            grid(fields_of((section,)))
            children = sorted({s.section for s in form.FIELDS if len(s.section) == 2 and s.section[0] == section})
            for child in children:
                with gr.Accordion(f"{section}.{child[1]}", open=False):
                    grid(fields_of(child))
    return widgets, accordions, problems


def build_app(root: str | Path = ".", allow_remote_code: bool = False) -> gr.Blocks:
    h = Handlers(root, allow_remote_code)
    defaults = form.widgets_from_dict(form.default_dict())
    first_yaml = form.to_yaml(form.dict_from_widgets(defaults))
    first_status, _ = h.check(form.dict_from_widgets(defaults))

    with gr.Blocks(title="LoRA Workbench", analytics_enabled=False) as demo:
        gr.HTML(style.header(str(h.ws.root)))
        with gr.Tabs():
            # -- Configure ----------------------------------------------------------------------
            with gr.Tab("Configure", id="configure", elem_id="tab-configure"):
                with gr.Row():
                    with gr.Column(scale=3):
                        with gr.Column(elem_classes="wb-panel"):
                            with gr.Row():
                                recipe_dd = gr.Dropdown(label="Open a recipe", value=None, scale=5,
                                                        choices=h.ws.recipe_choices(), elem_id="recipe-choice",
                                                        info="from recipes/, or the resolved recipe of a run")
                                load_btn = gr.Button("Open", scale=1, min_width=90, elem_id="load-recipe",
                                                     elem_classes="wb-inline-btn")
                            with gr.Row():
                                save_path = gr.Textbox(label="Save as", value="recipes/my-recipe.yaml", scale=5,
                                                       info="a .yaml path inside the workspace", elem_id="save-path")
                                save_btn = gr.Button("Save", scale=1, min_width=90, elem_id="save-recipe",
                                                     elem_classes="wb-inline-btn")
                        name_spec = form.FIELDS[0]
                        general = gr.HTML(visible=False, elem_id="problems-general")
                        name_widget = _widget(name_spec, defaults[0])
                        widgets, accordions, problems = _form(defaults)
                        widgets = {name_spec.key: name_widget, **widgets}
                        problems = {"general": general, **problems}
                    with gr.Column(scale=2, elem_classes="wb-sticky"):
                        status = gr.HTML(first_status, elem_id="recipe-status")
                        yaml_code = gr.Code(first_yaml, language="yaml",
                                            label="Recipe YAML (editable, in step with the form)",
                                            lines=30, max_lines=40, interactive=True, elem_id="recipe-yaml")
                with gr.Accordion("Data preview", open=False, elem_id="data-preview"):
                    with gr.Row():
                        gr.Markdown("The training data as the model will see it: the chat template applied, "
                                    "**trained tokens highlighted**, the rest masked; token lengths, truncation and "
                                    "packing.", elem_classes="wb-hint")
                        preview_rows = gr.Number(3, label="rows to show", precision=0, minimum=0,
                                                 maximum=Handlers.PREVIEW_MAX_ROWS, scale=0, min_width=120)
                        preview_btn = gr.Button("Preview data", scale=0, min_width=140, elem_id="preview-data-btn",
                                                elem_classes="wb-inline-btn")
                    preview_status = gr.HTML('<div class="wb-status wb-info">Press Preview data.</div>',
                                             elem_id="preview-status")
                    with gr.Row():
                        preview_rows_html = gr.HTML(elem_id="preview-rows")
                        preview_plot = FigurePlot(label="token lengths", format="png", show_label=False,
                                                  elem_id="preview-plot")
                fields = [widgets[s.key] for s in form.FIELDS]
                marked = [*(accordions[s] for s in SECTIONS[1:]), *(problems[s] for s in SECTIONS)]

                def marks(bad: dict[str, list[str]]):
                    """Inline problems: a ⚠ on the section's accordion and its messages inside it."""
                    labels = [gr.update(label=f"⚠ {s}", open=True) if s in bad else gr.update(label=s)
                              for s in SECTIONS[1:]]
                    boxes = [gr.update(value=status_html("error", "\n".join(bad[s])), visible=True) if s in bad
                             else gr.update(value="", visible=False) for s in SECTIONS]
                    return [*labels, *boxes]

                def on_form(*values):
                    text, html_status, bad = h.form_changed(*values)
                    return [text, html_status, *marks(bad)]

                def on_yaml(text):
                    values, html_status, bad = h.yaml_changed(text)
                    return [*_skip(values), html_status, *marks(bad)]

                def on_load(relative):
                    text, values, html_status, bad = h.load_recipe(relative)
                    return [*_skip([text]), *_skip(values), html_status, *marks(bad)]

                for widget in fields:
                    widget.input(on_form, fields, [yaml_code, status, *marked], trigger_mode="always_last",
                                 show_progress="hidden")
                yaml_code.input(on_yaml, yaml_code, [*fields, status, *marked], trigger_mode="always_last",
                                show_progress="hidden")
                load_btn.click(on_load, recipe_dd, [yaml_code, *fields, status, *marked])
                save_btn.click(lambda p, t: (h.save_recipe(p, t), gr.update(choices=h.ws.recipe_choices())),
                               [save_path, yaml_code], [status, recipe_dd])
                preview_btn.click(h.preview_data, [yaml_code, preview_rows],
                                  [preview_status, preview_rows_html, preview_plot])

            # -- Estimate -----------------------------------------------------------------------
            with gr.Tab("Estimate", id="estimate", elem_id="tab-estimate"):
                with gr.Row():
                    with gr.Column(scale=1, elem_classes="wb-panel"):
                        gr.Markdown("Memory of the recipe on the **Configure** tab, per strategy.",
                                    elem_classes="wb-hint")
                        world = gr.Number(1, label="world size (devices)", precision=0, minimum=1)
                        nodes = gr.Number(1, label="nodes (machines)", precision=0, minimum=1)
                        devices = Handlers.device_choices()
                        device = gr.Dropdown(devices, value=devices[0], label="device", elem_id="estimate-device",
                                             info="a preset, or the device a run here would use")
                        capacity = gr.Number(None, label="device memory (GiB)",
                                             info="0: the device preset's own memory")
                        price = gr.Number(None, label="price ($ per GPU-hour)", info="0: no cost estimate")
                        est_btn = gr.Button("Estimate", variant="primary", elem_id="estimate-btn")
                    with gr.Column(scale=3):
                        est_status = gr.HTML('<div class="wb-status wb-info">Press Estimate.</div>')
                        est_plot = FigurePlot(label="memory per device", format="png", show_label=False,
                                           elem_id="estimate-plot")
                        est_table = gr.Dataframe(label="strategies", interactive=False, elem_classes="wb-table")
                est_btn.click(h.estimate, [yaml_code, world, nodes, device, capacity, price],
                              [est_plot, est_status, est_table])

            # -- Train --------------------------------------------------------------------------
            with gr.Tab("Train", id="train", elem_id="tab-train"):
                with gr.Row():
                    with gr.Column(scale=1, elem_classes="wb-panel"):
                        gr.Markdown("Runs the recipe on the **Configure** tab with the `workbench` CLI. "
                                    "A run keeps going when this page is closed.", elem_classes="wb-hint")
                        nproc = gr.Number(1, label="processes", precision=0, minimum=1,
                                          info="1: workbench train; more: workbench launch --nproc N")
                        replace = gr.Checkbox(False, label="replace the existing run", elem_id="replace-run",
                                              info="a run of this name is deleted first (you are asked to confirm)")
                        launch_btn = gr.Button("Launch", variant="primary", elem_id="launch-btn")
                        job_dd = gr.Dropdown(label="job", choices=h.jobs.names(), elem_id="job-choice")
                        with gr.Row():
                            stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn")
                            resume_btn = gr.Button("Resume", variant="secondary", elem_id="resume-btn")
                        train_msg = gr.HTML(elem_id="train-msg")
                    with gr.Column(scale=3):
                        job_status = gr.HTML(elem_id="job-status")
                        progress = gr.HTML(elem_id="job-progress")
                        with gr.Row():
                            loss_plot = FigurePlot(label="loss", format="png", show_label=False, elem_id="loss-plot")
                            tps_plot = FigurePlot(label="tokens/s", format="png", show_label=False, elem_id="tps-plot")
                            # a preference run's reward margin and accuracy (training.objective dpo/orpo/kto)
                            pref_plot = FigurePlot(label="reward margin and accuracy", format="png", show_label=False,
                                                   elem_id="preference-plot", visible=False)
                        log = gr.Textbox(label="log (tail)", lines=12, max_lines=12, interactive=False,
                                         autoscroll=True, elem_id="job-log", elem_classes="wb-log")
                seen = gr.State(None)
                view_outputs = [job_status, progress, log, loss_plot, tps_plot, pref_plot, seen, stop_btn, resume_btn]

                def on_view(name, last):
                    can_stop, can_resume = h.buttons(name)
                    *shown, preference, signature = h.job_view(name, last)
                    if preference is form.SKIP:
                        preference = gr.skip()
                    else:  # None: not a preference run, so no such plot
                        preference = gr.update(value=preference, visible=preference is not None)
                    return [*_skip(shown), preference, signature, gr.update(interactive=can_stop),
                            gr.update(interactive=can_resume)]

                def on_launch(text, n, replace_run):
                    name, message = h.launch(text, n, replace_run)
                    choices = h.jobs.names()
                    return gr.update(choices=choices, value=name or (choices[0] if choices else None)), message

                launch_btn.click(on_launch, [yaml_code, nproc, replace], [job_dd, train_msg]).then(
                    on_view, [job_dd, gr.State(None)], view_outputs)
                stop_btn.click(h.stop, job_dd, train_msg)
                resume_btn.click(h.resume, job_dd, train_msg)
                job_dd.change(on_view, [job_dd, gr.State(None)], view_outputs)
                timer = gr.Timer(POLL_SECONDS)
                timer.tick(on_view, [job_dd, seen], view_outputs, show_progress="hidden")

            # -- Compare ------------------------------------------------------------------------
            with gr.Tab("Compare", id="compare", elem_id="tab-compare") as compare_tab:
                with gr.Row(elem_classes="wb-panel"):
                    runs_dd = gr.Dropdown(label="runs", choices=h.ws.run_choices(), multiselect=True, scale=4,
                                          info="runs under runs/ in the workspace", elem_id="compare-runs")
                    refresh_btn = gr.Button("Refresh list", scale=1, elem_classes="wb-inline-btn")
                    export_btn = gr.Button("Export CSV", scale=1, elem_id="export-csv", elem_classes="wb-inline-btn")
                compare_msg = gr.HTML()
                table = gr.Dataframe(label="comparison", interactive=False, elem_id="compare-table",
                                     elem_classes="wb-table")
                with gr.Row():
                    mem_plot = FigurePlot(label="peak memory", format="png", show_label=False, elem_id="compare-memory")
                    speed_plot = FigurePlot(label="throughput", format="png", show_label=False, elem_id="compare-speed")
                curves_plot = FigurePlot(label="loss curves", format="png", show_label=False, elem_id="compare-loss")
                csv_file = gr.File(label="CSV export", interactive=False, elem_id="compare-csv")
                runs_dd.change(h.compare, runs_dd, [table, mem_plot, speed_plot, curves_plot, compare_msg])
                export_btn.click(h.export_csv, runs_dd, [csv_file, compare_msg])

            # -- Chat ---------------------------------------------------------------------------
            with gr.Tab("Chat", id="chat", elem_id="tab-chat") as chat_tab:
                with gr.Row(elem_classes="wb-panel"):
                    chat_run = gr.Dropdown(label="run", choices=h.ws.run_choices(with_adapter=True), scale=2,
                                           info="a finished run with an adapter", elem_id="chat-run")
                    max_tokens = gr.Slider(8, 256, value=48, step=8, label="max new tokens", scale=2)
                prompt = gr.Textbox(label="prompt", lines=2, placeholder="Ask both models the same question…",
                                    elem_id="chat-prompt")
                ask_btn = gr.Button("Ask both", variant="primary", elem_id="chat-ask")
                chat_msg = gr.HTML()
                with gr.Row():
                    base_out = gr.Textbox(label="base model", lines=6, interactive=False, elem_id="chat-base")
                    tuned_out = gr.Textbox(label="fine-tuned (base + adapter)", lines=6, interactive=False,
                                           elem_id="chat-tuned")
                ask_btn.click(h.chat, [chat_run, prompt, max_tokens], [base_out, tuned_out, chat_msg])
                prompt.submit(h.chat, [chat_run, prompt, max_tokens], [base_out, tuned_out, chat_msg])

        # -- lists that change while the server runs: refreshed on page load and on tab visits ----
        def run_lists():
            return gr.update(choices=h.ws.run_choices()), gr.update(choices=h.ws.run_choices(with_adapter=True))

        refresh_btn.click(run_lists, None, [runs_dd, chat_run])
        compare_tab.select(run_lists, None, [runs_dd, chat_run])
        chat_tab.select(run_lists, None, [runs_dd, chat_run])

        def on_page_load():
            names = h.jobs.names()  # a reopened page picks up the latest job
            latest = names[0] if names else None
            return (gr.update(choices=h.ws.recipe_choices()), gr.update(choices=names, value=latest), *run_lists())

        demo.load(on_page_load, None, [recipe_dd, job_dd, runs_dd, chat_run])
    return demo


def parse_auth(auth: str | tuple[str, str] | None) -> tuple[str, str] | None:
    """ "USER:PASS" (the password may hold colons) → (user, password); None stays None."""
    if auth is None or isinstance(auth, tuple):
        return auth
    user, sep, password = auth.partition(":")
    if not sep or not user or not password:
        raise ValueError("--auth: expected USER:PASS")
    return user, password


def launch(host: str = "127.0.0.1", port: int = 7860, auth: str | tuple[str, str] | None = None,
           root: str | Path = ".", block: bool = True, allow_remote_code: bool = False) -> gr.Blocks:
    """Serve the UI. `auth` is "USER:PASS" or (user, password); binds 127.0.0.1 unless told otherwise.
    `allow_remote_code`: let recipes set model.trust_remote_code (code from a model repository runs here)."""
    auth = parse_auth(auth)
    from .guard import trusted_proxy

    proxy = trusted_proxy()  # a name there is refused now, not after the server is up
    workspace = Workspace(root)
    if host not in ("127.0.0.1", "localhost", "::1") and auth is None:
        print(f"warning: serving on {host} without --auth: anyone who reaches this address can train, delete "
              "runs and read the workspace; set WORKBENCH_UI_AUTH=USER:PASS", flush=True)
    exports = workspace.ui_folder("exports")  # the only workspace folder Gradio may serve files from (CSV exports)
    demo = build_app(workspace.root, allow_remote_code)
    demo.queue(default_concurrency_limit=4)
    from starlette.middleware import Middleware

    from .guard import Guard, allowed_hosts, allowed_origins, no_forwarded_headers

    # Host/Origin checks and the login back-off; the guard, not uvicorn, decides whose X-Forwarded-For to believe
    guard = Middleware(Guard, hosts=allowed_hosts(host), origins=allowed_origins(), proxy=proxy)
    with no_forwarded_headers():
        demo.launch(server_name=host, server_port=port, auth=auth, share=False, theme=style.THEME, css=style.CSS,
                    allowed_paths=[str(exports)], prevent_thread_lock=True, quiet=True, ssr_mode=False,
                    show_error=True, app_kwargs={"middleware": [guard]})
    if block:
        login = ", login required" if auth else ""
        print(f"LoRA Workbench UI on http://{host}:{demo.server_port}/ (workspace {workspace.root}{login}). "
              "Ctrl-C stops the UI, not the runs it launched.", flush=True)
        demo.block_thread()
    return demo
