"""Chat with a run's tuned model (or its base, or any model) in the terminal, answers streamed.

    python -m workbench.outputs.chat runs/quickstart [--base] [--max-new-tokens 256] [--system TEXT]

Commands: /reset forgets the conversation, /exit (or Ctrl-D) quits; Ctrl-C stops an answer.
The loop reads and writes the streams it is given, so tests can drive it without a terminal.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TextIO

import torch
from transformers import TextStreamer

from workbench.base.errors import RecipeError, WorkbenchError
from workbench.base.quiet import quiet_libraries
from workbench.model.inference import load_for_inference, prompt_ids, stop_token_ids

PROMPT = "you> "
HELP = "/reset forgets the conversation, /exit or Ctrl-D quits, Ctrl-C stops an answer"


class ChatSession:
    """A conversation with one model: the history, and streamed replies that extend it."""

    def __init__(self, model, tokenizer, system: str | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0):
        self.model, self.tokenizer = model, tokenizer
        self.system, self.max_new_tokens, self.temperature = system, max_new_tokens, temperature
        self.history: list[dict] = []

    def reset(self) -> None:
        self.history = []

    def reply(self, text: str, out: TextIO) -> str:
        """Answer `text`, writing the answer to `out` as it is generated; return it."""
        ids = self._prompt_ids([*self.history, {"role": "user", "content": text}])
        device = next(self.model.parameters()).device
        ids = torch.tensor([ids], device=device)
        greedy = self.temperature <= 0
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": self.temperature}
        stops = stop_token_ids(self.model, self.tokenizer)
        with torch.no_grad():
            generated = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=stops,
                streamer=_Streamer(self.tokenizer, out), **sampling)
        new = generated[0, ids.shape[1]:].tolist()
        answer = self.tokenizer.decode([t for t in new if t not in stops], skip_special_tokens=True).strip()
        # Only a finished exchange enters the history (Ctrl-C during generate never gets here).
        self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        return answer

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation rendered for the model, oldest turns dropped if it would not fit."""
        room = getattr(self.model.config, "max_position_embeddings", None) or 1 << 30
        while True:
            ids = self._render(messages)
            if len(ids) + self.max_new_tokens <= room or len(messages) <= 1:
                return ids
            messages = messages[2:]  # forget the oldest exchange

    def _render(self, messages: list[dict]) -> list[int]:
        if self.system:
            messages = [{"role": "system", "content": self.system}, *messages]
        if self.tokenizer.chat_template:
            return prompt_ids(self.tokenizer, messages)
        # A model without a chat template continues plain text: one line per turn.
        text = "".join(m["content"] + "\n" for m in messages)
        return self.tokenizer(text)["input_ids"]


class _Streamer(TextStreamer):
    """transformers' TextStreamer, writing to a given stream instead of print()."""

    def __init__(self, tokenizer, out: TextIO):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out = out

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text + ("\n" if stream_end else ""))
        self.out.flush()


def read_message(input_stream: TextIO, output: TextIO, prompt: str = PROMPT) -> str | None:
    """One line typed by the user, or None at end of input."""
    if input_stream is sys.stdin and output is sys.stdout and sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - gives input() line editing and history
        except ImportError:
            pass
        try:
            return input(prompt)
        except EOFError:
            output.write("\n")
            return None
    output.write(prompt)
    output.flush()
    line = input_stream.readline()
    if not line:
        output.write("\n")
        return None
    return line.rstrip("\n")


def chat_loop(session: ChatSession, input_stream: TextIO, output: TextIO) -> None:
    """Read messages until /exit or end of input; answer each, streamed, keeping the history."""
    while True:
        try:
            line = read_message(input_stream, output)
        except KeyboardInterrupt:  # Ctrl-C at the prompt: leave quietly
            output.write("\n")
            return
        if line is None:
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            session.reset()
            output.write("(conversation reset)\n")
            continue
        if text.startswith("/"):
            output.write(f"unknown command {text}: {HELP}\n")
            continue
        try:
            session.reply(text, output)
        except KeyboardInterrupt:  # Ctrl-C while answering: drop this answer, keep chatting
            output.write("\n(answer stopped)\n")
        output.flush()


def chat(source: str | Path, base: bool = False, max_new_tokens: int = 256, system: str | None = None,
         temperature: float = 0.0, input_stream: TextIO | None = None, output: TextIO | None = None) -> None:
    """Load a run directory (tuned, or base with base=True) or a model path, then chat with it."""
    input_stream = input_stream or sys.stdin
    output = output or sys.stdout
    if max_new_tokens <= 0:
        raise RecipeError(f"--max-new-tokens: must be positive, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise RecipeError(f"--temperature: must be a finite number, 0 or more, got {temperature}")
    model, tokenizer = load_for_inference(source, base=base)
    what = "base model of " if base else ""
    output.write(f"chatting with the {what}{source} ({HELP})\n")
    chat_loop(ChatSession(model, tokenizer, system, max_new_tokens, temperature), input_stream, output)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench chat", description="chat with a run's tuned model or any model")
    parser.add_argument("source", help="run directory, model folder, builtin:NAME or hub id")
    parser.add_argument("--base", action="store_true", help="the run's base model, without the adapter")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest answer, in tokens")
    parser.add_argument("--system", default=None, help="a system message to start the conversation")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sample")
    return parser


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    args = build_parser().parse_args(argv)
    try:
        chat(args.source, base=args.base, max_new_tokens=args.max_new_tokens, system=args.system,
             temperature=args.temperature)
    except WorkbenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
