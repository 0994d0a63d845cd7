"""What a finished run gives: evaluation, chat, merged models, GGUF files, model hub uploads and data previews."""
