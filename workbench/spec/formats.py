"""The data formats: one registry that loading, tokenization, evaluation, preflight, the UI and the docs read.

A format declares the fields that identify it, an example row, how a row is checked (a `DataError` naming
the file and line), how it renders into text segments (each either learned from or masked), and what
evaluation reads from it (the question and its reference answer). Adding a format means adding one
`DataFormat` here; nothing elsewhere branches on format names.

Instruction formats render one sequence: a list of `(text, is_answer)` segments. The `preference` format
renders two sequences that share a prompt, the chosen and the rejected answer (`pair`). The `unpaired` format
(KTO's rows) holds one answer and a label saying whether it is desirable (`unpaired_row`); training pairs it
with another row's answer to the same prompt, the mismatched sample KTO estimates its KL term from. The `prompts`
format (GRPO's rows) holds only a prompt: the answers are sampled during training and scored by reward functions,
which may read the row's other columns (e.g. `answer`).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

from workbench.base.errors import DataError, ModelError
from workbench.spec import chat_templates

ALPACA_PROMPT = "Below is an instruction that describes a task. Write a response that completes the request.\n\n"
ROLES = ("system", "user", "assistant")

Segments = list[tuple[str, bool]]  # (text, is_answer): answers carry the loss (data.train_on: completions)


# -- fields -------------------------------------------------------------------------------------


def text_field(row: dict, key: str, where: str, required: bool = True) -> str:
    value = row.get(key)
    if value is None or value != value:  # NaN: how a table read through pandas may give an empty cell
        if required:
            raise DataError(f"{where}: missing field '{key}'" if value is None else f"{where}: field '{key}' is empty")
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    return value


def not_empty(text: str, where: str) -> str:
    """An empty answer teaches only to stop at once: almost always a broken row, so refuse it."""
    if not text.strip():
        raise DataError(f"{where}: empty answer (nothing to learn from)")
    return text


def messages_field(value, where: str, name: str = "messages", need_assistant: bool = True) -> list[dict]:
    """A clean list of {role, content}; assistant turns must say something."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field '{name}' must be a non-empty list of {{role, content}}")
    clean = []
    for k, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {name}[{k}] must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: {name}[{k}].role must be system, user or assistant, got {role!r}")
        content = text_field(message, "content", f"{where}: {name}[{k}]")
        if role == "assistant":
            not_empty(content, f"{where}: {name}[{k}].content")
        clean.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in clean):
        raise DataError(f"{where}: no assistant message to learn from")
    return clean


def with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    if system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


# -- rendering ----------------------------------------------------------------------------------


# Truncation keeps a sample's first tokens only. While tokenization sets it (`rendering_until`), this makes for each
# sequence a counter, told every segment, that says when the segments so far hold all that truncation keeps:
# chat_segments then stops, as a row of thousands of short messages would cost a render of every prefix (quadratic).
_KEPT: ContextVar[Callable[[], Callable[[str, bool], bool]] | None] = ContextVar("workbench_kept", default=None)


@contextmanager
def rendering_until(counter: Callable[[], Callable[[str, bool], bool]]):
    """chat_segments within this block renders no further than `counter()` (one per sequence) asks."""
    token = _KEPT.set(counter)
    try:
        yield
    finally:
        _KEPT.reset(token)


def chat_segments(tokenizer, messages: list[dict], last_answer_only: bool = False) -> Segments:
    """Split a rendered conversation into (text, is_answer) pieces, by rendering growing prefixes.
    last_answer_only: only the last message's answer is learned (the others belong to the prompt)."""

    def render(msgs, generation_prompt=False):
        return chat_templates.render(tokenizer, msgs, add_generation_prompt=generation_prompt)

    make_counter = _KEPT.get()
    kept_all = make_counter() if make_counter else (lambda text, is_answer: False)
    segments, previous = [], ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = render(messages[:i], generation_prompt=True) if i else ""
            full = render(messages[: i + 1])
            if not (prompt.startswith(previous) and full.startswith(prompt)):
                raise ModelError("the tokenizer's chat template does not render conversations prefix by prefix")
            learned = not last_answer_only or i == len(messages) - 1
            new = [(prompt[len(previous):], False), (full[len(prompt):], learned)]
        else:
            full = render(messages[: i + 1])
            if not full.startswith(previous):
                raise ModelError("the tokenizer's chat template does not render conversations prefix by prefix")
            new = [(full[len(previous):], False)]
        segments += new
        previous = full
        if any([kept_all(text, is_answer) for text, is_answer in new]):  # a list: the counter sees every segment
            break
    return segments


