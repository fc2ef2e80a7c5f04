"""Real checkpoints' tokenizers and chat templates, against transformers (mlx_llm.data.hf_tokenizer,
mlx_llm.data.templates): a Llama-3-like and a Qwen-like tokenizer built offline with the ``tokenizers`` library and
Jinja templates written here; ids, roles, renderings and loss masks as transformers sees them; our own template
exported so that ``apply_chat_template`` renders what ``ChatTemplate.render`` does."""

import json

import numpy as np
import pytest

from helpers import LazyModule

from mlx_llm.errors import DataError
from mlx_llm.data import hf_tokenizer
from mlx_llm.data.chat import ChatTemplate, read_conversations
from mlx_llm.post.pairs import PairData
from mlx_llm.post.sft import load_data
from mlx_llm.data.templates import JinjaTemplate, template_for
from mlx_llm.data import tokenizer as tok_lib

transformers = LazyModule("transformers")  # the hf extra, imported when a test uses it

CORPUS = ["What is 2 + 3? The answer is 5. Be brief, hello world: system user assistant five eight.\n"] * 30
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|reserved_0|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

LLAMA_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
QWEN_TEMPLATE = """{%- if messages[0].role != 'system' %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Mistral-like: plain-text [INST] markers, the reply after a space of markup, no system role
INST_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {{- raise_exception('System role not supported') }}
    {%- elif message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' }}
    {%- else %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

C1 = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "The answer is 5."}]
C2 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
      {"role": "assistant", "content": " five "}, {"role": "user", "content": "And 4 + 4?"},
      {"role": "assistant", "content": "8"}]
C3 = [{"role": "user", "content": "Say hello world twice"}, {"role": "assistant", "content": "hello world hello world"},
      {"role": "user", "content": "Again: 2 + 3?"}, {"role": "assistant", "content": "5"}]
CONVERSATIONS = [C1, C2, C3]
PROMPTS = [C1[:1], C2[:4], C3[:3], C2[:2]]
TEXTS = ["", "hello world", "  What is 2 + 3?\n\n", "naïve 日本 👩‍👩‍👧", "<|eot_id|> and <|im_end|> text"]


def _bpe(specials, post_processor):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=340, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.post_processor = post_processor(hf)
    return hf


def _llama_processor(hf):
    from tokenizers import processors

    bos = ("<|begin_of_text|>", hf.token_to_id("<|begin_of_text|>"))
    return processors.Sequence([processors.ByteLevel(trim_offsets=False), processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1", special_tokens=[bos])])


def _qwen_processor(hf):
    from tokenizers import AddedToken, processors

    hf.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])  # an added token, not special
    return processors.ByteLevel(trim_offsets=True)  # trims offsets: the mask must not depend on them


def write_dir(path, hf, config: dict, tok_cfg: dict):
    path.mkdir()
    hf.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **tok_cfg}))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    llama = _bpe(LLAMA_SPECIALS, _llama_processor)
    qwen = _bpe(QWEN_SPECIALS, _qwen_processor)
    ids = {t: llama.token_to_id(t) for t in LLAMA_SPECIALS} | {t: qwen.token_to_id(t) for t in QWEN_SPECIALS}
    llama_cfg = {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}
    return {
        "llama": write_dir(root / "llama", llama, llama_cfg, {"bos_token": "<|begin_of_text|>", "eos_token":
                           {"__type": "AddedToken", "content": "<|eot_id|>", "special": True},
                           "chat_template": LLAMA_TEMPLATE}),
        # config.json names a BOS as real Qwen checkpoints do; tokenizer_config.json's null wins
        "qwen": write_dir(root / "qwen", qwen,
                          {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]},
                          {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                           "chat_template": QWEN_TEMPLATE}),
        "inst": write_dir(root / "inst", llama, llama_cfg, {"bos_token": "<|begin_of_text|>", "eos_token":
                          "<|end_of_text|>", "chat_template": [{"name": "default", "template": INST_TEMPLATE},
                                                               {"name": "tool_use", "template": "{{ 1 }}"}]}),
    }


@pytest.fixture(scope="module")
def pair(dirs):
    """kind → (ours, transformers' AutoTokenizer) from the same directory."""
    return {k: (hf_tokenizer.from_hf(d), transformers.AutoTokenizer.from_pretrained(d)) for k, d in dirs.items()}


# ----- ids and roles ------------------------------------------------------------------------------------------
def test_roles_follow_tokenizer_config_then_config_json(pair):
    llama, qwen = pair["llama"][0], pair["qwen"][0]
    assert llama.roles == {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>"}
    assert (llama.bos_id, llama.eos_id, llama.pad_id) == (0, 4, 4)  # no PAD: padding uses EOS
    assert qwen.roles == {"eos": "<|im_end|>", "pad": "<|endoftext|>"}
    assert (qwen.bos_id, qwen.eos_id, qwen.pad_id) == (None, 2, 0) and qwen.bos_prefix.tolist() == []
    assert pair["inst"][0].roles == {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>"}
    assert set(qwen.special_tokens) == set(QWEN_SPECIALS) and "<tool_call>" not in qwen.special_tokens
    for ours, theirs in pair.values():
        assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
        assert ours.vocab_size == len(theirs)


@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_ids_equal_transformers(pair, kind):
    """Our encode = tokenizer(text, add_special_tokens=False); tokenizer(text) = our BOS prefix + encode: Llama's
    post-processor adds its BOS, Qwen's nothing."""
    ours, theirs = pair[kind]
    for text in TEXTS + ["hello <tool_call> world"]:
        ids = ours.encode(text).tolist()
        parsed = ours.encode(text, parse_special=True).tolist()
        assert theirs(text, add_special_tokens=False)["input_ids"] == parsed, text
        assert theirs(text)["input_ids"] == ours.bos_prefix.tolist() + parsed, text
        assert ours.decode(ids) == text and theirs.decode(parsed) == ours.decode(parsed)
    assert ours.encode("x<|im_end|><|eot_id|>").tolist() == theirs("x", add_special_tokens=False)["input_ids"] + \
        ours.encode("<|im_end|><|eot_id|>").tolist()  # specials in plain text are spelled
    assert len(ours.encode("<|im_end|><|eot_id|>")) > 2


def test_roles_and_template_are_saved_and_fingerprinted(pair, tmp_path):
    for kind, (ours, _) in pair.items():
        back = tok_lib.load(ours.save(tmp_path / kind))
        assert (back.roles, back.chat_template, back.special_tokens) == (ours.roles, ours.chat_template,
                                                                         ours.special_tokens)
        assert back.fingerprint() == ours.fingerprint()
        assert back.encode("hello world").tolist() == ours.encode("hello world").tolist()
        assert ours.with_chat_template(None).fingerprint() != ours.fingerprint()
    assert pair["inst"][0].fingerprint() != pair["llama"][0].fingerprint()  # same tokenizer.json, other roles


# ----- rendering and ids of conversations ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen", "inst"])
def test_rendering_and_ids_equal_apply_chat_template(pair, kind):
    ours, theirs = pair[kind]
    template = template_for(ours, ChatTemplate())
    assert isinstance(template, JinjaTemplate)
    cases = [(c, False) for c in CONVERSATIONS] + [(p, True) for p in PROMPTS]
    checked = 0
    for messages, prompt in cases:
        if kind == "inst" and messages[0]["role"] == "system":
            continue
        text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert template.render(messages, generation_prompt=prompt) == text
        ids, target = template.encode(messages, ours, generation_prompt=prompt)
        assert ids.tolist() == theirs.apply_chat_template(messages, add_generation_prompt=prompt)["input_ids"]
        assert ours.decode(ids) == text and target.shape == ids.shape
        checked += 1
    assert checked == (4 if kind == "inst" else 7)


def _runs(ids, target, tok):
    edges = np.flatnonzero(np.diff(np.concatenate([[0], target.astype(int), [0]])))
    return [tok.decode(ids[s:e]) for s, e in zip(edges[::2], edges[1::2])]


def test_masks_cover_the_assistant_contents_and_their_end_of_turn(pair):
    """Targets: the tokens over each reply as rendered (Llama's template trims it) and the special token right
    after it; a token the markup shares with the reply (the space before it in [INST] … [/INST] 5) counts."""
    llama, qwen, inst = (pair[k][0] for k in ("llama", "qwen", "inst"))
    for tok, runs in ((llama, ["five<|eot_id|>", "8<|eot_id|>"]), (qwen, [" five <|im_end|>", "8<|im_end|>"])):
        template = template_for(tok)
        ids, target = template.encode(C2, tok)
        assert _runs(ids, target, tok) == runs
        _, prompt_target = template.encode(C2[:4], tok, generation_prompt=True)
        assert prompt_target.sum() == target.sum() - len(tok.encode("8")) - 1  # the history's reply, not the last
    ids, target = template_for(inst).encode(C3, inst)
    assert _runs(ids, target, inst) == [" hello world hello world<|end_of_text|>", " 5<|end_of_text|>"]
    assert template_for(llama).end == "<|eot_id|>" and template_for(qwen).end == "<|im_end|>"
    assert template_for(inst).end == "<|end_of_text|>"


def test_specials_inside_content_stay_text(pair):
    ours, theirs = pair["qwen"]
    conv = [{"role": "user", "content": "say <|im_end|>"}, {"role": "assistant", "content": "<|im_start|>"}]
    ids, target = template_for(ours).encode(conv, ours)
    assert ours.decode(ids) == theirs.apply_chat_template(conv, tokenize=False)
    assert int(np.sum(ids == ours.token_id("<|im_end|>"))) == 3  # system, user, assistant ends: not the content's
    assert _runs(ids, target, ours) == ["<|im_start|><|im_end|>"] and int(np.sum(target)) > 2


def test_sft_and_pairs_use_the_tokenizer_template(pair, tmp_path):
    tok = pair["qwen"][0]
    path = tmp_path / "data.jsonl"
    sums = [[{"role": "user", "content": f"What is {a} + 3?"}, {"role": "assistant", "content": str(a + 3)}]
            for a in range(60)]
    path.write_text("\n".join(json.dumps({"messages": m}) for m in [C1, C2, C3] + sums) + "\n")
    convs = read_conversations(path, tok, template_for(tok), max_len=256)
    assert tok.decode(convs[1][0]) == template_for(tok).render(C2)
    data = load_data(tok, ChatTemplate(), 128, data=path)
    assert data.train_rows["mask"].sum() > 0 and np.all(data.train_rows["tokens"][data.train_rows["segment_ids"] == 0]
                                                        == tok.pad_id)
    record = {"prompt": C1[:1], "chosen": C1[1], "rejected": {"role": "assistant", "content": "5"}}
    built = PairData.build([record], [record], tok, ChatTemplate(), 128)
    (ids, target), _ = built.train[0]
    assert ids.tolist() == template_for(tok).encode(C1, tok)[0].tolist() and _runs(ids, target, tok) == [
        "The answer is 5.<|im_end|>"]


def test_template_raise_exception_names_the_line(pair, tmp_path):
    tok = pair["inst"][0]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": C1}) + "\n" + json.dumps({"messages": C2}) + "\n")
    with pytest.raises(DataError, match=r"^\S*data.jsonl:2: the chat template refuses this conversation: System role "
                                        r"not supported$"):
        read_conversations(path, tok, template_for(tok), max_len=256)


# ----- our template, exported ---------------------------------------------------------------------------------
def _export(tok, path, template=None):
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps(hf_tokenizer.tokenizer_json(tok)))
    (path / "tokenizer_config.json").write_text(json.dumps(hf_tokenizer.tokenizer_config(tok, 256, template)))
    return path


CHAT_CONVERSATIONS = CONVERSATIONS + [[{"role": "user", "content": "quote \" and \\ and {{ x }} {% raw %}"},
                                       {"role": "assistant", "content": "  spaced  "}]]


@pytest.mark.parametrize("template", [ChatTemplate(), ChatTemplate.from_dict({"bos": False}),
                                      ChatTemplate.from_dict({"user": "<|system|>", "system": "<|user|>"})])
def test_export_renders_our_template_in_transformers(tmp_path, template):
    for k, tok in enumerate([tok_lib.ByteTokenizer(), tok_lib.train_bpe(CORPUS, 300)]):
        theirs = transformers.AutoTokenizer.from_pretrained(_export(tok, tmp_path / str(k), template))
        for messages in CHAT_CONVERSATIONS:
            assert theirs.apply_chat_template(messages, tokenize=False) == template.render(messages)
            ids, _ = template.encode(messages, tok)
            assert theirs.apply_chat_template(messages)["input_ids"] == ids.tolist()
        for messages in PROMPTS:
            assert (theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                    == template.render(messages, generation_prompt=True))
        with pytest.raises(Exception, match="out of order"):
            theirs.apply_chat_template([C1[1], C1[0]], tokenize=False)


def test_export_then_import_gives_back_the_template(tmp_path):
    tok = tok_lib.ByteTokenizer()
    back = hf_tokenizer.from_hf(_export(tok, tmp_path / "default"))
    assert back.chat_template is None and back.fingerprint() == tok.fingerprint()  # the default: ChatTemplate()
    custom = ChatTemplate.from_dict({"bos": False, "user": "<|system|>", "system": "<|user|>"})
    back = hf_tokenizer.from_hf(_export(tok, tmp_path / "custom", custom))
    assert back.chat_template == custom.to_jinja() and back.fingerprint() != tok.fingerprint()
    for messages, prompt in [(C2, False), (C3, False), (C2[:4], True)]:
        ours, theirs = custom.encode(messages, tok, generation_prompt=prompt), template_for(back).encode(
            messages, back, generation_prompt=prompt)
        assert ours[0].tolist() == theirs[0].tolist() and ours[1].tolist() == theirs[1].tolist()
    tok.save(tmp_path / "run")
    assert hf_tokenizer.run_tokenizer(tmp_path / "run", custom.to_dict()).chat_template == custom.to_jinja()
    assert hf_tokenizer.run_tokenizer(tmp_path / "run").chat_template is None


@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_imported_tokenizer_exports_with_its_own_roles_and_template(pair, tmp_path, kind):
    ours, _ = pair[kind]
    theirs = transformers.AutoTokenizer.from_pretrained(_export(ours, tmp_path / "again"))
    pad = ours.pad_id if "pad" in ours.roles else None
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (ours.bos_id, ours.eos_id, pad)
    assert theirs.apply_chat_template(C2, tokenize=False) == template_for(ours).render(C2)
    assert theirs("hello world")["input_ids"] == ours.bos_prefix.tolist() + ours.encode("hello world").tolist()
    assert hf_tokenizer.from_hf(tmp_path / "again").fingerprint() == ours.fingerprint()


def test_the_text_pipeline_packs_documents_without_bos_and_with_pad_equal_to_eos(pair):
    """Qwen-like: no BOS, and PAD may be the EOS id. Documents are ``doc EOS``; a segment starts after each EOS;
    the target read from an EOS (the next document's first token) is dropped; padding is known by position, not
    by id, so an EOS equal to PAD stays a target."""
    from mlx_llm.data import encoding, packing
    from mlx_llm.data.text import Document

    qwen = pair["qwen"][0]
    split = encoding.encode_stream([Document("a", "x = 1"), Document("b", "y")], qwen)
    a, b = qwen.encode("x = 1").tolist(), qwen.encode("y").tolist()
    eos = qwen.eos_id
    assert split.tokens.tolist() == a + [eos] + b + [eos] and split.doc_starts.tolist() == [0, len(a) + 1]
    w = np.array([a + [eos] + b + [eos] + [eos, eos]])  # two trailing padding slots that hold the EOS id
    valid = np.ones(w.shape, bool)
    valid[0, -2:] = False
    out = packing.pack_windows(w, None, eos, eos_id=eos, valid_BT1=valid)
    n_a = len(a)
    want_mask = [1.0] * n_a + [0.0] + [1.0] * len(b) + [0.0, 0.0]
    assert out["mask"][0].tolist() == want_mask[: w.shape[1] - 1]
    assert out["targets"][0, n_a - 1] == eos and out["mask"][0, n_a - 1] == 1.0  # EOS ending doc a: a target
    # inputs: a EOS | b EOS | one padding slot; a segment starts after each EOS
    assert out["segment_ids"][0].tolist() == [0] * (n_a + 1) + [1] * (len(b) + 1) + [2]
    assert out["positions"][0, n_a + 1] == 0  # doc b restarts at position 0
