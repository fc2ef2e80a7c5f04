"""Jinja chat templates (mlx_llm.data.templates): the sandbox, what templates see, how replies are located for the
loss mask, and the refusals at import (mlx_llm.data.hf_tokenizer) — no transformers needed."""

import json

import numpy as np
import pytest

from mlx_llm.errors import DataError, InputError
from mlx_llm.data import hf_tokenizer
from mlx_llm.data.chat import ChatTemplate, read_conversations
from mlx_llm.data.templates import PLACEHOLDER, JinjaTemplate, locate_contents, template_for
from mlx_llm.data.tokenizer import ByteTokenizer

pytest.importorskip("jinja2")

TOK = ByteTokenizer()
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8"}]
PLAIN = ("{% for m in messages %}{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def jinja(source: str, tok=TOK) -> JinjaTemplate:
    return JinjaTemplate(source, tok, "tpl.json")


# ----- the sandbox --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",  # jinja2 alone would render this as '' and go on
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{% for c in ().__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ messages.append(1) }}",
    "{% set ns = namespace(_x=1) %}{{ ns }}",
    "{{ cycler.__init__.__globals__.os }}",
])
def test_unsafe_constructs_are_refused_in_one_line(source):
    with pytest.raises(DataError, match=r"^tpl.json: the chat template was stopped by the sandbox \(.*\); unsafe "
                                        r"template operations are refused, never run$") as info:
        jinja(source).render(CONV)
    assert "\n" not in str(info.value)


def test_what_templates_see():
    source = ("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ messages | tojson }}|{{ tools }}|"
              "{{ add_generation_prompt }}|{{ dict(a=1) | tojson }}|{{ strftime_now('%Y') | length }}|"
              "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
              "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{% generation %}G{% endgeneration %}")
    text = jinja(source).render(CONV[1:3])
    assert text == ('<|bos|>|<|eos|>|<|pad|>|[{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", '
                    '"content": "5"}]|None|False|{"a": 1}|4|1|G')
    assert jinja("{{ 'é' | tojson }}").render(CONV) == '"é"'  # no ASCII or HTML escaping
    qwen_like = ByteTokenizer(roles={"eos": "<|eos|>"})
    assert jinja("[{{ bos_token }}][{{ eos_token }}]", qwen_like).render(CONV) == "[][<|eos|>]"


def test_trim_and_lstrip_blocks_like_transformers():
    source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert jinja(source).render(CONV[1:3]) == "What is 2 + 3?\n"


def test_syntax_errors_name_the_file_and_line():
    with pytest.raises(DataError, match=r"^tpl.json: the chat template is not valid Jinja \(template line 2: "):
        jinja("{{ bos_token }}\n{% if %}")
    with pytest.raises(DataError, match=r"^tpl.json: .* \(template line 1: No filter named 'nofilter'"):
        jinja("{{ x | nofilter }}")


def test_raise_exception_and_runtime_failures_are_input_errors(tmp_path):
    refuse = jinja("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}"
                   "{% endif %}" + PLAIN)
    with pytest.raises(InputError, match=r"^the chat template refuses this conversation: System role not supported$"):
        refuse.encode(CONV, TOK)
    assert refuse.encode(CONV[1:], TOK)[0].size > 0
    with pytest.raises(InputError, match=r"the chat template failed on this conversation \(TypeError: "):
        jinja("{{ messages[0].content + 1 }}").render(CONV)
    tok = TOK.with_chat_template(refuse.source)
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": CONV[1:3]}) + "\n\n" + json.dumps({"messages": CONV}) + "\n")
    with pytest.raises(DataError, match=r"data.jsonl:3: the chat template refuses this conversation: System role"):
        read_conversations(path, tok, template_for(tok), 256)


