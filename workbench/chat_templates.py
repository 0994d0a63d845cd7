"""Chat templates: the registry `data.chat_template` names, and the check every template a run uses passes.

`data.chat_template` is a registered name or the path of a Jinja file; it replaces the tokenizer's own template
for training, preview, sampling and everything saved with the run (the adapter's tokenizer, the merged model,
the GGUF). A template must end the assistant's turn with a token of the tokenizer's own, so that a tuned model
learns to stop: that token becomes the run's end-of-sequence token (the Llama 3 template ends turns with
`<|eot_id|>`, which a Llama 3 base model's tokenizer has but does not use as its EOS). A template whose turn
ends with no such token is refused.

Each registered template renders text conversations as the template of the model it follows does (checked
against those models' own templates in tests/test_chat_templates.py); where one departs, `departs` says how.
They render a conversation prefix by prefix (workbench/formats.py's chat_segments needs it), so none appends
a token after the last turn only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import RecipeError

FIELD = "data.chat_template"
LARGEST_TEMPLATE = 1 << 20  # bytes: a chat template is a few kB; a file larger than this is not one

# A system message, when given first, that a template without a system role puts before the first user turn
_FOLD_SYSTEM = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
)
_ALTERNATE = (
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
)


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    follows: str  # the model whose own chat template this renders like
    source: str  # Jinja, as transformers' apply_chat_template renders it
    departs: str = ""  # how it differs from that model's template, if it does


TEMPLATES = {t.name: t for t in (
    ChatTemplate(
        "chatml", "HuggingFaceTB/SmolLM2-135M-Instruct (ChatML)",
        "{%- for message in messages -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
        departs="adds no default system message"),
    ChatTemplate(
        "qwen", "Qwen/Qwen2.5-7B-Instruct",
        "{%- if messages[0]['role'] == 'system' -%}"
        "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
        "{%- else -%}"
        "{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- for message in messages -%}{%- if not (loop.first and message['role'] == 'system') -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
        departs="text only (no tools)"),
    ChatTemplate(
        "llama3", "meta-llama/Meta-Llama-3-8B-Instruct",
        "{{ bos_token }}{%- for message in messages -%}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
        "+ '<|eot_id|>' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"),
    ChatTemplate(
        "gemma", "google/gemma-2-9b-it",
        "{{ bos_token }}" + _FOLD_SYSTEM + "{%- for message in loop_messages -%}" + _ALTERNATE +
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
        "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') "
        "+ message['content'] | trim + '<end_of_turn>\\n' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}",
        departs="a system message opens the first user turn, as Gemma 3's template does (Gemma 2's refuses one)"),
    ChatTemplate(
        "mistral", "mistralai/Mistral-7B-Instruct-v0.2",
        "{{ bos_token }}" + _FOLD_SYSTEM + "{%- for message in loop_messages -%}" + _ALTERNATE +
        "{%- if message['role'] == 'user' -%}"
        "{{ '[INST] ' + (first_user_prefix if loop.first else '') + message['content'] + ' [/INST]' }}"
        "{%- else -%}{{ message['content'] + eos_token }}{%- endif -%}{%- endfor -%}",
        departs="a system message opens the first user turn (the model's own template refuses one)"),
    ChatTemplate(
        "phi", "microsoft/Phi-3.5-mini-instruct",
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' and message['content'] -%}"
        "{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{%- elif message['role'] == 'user' -%}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{%- elif message['role'] == 'assistant' -%}{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}",
        departs="no end-of-text after the last turn (it would break prefix rendering; `<|end|>` ends every turn)"),
)}
NAMES = tuple(TEMPLATES)

# The conversation a template is checked with: the text after the reply is where its turn ends.
_PROBE_REPLY = "Reply-7f3a."
_PROBE = [{"role": "user", "content": "Question-7f3a?"}, {"role": "assistant", "content": _PROBE_REPLY}]


def check_value(value: str | None) -> str | None:
    """The recipe's own check (no file is read): a registered name, or what can only be a file's path."""
    if value is None or value in TEMPLATES:
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be one of {', '.join(NAMES)} or the path of a Jinja file")
    if "/" not in value and "." not in value:
        raise ValueError(f"unknown chat template {value!r}: one of {', '.join(NAMES)}, or the path of a Jinja "
                         "file (e.g. templates/mine.jinja)")
    return value


def template_source(value: str) -> tuple[str, str]:
    """(Jinja source, how to name it in messages) of a registered name or a Jinja file, parsed: a file that does
    not parse is named with its line."""
    if value in TEMPLATES:
        return TEMPLATES[value].source, value
    path = Path(value).expanduser()
    if not path.is_file():
        raise RecipeError(f"{FIELD}: {value} is neither a registered template ({', '.join(NAMES)}) nor a file")
    if path.stat().st_size > LARGEST_TEMPLATE:
        raise RecipeError(f"{FIELD}: {value} is larger than {LARGEST_TEMPLATE >> 20} MB: not a chat template")
    try:
        source = path.read_text(encoding="utf-8-sig")  # a byte-order mark would become tokens of every example
    except UnicodeDecodeError as err:
        raise RecipeError(f"{FIELD}: {value} is not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise RecipeError(f"{FIELD}: {value}: cannot read ({err.strerror or err})") from None
    _parse(source, value)
    return source, value


def _parse(source: str, name: str) -> None:
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(source)
    except TemplateSyntaxError as err:
        raise RecipeError(f"{FIELD}: {name}:{err.lineno}: {err.message}") from None


def use_chat_template(tokenizer, value: str | None):
    """The tokenizer with `value`'s template in place of its own and, where the template ends a turn with
    another token, that token as its EOS. None: the tokenizer as it is."""
    if value is None:
        return tokenizer
    source, name = template_source(value)
    tokenizer.chat_template = source
    end = end_of_turn(tokenizer, name)
    if end != tokenizer.eos_token:
        tokenizer.eos_token = end  # what the data appends to each answer, and where generation stops
    return tokenizer


def end_of_turn(tokenizer, name: str) -> str:
    """The first special token the template puts after the assistant's reply, or RecipeError: without one, a
    model tuned on it would never learn to stop."""
    try:
        text = tokenizer.apply_chat_template(_PROBE, tokenize=False)
    except Exception as err:  # noqa: BLE001  a user's template can fail in any way (1/0, recursion, memory)
        raise RecipeError(f"{FIELD}: {name} cannot render a user message and a reply: "
                          f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    if _PROBE_REPLY not in text:
        raise RecipeError(f"{FIELD}: {name} leaves the assistant's reply out of what it renders")
    after = text.split(_PROBE_REPLY, 1)[1]
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    for token_id in tokenizer(after, add_special_tokens=False)["input_ids"]:
        if token_id in special:
            return tokenizer.convert_ids_to_tokens(token_id)
    raise RecipeError(f"{FIELD}: {name} ends the assistant's turn with {after[:60]!r}, which holds no special token "
                      f"of this tokenizer (its EOS is {tokenizer.eos_token!r}): a model tuned on it would not learn "
                      f"to stop. Use a template whose turns end with a token this tokenizer has")
