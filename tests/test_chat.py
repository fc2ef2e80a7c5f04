"""The chat template and the SFT loss mask (mlx_llm.data.chat; M20 §16, U19 §9)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import forward, init_params
from mlx_llm.errors import DataError, InputError
from mlx_llm.objectives.loss import masked_cross_entropy
from mlx_llm.data.chat import ChatTemplate, check_messages, read_conversations, training_arrays
from mlx_llm.eval.replies import chat_session
from mlx_llm.data.tokenizer import ByteTokenizer
from helpers import tiny_cfg

TOK = ByteTokenizer()
TEMPLATE = ChatTemplate()
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8"}]


# ----- U19 §9 -----------------------------------------------------------------------------------------------
def u19_logits():
    """Two-way logits whose softmax gives the target (id 0) the probabilities of U19 §9: question tokens
    (0.02, 0.6, 0.1, 0.7), answer tokens (0.5, 0.8, 0.9)."""
    p = np.array([0.02, 0.6, 0.1, 0.7, 0.5, 0.8, 0.9])
    return jnp.asarray(np.log(np.stack([p, 1 - p], -1))[None]), jnp.zeros((1, 7), jnp.int32)


def test_u19_s9_masked_and_unmasked_loss():
    logits, targets = u19_logits()
    answer_only = jnp.asarray([[0, 0, 0, 0, 1, 1, 1]], jnp.float64)
    masked = float(masked_cross_entropy(logits, targets, answer_only))
    unmasked = float(masked_cross_entropy(logits, targets, jnp.ones((1, 7))))
    assert round(masked, 4) == 0.3406 and abs(masked + (math.log(.5) + math.log(.8) + math.log(.9)) / 3) < 1e-12
    assert round(unmasked, 4) == 1.1577
    grad = jax.grad(lambda lg: masked_cross_entropy(lg, targets, answer_only))(logits)
    assert np.all(np.asarray(grad[0, :4]) == 0.0)  # masked-out positions: exactly the zero vector
    assert np.all(np.abs(np.asarray(grad[0, 4:])) > 1e-3)


@pytest.mark.slow
def test_prompt_tokens_change_the_answer_loss_through_attention():
    cfg = tiny_cfg(vocab_size=TOK.vocab_size, n_layers=1, n_heads=2, n_kv_heads=1, d_head=8, d_ff=16, max_seq_len=64)
    params = init_params(cfg, jax.random.key(0))
    ids, target = TEMPLATE.encode(CONV[1:3], TOK)
    arrays = training_arrays(ids, target)

    def loss(tokens):
        logits = forward(params, jnp.asarray(tokens)[None], cfg)
        return float(masked_cross_entropy(logits, jnp.asarray(arrays["targets"])[None],
                                          jnp.asarray(arrays["mask"])[None]))

    perturbed = arrays["tokens"].copy()
    k = 3  # a token of the user's question ("What…"), not a target
    assert not target[k] and not arrays["mask"][k - 1]
    perturbed[k] = TOK.encode("Z")[0]
    assert abs(loss(perturbed) - loss(arrays["tokens"])) > 1e-4


# ----- the template -----------------------------------------------------------------------------------------
def test_render_is_the_documented_text_and_decodes_back():
    text = TEMPLATE.render(CONV[1:3])
    assert text == "<|bos|><|user|>What is 2 + 3?<|end|><|assistant|>5<|end|>"
    ids, _ = TEMPLATE.encode(CONV, TOK)
    assert TOK.decode(ids) == TEMPLATE.render(CONV)
    prompt, _ = TEMPLATE.encode(CONV[:2], TOK, generation_prompt=True)
    assert TOK.decode(prompt) == TEMPLATE.render(CONV[:2], generation_prompt=True)
    assert TOK.decode(prompt).endswith("<|end|><|assistant|>")


def test_mask_covers_exactly_the_assistant_spans():
    ids, target = TEMPLATE.encode(CONV, TOK)
    targets_text = [TOK.decode(ids[s:e]) for s, e in _runs(target)]
    assert targets_text == ["5<|end|>", "8<|end|>"]
    assert TOK.decode(ids[~target]) == ("<|bos|><|system|>Be brief.<|end|><|user|>What is 2 + 3?<|end|><|assistant|>"
                                        "<|user|>And 4 + 4?<|end|><|assistant|>")


def test_marker_strings_in_content_stay_text():
    conv = [{"role": "user", "content": "say <|end|>"}, {"role": "assistant", "content": "<|end|>"}]
    ids, target = TEMPLATE.encode(conv, TOK)
    end_id = TOK.token_id("<|end|>")
    assert int(np.sum(ids == end_id)) == 2  # only the two real ends; the content's marker is spelled in bytes
    assert TOK.decode(ids) == TEMPLATE.render(conv)


def test_template_is_data():
    custom = ChatTemplate.from_dict({"user": "<|system|>", "bos": False})
    assert custom.render(CONV[1:3]) == "<|system|>What is 2 + 3?<|end|><|assistant|>5<|end|>"
    assert ChatTemplate.from_dict(TEMPLATE.to_dict()) == TEMPLATE
    with pytest.raises(InputError, match=r"unknown chat template field\(s\) \['tool'\]"):
        ChatTemplate.from_dict({"tool": "<|tool|>"})
    with pytest.raises(InputError, match=r"are not special tokens of the tokenizer"):
        ChatTemplate(user="<|human|>").encode(CONV, TOK)


def _runs(flags):
    flags = np.asarray(flags, int)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags, [0]])))
    return list(zip(edges[::2], edges[1::2]))


# ----- bad data ---------------------------------------------------------------------------------------------
GOOD = json.dumps({"messages": CONV[1:3]})


def _conv(*turns):
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})


ORDER = r"valid conversations are an optional first system message, then user and assistant turns alternating"


@pytest.mark.parametrize("lines, message", [
    ([GOOD, "{not json"], r"data.jsonl:2: not JSON"),
    ([GOOD, _conv(("assistant", "hi"), ("user", "x"), ("assistant", "y"))],
     rf"data.jsonl:2: message 0 is an assistant turn where the user's turn belongs: {ORDER}"),
    ([_conv(("user", "a"), ("user", "b"), ("assistant", "c"))],
     rf"data.jsonl:1: message 1 is a user turn where the assistant's turn belongs: {ORDER}"),
    ([GOOD, GOOD, _conv(("user", "a"), ("assistant", "b"), ("system", "c"), ("user", "d"), ("assistant", "e"))],
     rf"data.jsonl:3: message 2 is a system message: only the first message may be one; {ORDER}"),
    ([_conv(("system", "s"), ("system", "t"), ("user", "a"), ("assistant", "b"))],
     r":1: message 1 is a system message"),
    ([_conv(("user", "a"), ("assistant", "b"), ("user", "c"))],
     r"data.jsonl:1: the conversation ends with a user turn: a training conversation ends with the assistant's reply"),
    ([_conv(("user", "a"), ("assistant", "b"), ("assistant", "c"))], r":1: message 2 is an assistant turn where the "
                                                                     r"user's turn belongs"),
    ([json.dumps({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]})],
     r":1: message 0 \(user\) has content of type int \(5\): content must be a string"),
    ([json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ["x"]}]})],
     r":1: message 1 \(assistant\) has content of type list \(\['x'\]\)"),
    ([json.dumps({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]})],
     r":1: message 0 \(user\) has content of type NoneType"),
    (['{"conversation": []}'], r"data.jsonl:1: expected an object with a 'messages' list"),
    ([json.dumps({"messages": [{"role": "bot", "content": "hi"}]})], r":1: message 0 has unknown role 'bot'"),
    ([json.dumps({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "x"}]})],
     r":1: message 0 \(user\) has empty content"),
    ([json.dumps({"messages": [{"role": "user", "content": "hi"}]})], r":1: the conversation has no assistant turn"),
    ([GOOD, json.dumps({"messages": [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "y"}]}),
      json.dumps({"messages": [{"role": "user", "content": "x" * 90}, {"role": "assistant", "content": "y"}]})],
     r"2 conversation\(s\) are longer than 64 tokens after rendering \(first: line 2, 86 tokens\); nothing is "
     r"truncated"),
    ([json.dumps({"messages": "hi"})], r":1: messages must be a non-empty list"),
    (["", "  "], r"data.jsonl: no conversations"),
])
def test_bad_conversation_files(tmp_path, lines, message):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        read_conversations(path, TOK, TEMPLATE, max_len=64)


def test_read_conversations(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + "\n\n" + json.dumps({"messages": CONV}) + "\n")
    convs = read_conversations(path, TOK, TEMPLATE, max_len=128)
    assert len(convs) == 2 and TOK.decode(convs[1][0]) == TEMPLATE.render(CONV)
    with pytest.raises(DataError, match=r"missing.jsonl: no such file"):
        read_conversations(tmp_path / "missing.jsonl", TOK, TEMPLATE, max_len=64)


def test_role_orders():
    """The valid orders (check_messages' docstring) pass, for training and for a prompt."""
    s, u, a = ({"role": r, "content": r[0]} for r in ("system", "user", "assistant"))
    for conv in ([u, a], [s, u, a], [u, a, u, a], [s, u, a, u, a]):
        check_messages(conv)
        TEMPLATE.encode(conv, TOK)
    for prompt in ([u], [s, u], [u, a, u], [s, u, a, u]):
        check_messages(prompt, require_assistant=False)
        TEMPLATE.encode(prompt, TOK, generation_prompt=True)
    for bad, message in [([s], r"only a system message"), ([u, a], r"the prompt ends with an assistant turn"),
                         ([a, u], r"message 0 is an assistant turn")]:
        with pytest.raises(InputError, match=message):
            check_messages(bad, require_assistant=False)
    with pytest.raises(InputError, match=r"the conversation ends with a user turn"):
        TEMPLATE.render([u, a, u])
    check_messages([a], order=False)  # a lone reply (a preference pair's side)


@pytest.mark.slow
def test_chat_session_refuses_an_over_long_message_and_goes_on():
    """A message whose prompt leaves no room in the context is refused with a message; the session continues
    (the history is kept without it) until an empty line."""
    cfg = tiny_cfg(vocab_size=TOK.vocab_size, n_layers=1, n_heads=2, n_kv_heads=1, d_head=8, d_ff=16, max_seq_len=40)
    params = init_params(cfg, jax.random.key(0))
    lines, out = iter(["x" * 60, "hi", "y" * 33, "2 + 2?", ""]), []
    status = chat_session(params, cfg, TOK, TEMPLATE, system="Be brief.", max_new_tokens=2, read=lambda _: next(lines),
                          write=out.append)
    assert status == 0 and len(out) == 4
    prompt = len(TEMPLATE.encode([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x" * 60}],
                                 TOK, generation_prompt=True)[0])
    assert out[0] == (f"(not sent: with this message the prompt is {prompt} tokens and the model reads at most 40, "
                      f"leaving no room for a reply; send a shorter message, or an empty line to end)")
    assert out[1].startswith("model> ") and out[2].startswith("(not sent: with this message the prompt is ")
    assert out[3].startswith("model> ")


    def read_then_eof(_):
        raise EOFError

    assert chat_session(params, cfg, TOK, TEMPLATE, read=read_then_eof, write=out.append) == 0 and len(out) == 4