# ----- locating the replies -----------------------------------------------------------------------------------
def test_locate_contents():
    probe = "<a>" + PLACEHOLDER.format(0) + "<b>" + PLACEHOLDER.format(1) + "<c>"
    assert locate_contents("<a>hi<b>yo<c>", probe, ["hi", "yo"]) == [(3, 5), (8, 10)]
    assert locate_contents("<a>hi<b>yo<c>", probe, ["  hi ", "yo\n"]) == [(3, 5), (8, 10)]  # trimmed
    assert locate_contents("<a>HI<b>yo<c>", probe, ["hi", "yo"]) is None  # changed
    assert locate_contents("<a>hi<b>yo<c>!", probe, ["hi", "yo"]) is None
    assert locate_contents("<a>yo<c>", "<a>" + PLACEHOLDER.format(1) + "<c>", ["hi", "yo"]) == [None, (3, 5)]
    twice = PLACEHOLDER.format(0) * 2
    assert locate_contents("hihi", twice, ["hi"]) is None


def test_encode_of_our_template_as_jinja_equals_chat_template():
    """The Jinja that export writes, read back as a model's template, gives ChatTemplate's ids and targets."""
    for template in (ChatTemplate(), ChatTemplate.from_dict({"bos": False})):
        imported = jinja(template.to_jinja())
        assert imported.end == "<|end|>"
        for messages, prompt in [(CONV, False), (CONV[1:3], False), (CONV[:4], True)]:
            a, b = template.encode(messages, TOK, generation_prompt=prompt), imported.encode(
                messages, TOK, generation_prompt=prompt)
            assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
            assert imported.render(messages, generation_prompt=prompt) == template.render(
                messages, generation_prompt=prompt)


def test_mask_of_a_trimming_template():
    tpl = jinja("{% for m in messages %}{{ '<|' + m.role + '|>' + m.content | trim + '<|end|>' }}{% endfor %}")
    conv = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "  ok then \n"}]
    ids, target = tpl.encode(conv, TOK)
    assert TOK.decode(ids[target]) == "ok then<|end|>"
    assert TOK.decode(ids) == "<|user|>hi<|end|><|assistant|>ok then<|end|>"


@pytest.mark.parametrize("source, message", [
    ("{% for m in messages %}{{ m.role + m.content | upper }}{% endfor %}", r"changes message contents"),
    ("{% for m in messages %}{{ m.content + m.content }}{% endfor %}", r"changes message contents .* or writes one"),
    ("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}",
     r"leaves out the content of message 2 \(assistant\)"),
])
def test_templates_whose_replies_cannot_be_located_are_refused(source, message):
    with pytest.raises(InputError, match=message):
        jinja(source).encode(CONV, TOK)


def test_end_of_turn_falls_back_to_eos():
    assert jinja("{% for m in messages %}{{ m.content }}\n{% endfor %}").end == "<|eos|>"
    assert jinja("{{ raise_exception('no') }}").end == "<|eos|>"
    assert jinja(PLAIN).end == "<|end|>"


def test_template_for():
    assert template_for(TOK) == ChatTemplate() and template_for(TOK, ChatTemplate(bos=False)).bos is False
    tok = TOK.with_chat_template(PLAIN)
    picked = template_for(tok, ChatTemplate(bos=False))
    assert isinstance(picked, JinjaTemplate) and picked.source == PLAIN and template_for(tok, picked) is picked
    assert picked.to_dict() is None


# ----- what a template may cost (data/template_sandbox.py) --------------------------------------------------
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
PER_CHAR = ("{% for m in messages %}{% for a in m.content %}{% for b in m.content %}{% endfor %}{% endfor %}"
            "{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{% endfor %}")


@pytest.mark.parametrize("source, message", [
    (NESTED, r"it did not finish rendering within 2 s"),
    ("{{ 'x' * 10000000000 }}", r"it needs more than the 1024 MiB of memory a template may use"),
    ("{{ 'x' | center(20000000) }}", r"its rendering is 20,000,000 characters, more than the 8,388,608 allowed"),
    ("{{ '{%' * 1000 }}" + "x" * (1 << 20), r"its source is 1,048,5\d\d characters, more than the 1,048,576 allowed"),
])
def test_a_template_that_costs_too_much_is_refused_at_import_in_one_line(tmp_path, source, message):
    """Two nested loops of 100,000 (each within the sandbox's range limit), a 10 GB string, a 20 MB rendering
    and a source beyond 1 Mi characters: each refused in one line, within seconds, by the worker process's limits
    (the deadline, the address-space cap, the output and source sizes)."""
    import time

    start = time.monotonic()
    with pytest.raises(DataError, match=r"^\S*tokenizer_config.json: the chat template is refused: " + message) as info:
        hf_tokenizer.from_hf(export_dir(tmp_path / "hf", chat_template=source))
    assert "\n" not in str(info.value) and time.monotonic() - start < 30
    assert jinja(PLAIN).render(CONV).startswith("<|system|>Be brief.")  # the next template renders as usual


