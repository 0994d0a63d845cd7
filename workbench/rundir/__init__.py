"""The run directory: its lock and files, the summary, the model card and writes staged beside their target."""