def instruction_segments(tokenizer, messages: list[dict]) -> Segments:
    """A single-turn instruction without a chat template: the classic Alpaca prompt."""
    prompt = ALPACA_PROMPT + f"### Instruction:\n{messages[-2]['content']}\n\n### Response:\n"
    return [(prompt, False), (messages[-1]["content"], True)]


def last_exchange(messages: list[dict]) -> tuple[str | None, str]:
    """(the last user message before the last answer, that answer): what evaluation asks and expects."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    users = [m["content"] for m in messages[:last] if m["role"] == "user"]
    return (users[-1] if users else None), messages[last]["content"]


# -- the formats --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataFormat:
    name: str
    fields: tuple[str, ...]  # the columns that identify the format (all present)
    optional: tuple[str, ...]
    summary: str
    example: dict
    check: Callable[[dict, str], None]  # raise DataError naming `where`
    needs_chat_template: bool = False
    preference: bool = False  # rows hold a prompt and two answers (chosen, rejected)
    unpaired: bool = False  # rows hold a prompt, one answer and a label (desirable or not)
    prompts: bool = False  # rows hold a prompt alone (answers are generated in the loop), and columns rewards read
    # instruction formats: segments(row, tokenizer, system_prompt, where) and reference(row, system_prompt, where)
    # (evaluation's question and expected answer; preference pairs are scored by their log-probabilities instead)
    segments: Callable | None = None
    reference: Callable | None = None
    # the preference format: pair(row, tokenizer, system_prompt, where) -> (chosen segments, rejected segments)
    pair: Callable | None = None
    # the unpaired format: unpaired_row(row, where, system_prompt) -> Unpaired
    unpaired_row: Callable | None = None
    # the prompts format: prompt_row(row, where, system_prompt) -> PromptRow
    prompt_row: Callable | None = None

    @property
    def rows(self) -> str:
        """The kind of rows, which decides the objectives that learn from them (workbench/spec/objectives.py)."""
        return ("pairs" if self.preference else "unpaired" if self.unpaired else "prompts" if self.prompts
                else "instructions")

    @property
    def sequences_per_example(self) -> int:
        """Sequences one row becomes: a preference pair is two, an unpaired row its answer and the mismatched one
        (KTO's KL sample); the loop keeps them in one row."""
        return 2 if self.preference or self.unpaired else 1


# chat ------------------------------------------------------------------------------------------


def _chat_messages(row, where, system_prompt):
    return with_system(messages_field(row.get("messages"), where), system_prompt)


def _chat_segments(row, tokenizer, system_prompt, where):
    if not tokenizer.chat_template:
        raise DataError(f"{where}: format chat needs a tokenizer with a chat template (use format: completion)")
    return chat_segments(tokenizer, _chat_messages(row, where, system_prompt))


# alpaca ----------------------------------------------------------------------------------------


def _alpaca_messages(row, where, system_prompt):
    instruction = text_field(row, "instruction", where)
    extra = text_field(row, "input", where, required=False)
    output = not_empty(text_field(row, "output", where), f"{where}: field 'output'")
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return with_system([{"role": "user", "content": user}, {"role": "assistant", "content": output}], system_prompt)


def _alpaca_segments(row, tokenizer, system_prompt, where):
    messages = _alpaca_messages(row, where, system_prompt)
    return chat_segments(tokenizer, messages) if tokenizer.chat_template else instruction_segments(tokenizer, messages)


# completion and text ---------------------------------------------------------------------------


def _completion_check(row, where):
    text_field(row, "prompt", where)
    not_empty(text_field(row, "completion", where), f"{where}: field 'completion'")


def _completion_segments(row, tokenizer, system_prompt, where):
    _completion_check(row, where)
    return [(row["prompt"], False), (row["completion"], True)]


def _text_check(row, where):
    not_empty(text_field(row, "text", where), f"{where}: field 'text'")


def _text_segments(row, tokenizer, system_prompt, where):
    _text_check(row, where)
    return [(row["text"], True)]


# preference ------------------------------------------------------------------------------------


@dataclass
class Preference:
    """A preference row made uniform: the conversation so far (ending with a user turn) and two answers."""

    prompt: list[dict]
    chosen: str
    rejected: str


def preference_of(row: dict, where: str, system_prompt: str | None = None) -> Preference:
    """Read the layouts preference sets come in:

    - `prompt` (text) or `messages` (the conversation so far), with `chosen` and `rejected` answer texts;
    - `prompt` as messages, with `chosen` / `rejected` as lists holding the assistant's answer;
    - `chosen` / `rejected` as whole conversations sharing everything but the last assistant turn (an
      optional `prompt` text beside them is then the first user turn, as in the public binarized sets).
    """
    chosen, rejected = row.get("chosen"), row.get("rejected")
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            raise DataError(f"{where}: missing field '{name}'")
        if not isinstance(value, (str, list)):
            raise DataError(f"{where}: field '{name}' must be a string or a list of messages, "
                            f"got {type(value).__name__}")
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise DataError(f"{where}: fields 'chosen' and 'rejected' must both be strings or both lists of messages")
    if isinstance(chosen, list):
        chosen_turns = messages_field(chosen, where, "chosen")
        rejected_turns = messages_field(rejected, where, "rejected")
        if chosen_turns[-1]["role"] != "assistant" or rejected_turns[-1]["role"] != "assistant":
            raise DataError(f"{where}: 'chosen' and 'rejected' must end with the assistant's answer")
        shared_c, shared_r = chosen_turns[:-1], rejected_turns[:-1]
        if shared_c != shared_r:
            raise DataError(f"{where}: 'chosen' and 'rejected' differ before their last assistant message; "
                            "a pair answers the same conversation")
        if shared_c:  # whole conversations carry the prompt themselves; a prompt text beside them must agree
            prompt = shared_c
            _same_prompt(row, prompt, where)
        else:
            prompt = _prompt_messages(row, where, required=False)
        if not prompt:
            raise DataError(f"{where}: no prompt: give a 'prompt' field or whole conversations in 'chosen'/'rejected'")
        pair = Preference(prompt, chosen_turns[-1]["content"], rejected_turns[-1]["content"])
    else:
        prompt = _prompt_messages(row, where, required=True)
        pair = Preference(prompt, not_empty(chosen, f"{where}: field 'chosen'"),
                          not_empty(rejected, f"{where}: field 'rejected'"))
    last = pair.prompt[-1]
    if last["role"] != "user":
        article = "an" if last["role"] == "assistant" else "a"
        raise DataError(f"{where}: the prompt ends with {article} {last['role']} message; it must end with the "
                        "user's turn")
    if not last["content"].strip():
        raise DataError(f"{where}: the prompt's user turn is empty (nothing to answer)")
    if pair.chosen.strip() == pair.rejected.strip():
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same answer (nothing to prefer)")
    pair.prompt = with_system(pair.prompt, system_prompt)
    return pair


def _same_prompt(row: dict, prompt: list[dict], where: str) -> None:
    """Beside whole conversations, 'messages' is a second prompt and 'prompt' may only repeat their user turn."""
    if row.get("messages") is not None:
        raise DataError(f"{where}: give the prompt once: 'chosen' and 'rejected' are whole conversations, "
                        "so 'messages' must be left out")
    text = row.get("prompt")
    if text is not None and (not isinstance(text, str) or text.strip() != (last_user(prompt) or "").strip()):
        raise DataError(f"{where}: field 'prompt' differs from the user turn of the 'chosen'/'rejected' "
                        "conversations; give the prompt once")


def _prompt_messages(row: dict, where: str, required: bool) -> list[dict]:
    if row.get("messages") is not None:
        if row.get("prompt") is not None:
            raise DataError(f"{where}: give the prompt once, as 'prompt' or as 'messages'")
        return messages_field(row["messages"], where, need_assistant=False)
    prompt = row.get("prompt")
    if prompt is None:
        if required:
            raise DataError(f"{where}: missing field 'prompt' (or 'messages')")
        return []
    if isinstance(prompt, list):
        return messages_field(prompt, where, "prompt", need_assistant=False)
    return [{"role": "user", "content": text_field(row, "prompt", where)}]


def _preference_check(row, where):
    preference_of(row, where)


def _preference_pair(row, tokenizer, system_prompt, where) -> tuple[Segments, Segments]:
    pair = preference_of(row, where, system_prompt)
    return (answer_segments(pair.prompt, pair.chosen, tokenizer, where),
            answer_segments(pair.prompt, pair.rejected, tokenizer, where))


def answer_segments(prompt: list[dict], answer: str, tokenizer, where: str) -> Segments:
    """The conversation so far and one answer to it, only that final answer learned (earlier assistant turns
    belong to the prompt)."""
    messages = [*prompt, {"role": "assistant", "content": answer}]
    if tokenizer.chat_template:
        return chat_segments(tokenizer, messages, last_answer_only=True)
    if len(prompt) == 1 and prompt[0]["role"] == "user":  # a plain prompt and its continuation
        return [(prompt[0]["content"], False), (answer, True)]
    raise DataError(f"{where}: a conversation needs a tokenizer with a chat template "
                    "(give a plain 'prompt' text, or use a chat model)")


# unpaired (KTO) ---------------------------------------------------------------------------------


@dataclass
class Unpaired:
    """An unpaired row made uniform: the conversation so far (ending with a user turn), one answer, and whether
    that answer is desirable."""

    prompt: list[dict]
    completion: str
    desirable: bool
    plain: bool = False  # prompt and completion given as text, not messages: tokenized as written (unpaired_segments)


def unpaired_segments(unpaired: Unpaired, answer: str, tokenizer, where: str) -> Segments:
    """One answer to an unpaired row's prompt, as TRL's KTOTrainer tokenizes it: a plain-text row is its prompt and
    the answer as written, the EOS after it (as the completion format has them); a conversation goes through the
    chat template."""
    if unpaired.plain:
        return [(unpaired.prompt[-1]["content"], False), (answer, True)]
    return answer_segments(unpaired.prompt, answer, tokenizer, where)


def unpaired_of(row: dict, where: str, system_prompt: str | None = None) -> Unpaired:
    """TRL's unpaired preference layout: `prompt` (text or messages) or `messages`, `completion` (text, or a list
    holding the assistant's answer) and `label` (true: desirable, false: undesirable)."""
    label = row.get("label")
    if label is None:
        raise DataError(f"{where}: missing field 'label' (true where the completion is desirable, false where not)")
    if isinstance(label, str) and label.strip().lower() in ("true", "false"):  # a CSV cell is text
        label = label.strip().lower() == "true"
    if not isinstance(label, bool):
        raise DataError(f"{where}: field 'label' must be true or false, got {label!r}")
    completion = row.get("completion")
    # TRL's rule: text rows are text, rows of messages a conversation; a system prompt makes a row a conversation
    plain = isinstance(completion, str) and isinstance(row.get("prompt"), str) and not system_prompt
    if isinstance(completion, list):
        turns = messages_field(completion, where, "completion")
        if len(turns) != 1 or turns[0]["role"] != "assistant":
            raise DataError(f"{where}: field 'completion' as messages must hold the assistant's answer alone")
        completion = turns[0]["content"]
    else:
        completion = not_empty(text_field(row, "completion", where), f"{where}: field 'completion'")
    prompt = _ending_with_user(_prompt_messages(row, where, required=True), where)
    return Unpaired(with_system(prompt, system_prompt), completion, label, plain)


def _ending_with_user(prompt: list[dict], where: str) -> list[dict]:
    """The prompt, which must end with the user's turn (what the answer answers)."""
    last = prompt[-1]
    if last["role"] != "user":
        article = "an" if last["role"] == "assistant" else "a"
        raise DataError(f"{where}: the prompt ends with {article} {last['role']} message; it must end with the "
                        "user's turn")
    return prompt


# prompts (GRPO) ----------------------------------------------------------------------------------


@dataclass
class PromptRow:
    """A prompt row made uniform: the prompt as text (tokenized as written) or as the conversation so far (ending
    with a user turn, rendered with the chat template and its generation prompt), and the row's other columns,
    which reward functions read (e.g. `answer`)."""

    prompt: str | list[dict]
    columns: dict

    @property
    def text(self) -> str:
        """What the rewards are told the prompt was: the text, or the last user turn."""
        return self.prompt if isinstance(self.prompt, str) else last_user(self.prompt) or ""


def prompt_of(row: dict, where: str, system_prompt: str | None = None) -> PromptRow:
    """TRL's prompt-only layout: `prompt` as text or messages, or `messages` (the conversation so far); a system
    prompt makes a text prompt a conversation."""
    prompt = row.get("prompt")
    if isinstance(prompt, str) and row.get("messages") is None and not system_prompt:
        if not text_field(row, "prompt", where).strip():
            raise DataError(f"{where}: field 'prompt' is empty (nothing to answer)")
        value: str | list[dict] = prompt
    else:
        value = _ending_with_user(_prompt_messages(row, where, required=True), where)
        if not value[-1]["content"].strip():
            raise DataError(f"{where}: the prompt's user turn is empty (nothing to answer)")
        value = with_system(value, system_prompt)
    columns = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
    return PromptRow(value, columns)


def last_user(messages: list[dict]) -> str | None:
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else None


FORMATS: dict[str, DataFormat] = {f.name: f for f in (
    DataFormat(
        "chat", ("messages",), (), "a conversation: messages = [{role, content}, ...]; assistant turns are learned",
        {"messages": [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5."}]},
        check=lambda row, where: _chat_messages(row, where, None), needs_chat_template=True,
        segments=_chat_segments,
        reference=lambda row, system, where: last_exchange(_chat_messages(row, where, system))),
    DataFormat(
        "alpaca", ("instruction", "output"), ("input",), "instruction (+ optional input) and output",
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5."},
        check=lambda row, where: _alpaca_messages(row, where, None), segments=_alpaca_segments,
        reference=lambda row, system, where: last_exchange(_alpaca_messages(row, where, system))),
    DataFormat(
        "completion", ("prompt", "completion"), (), "prompt (masked) and completion (learned)",
        {"prompt": "2 plus 3 is", "completion": " 5."},
        check=_completion_check, segments=_completion_segments,
        reference=lambda row, system, where: (row["prompt"], row["completion"])),
    DataFormat(
        "text", ("text",), (), "plain text, every token learned", {"text": "Two plus three is five."},
        check=_text_check, segments=_text_segments, reference=lambda row, system, where: (None, None)),
    DataFormat(
        "preference", ("chosen", "rejected"), ("prompt", "messages"),
        "a prompt (text or messages) and two answers, chosen and rejected (for training.objective dpo, orpo or reward)",
        {"prompt": "What is 2 plus 3?", "chosen": "5.", "rejected": "6."},
        check=_preference_check, preference=True, pair=_preference_pair),
    DataFormat(
        "unpaired", ("completion", "label"), ("prompt", "messages"),
        "a prompt (text or messages), one answer and a label: true where the answer is desirable "
        "(for training.objective kto)",
        {"prompt": "What is 2 plus 3?", "completion": "5.", "label": True},
        check=lambda row, where: unpaired_of(row, where), unpaired=True,
        unpaired_row=unpaired_of),
    DataFormat(
        "prompts", ("prompt",), ("messages",),
        "a prompt (text or messages) alone, and any columns the rewards read, e.g. answer (for training.objective "
        "grpo: the answers are sampled in training and scored)",
        {"prompt": [{"role": "user", "content": "What is 2 plus 3?"}], "answer": "5"},
        check=lambda row, where: prompt_of(row, where), prompts=True, prompt_row=prompt_of),
)}
FORMAT_NAMES = tuple(FORMATS)


def format_of(name: str) -> DataFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise DataError(f"data.format: unknown format {name!r} (one of {', '.join(FORMAT_NAMES)})") from None


def detect(columns, preferred: str) -> str:
    """The preferred format when the columns hold its fields, else the one the columns reveal."""
    present = set(columns)
    if set(format_of(preferred).fields) <= present:
        return preferred
    # the most specific match first: a preference set also has a 'prompt' column, an unpaired one a 'prompt' and a
    # 'completion' column
    for fmt in sorted(FORMATS.values(), key=lambda f: (-len(f.fields), -len(f.optional))):
        if set(fmt.fields) <= present:
            return fmt.name
    described = "; ".join(f"{f.name}: {', '.join(f.fields)}" for f in FORMATS.values())
    raise DataError(f"cannot tell the row format from the columns {sorted(present)} ({described})")