@pytest.mark.slow
def test_a_conversation_that_makes_a_template_too_costly_is_refused_alone(tmp_path):
    """A template that loops over each content twice imports (its probes are short); a conversation with a
    100,000-character message would take 10¹⁰ iterations: that conversation is refused (sft names its line, chat
    does not send it), and the next one renders."""
    template = jinja(PER_CHAR)
    long = [{"role": "user", "content": "x" * 100_000}, {"role": "assistant", "content": "y"}]
    with pytest.raises(InputError, match=r"^the chat template is stopped on this conversation: it did not finish "
                                         r"rendering within 2 s$"):
        template.render(long)
    assert template.render(CONV[1:3]) == "<|user|>What is 2 + 3?<|end|><|assistant|>5<|end|>"
    path = tmp_path / "convs.jsonl"
    path.write_text(json.dumps({"messages": CONV[1:3]}) + "\n" + json.dumps({"messages": long}) + "\n")
    with pytest.raises(DataError, match=r"convs.jsonl:2: .*did not finish rendering within 2 s"):
        read_conversations(path, TOK, template, 1 << 20)


# ----- at import ----------------------------------------------------------------------------------------------
def export_dir(path, tok=TOK, **tok_cfg):
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps(hf_tokenizer.tokenizer_json(tok)))
    config = {**hf_tokenizer.tokenizer_config(tok, 64), **tok_cfg}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("source, message", [
    ("{{ ''.__class__.__mro__ }}", r"tokenizer_config.json: the chat template was stopped by the sandbox"),
    ("{% for m in messages %}{{ m.__class__ }}{% endfor %}", r"tokenizer_config.json: the chat template was stopped"),
    ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", r"tokenizer_config.json: the chat template is not valid "
                                                               r"Jinja \(template line 2: "),
    ([{"name": "tool_use", "template": "x"}],
     r"chat_template lists the templates \['tool_use'\], none named 'default'"),
    (7, r"chat_template must be a Jinja string or a list of named templates, got int"),
])
def test_import_refuses_bad_templates(tmp_path, source, message):
    with pytest.raises(DataError, match=message) as info:
        hf_tokenizer.from_hf(export_dir(tmp_path / "hf", chat_template=source))
    assert "\n" not in str(info.value)


def test_import_reads_chat_template_jinja_first_and_the_default_of_a_list(tmp_path):
    d = export_dir(tmp_path / "list", chat_template=[{"name": "tool_use", "template": "T"},
                                                     {"name": "default", "template": PLAIN}])
    assert hf_tokenizer.from_hf(d).chat_template == PLAIN
    (d / "chat_template.jinja").write_text(PLAIN + "\n")
    assert hf_tokenizer.from_hf(d).chat_template == PLAIN + "\n"
    (d / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(DataError, match=r"chat_template.jinja: the chat template is not valid Jinja"):
        hf_tokenizer.from_hf(d)


@pytest.mark.parametrize("tok_cfg, config, message", [
    ({"eos_token": None}, {}, r"no end-of-sequence token: neither tokenizer_config.json's eos_token nor"),
    ({"bos_token": "<|nope|>"}, {}, r"tokenizer_config.json: bos_token is '<\|nope\|>', which is not an added token"),
    ({"eos_token": 3}, {}, r"tokenizer_config.json: eos_token = 3 is not a token"),
    ({"added_tokens_decoder": {"5": {"content": "<|user|>", "special": True}}}, {},
     r"added_tokens_decoder has '<\|user\|>' at id 5, which tokenizer.json does not"),
])
def test_import_refuses_bad_roles(tmp_path, tok_cfg, config, message):
    d = export_dir(tmp_path / "hf", **tok_cfg)
    with pytest.raises(DataError, match=message):
        hf_tokenizer.from_hf(d, config)


def test_import_roles_from_config_json_ids(tmp_path):
    d = export_dir(tmp_path / "hf")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "pad_token"):
        cfg.pop(key)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ids = {"bos_token_id": TOK.token_id("<|user|>"), "eos_token_id": [TOK.token_id("<|end|>"), 5],
           "pad_token_id": 65}  # "A": not an added token, so no PAD
    tok = hf_tokenizer.from_hf(d, ids)
    assert tok.roles == {"bos": "<|user|>", "eos": "<|end|>"} and (tok.bos_id, tok.eos_id, tok.pad_id) == (
        TOK.token_id("<|user|>"), TOK.token_id("<|end|>"), TOK.token_id("<|end|>"))
    assert hf_tokenizer.from_hf(d, {}).roles == TOK.roles  # nothing said: our own tokens play our roles
    with pytest.raises(DataError, match=r"config.json: eos_token_id = 65 names no added token"):
        hf_tokenizer.from_hf(d, {"eos_token_id": 65})
    assert np.array_equal(tok.encode("hi"), TOK.encode("hi"))


