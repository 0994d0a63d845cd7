"""The Gradio workbench UI: configure, estimate, launch, watch and compare runs.

`ui.app.build_app(root)` builds the page, `ui.app.launch(host, port, auth, root)` serves it.
The UI holds no training or estimation logic: it calls the workbench API or spawns the CLI.
"""