@pytest.mark.parametrize("where, source, message", [
    ("config", "", r"tokenizer_config.json: chat_template is empty: it would render every conversation as no text"),
    ("config", " \n\t", r"tokenizer_config.json: chat_template is whitespace only: it would render every"),
    ("jinja", "", r"chat_template.jinja: the file is empty: it would render every conversation as no text"),
    ("config", "{# a comment, nothing else #}",
     r"tokenizer_config.json: the chat template is refused: it renders the conversation \[\{'role': 'user', "
     r"'content': 'Hi'\}\] as '', no text to send a model"),
])
def test_import_refuses_a_template_that_renders_nothing(tmp_path, where, source, message):
    """An empty chat template imported silently, and `chat` then ended with "prompt_BT has shape (1, 0)"."""
    d = export_dir(tmp_path / "hf", **({"chat_template": source} if where == "config" else {}))
    if where == "jinja":
        (d / "chat_template.jinja").write_text(source)
    with pytest.raises(DataError, match=message) as info:
        hf_tokenizer.from_hf(d)
    assert "\n" not in str(info.value)


def test_chat_does_not_send_a_prompt_the_template_renders_as_nothing():
    """A tokenizer that carries an empty template (a run imported before import refused one): each turn is reported
    in one line and not sent, instead of the session ending on "prompt_BT has shape (1, 0)"."""
    import jax

    from mlx_llm import init_params
    from mlx_llm.eval.replies import chat_session
    from helpers import tiny_cfg

    tok = TOK.with_chat_template("")
    with pytest.raises(InputError, match=r"^the chat template renders this conversation as no text, so there is no "
                                         r"prompt to send the model"):
        template_for(tok).encode(CONV[1:2], tok, generation_prompt=True)
    cfg = tiny_cfg(vocab_size=TOK.vocab_size, n_layers=1, n_heads=2, n_kv_heads=1, d_head=8, d_ff=16)
    lines, out = iter(["hi", "again", ""]), []
    status = chat_session(init_params(cfg, jax.random.key(0)), cfg, tok, None, read=lambda _: next(lines),
                          write=out.append)
    assert status == 0 and len(out) == 2 and all(line.startswith("(not sent: the chat template renders this "
                                                                 "conversation as no text") for line in out)


def test_a_huge_chat_template_file_is_refused_without_reading_it_whole(tmp_path):
    """chat_template.jinja is read up to what a template's source may hold (4 bytes per allowed character), so a
    64 MiB file (sparse: no disk used) is refused by its size, not read into memory and then measured."""
    d = export_dir(tmp_path / "hf")
    with open(d / "chat_template.jinja", "wb") as fh:
        fh.truncate(64 << 20)
    with pytest.raises(DataError, match=r"chat_template.jinja: the chat template is refused: its file is more than "
                                        r"4,194,304 bytes \(a template's source may have at most 1,048,576 "
                                        r"characters\)$"):
        hf_tokenizer.from_hf(d)
