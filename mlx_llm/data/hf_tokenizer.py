"""Our tokenizers ↔ a transformers tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``).

Export:
- BPE runs already hold a Hugging Face ``tokenizers`` file; it is written as it is.
- A byte tokenizer (ids 0..255 = UTF-8 bytes, specials from 256) becomes a ``tokenizers`` BPE model with no
  merges over GPT-2's byte-to-character alphabet: the byte-level pre-tokenizer spells each byte as one character
  and the vocabulary maps the character of byte b to id b, so every byte is its own token with its own id.
- A tokenizer without a post-processor of its own gets one that puts its BOS first (our runs train on documents
  that start with BOS and prompt with it), so ``tokenizer(text)["input_ids"]`` = [bos] + our ``encode(text)``;
  with ``add_special_tokens=False`` the ids are exactly ours. transformers parses special-token strings in text
  (our ``encode(text, parse_special=True)``); our plain ``encode`` spells them.
- ``tokenizer_config.json`` names the roles' tokens and holds the chat template as Jinja: the tokenizer's own,
  else our ``ChatTemplate`` (``ChatTemplate.to_jinja``), which ``apply_chat_template`` renders exactly as
  ``ChatTemplate.render`` does.

Import reverses this: our BOS post-processor is dropped, a merge-free byte alphabet becomes a ``ByteTokenizer``
again and our default template's Jinja is dropped (the default applies), so an exported run's tokenizer comes
back with the same fingerprint. Any other ``tokenizer.json`` (Llama 3, Qwen, Mistral, …) is imported with its
own special tokens; which of them play BOS / EOS / PAD (``Tokenizer.roles``) is, per role, in this order:
``tokenizer_config.json``'s ``bos_token`` / ``eos_token`` / ``pad_token`` when the key is there (a string or an
AddedToken object; null: the tokenizer has none — Qwen's ``bos_token: null`` wins over config.json's
``bos_token_id``), else ``config.json``'s ``*_token_id`` (a list of EOS ids: the first), else our own token when
the tokenizer has it. A role's token must be an added token of ``tokenizer.json`` (it becomes special); a PAD
that is not one is ignored (padding is never a target). ``added_tokens_decoder`` entries flagged special are
special. The post-processor is kept: Llama 3's adds ``<|begin_of_text|>``, so ``tokenizer(text)`` = [bos] + our
``encode(text)``, and our runs prepend that BOS themselves (``Tokenizer.bos_prefix``); Qwen's adds nothing and
has no BOS, so ``tokenizer(text)`` = our ``encode(text)``. The chat template is ``chat_template.jinja`` when the
directory has one (as transformers reads it), else tokenizer_config.json's ``chat_template`` (a string, or the
list of named templates: the one named "default"); it is compiled, and refused in one line naming the file for a
syntax error or an operation the sandbox forbids (data/templates.py), and when it is empty or renders a conversation
as no text. The directory's files are read where they lie, or through links into the repository's blobs/ of a
snapshot of the Hugging Face hub cache (``hf_file``); any other link out is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mlx_llm.errors import ConfigError, DataError, InputError
from mlx_llm.data.chat import ChatTemplate
from mlx_llm.data import template_sandbox
from mlx_llm.data.templates import JinjaTemplate, TemplateTooCostly
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.settings import JsonProblem, read_json

TOKENIZER_FILE, TOKENIZER_CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
CHAT_TEMPLATE_FILE, HF_CONFIG_FILE = "chat_template.jinja", "config.json"


def byte_chars() -> list[str]:
    """GPT-2's byte → printable character table (the ``tokenizers`` ByteLevel alphabet), indexed by byte:
    printable Latin-1 bytes stand for themselves, the other 68 map to U+0100 onwards in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def _byte_level_json(tok: tok_lib.ByteTokenizer) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(byte_chars())}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(list(tok.special_tokens))
    return json.loads(hf.to_str())


def _bos_processor(bos: str, bos_id: int) -> dict:
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def tokenizer_json(tok: tok_lib.Tokenizer) -> dict:
    """The ``tokenizers`` JSON of ``tok``; without a post-processor of its own, one that puts BOS first."""
    obj = _byte_level_json(tok) if isinstance(tok, tok_lib.ByteTokenizer) else json.loads(tok.hf.to_str())
    if obj.get("post_processor") is None and tok.bos_id is not None:
        obj["post_processor"] = _bos_processor(tok.roles["bos"], tok.bos_id)
    return obj


def chat_template_source(tok: tok_lib.Tokenizer, template=None) -> str | None:
    """The Jinja chat template export writes: the tokenizer's own, else ``template`` (a ``ChatTemplate``, by
    default ours) as Jinja when the tokenizer holds its markers, else None."""
    if tok.chat_template is not None:
        return tok.chat_template
    template = ChatTemplate() if template is None else template
    try:
        template.check_tokenizer(tok)
    except InputError:
        return None
    return template.to_jinja()


def tokenizer_config(tok: tok_lib.Tokenizer, max_len: int, template=None) -> dict:
    """``tokenizer_config.json``: load ``tokenizer.json`` as it is (``PreTrainedTokenizerFast``), name the
    roles' tokens, add BOS (as the post-processor does) when there is one, and the chat template
    (``chat_template_source``)."""
    named = set(tok.roles.values())
    others = [t for t in tok.special_tokens if t not in named]
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.roles.get("bos"),
           "eos_token": tok.roles["eos"], "pad_token": tok.roles.get("pad"), "extra_special_tokens": others,
           "add_bos_token": "bos" in tok.roles, "add_eos_token": False, "model_max_length": max_len,
           "clean_up_tokenization_spaces": False}
    source = chat_template_source(tok, template)
    return out if source is None else {**out, "chat_template": source}


def special_ids(tok: tok_lib.Tokenizer) -> dict[str, int | None]:
    """config.json's token ids of the roles (None for a role the tokenizer lacks)."""
    return {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id if "pad" in tok.roles else None}


def run_tokenizer(run_dir, template: dict | None = None) -> tok_lib.Tokenizer:
    """A run's tokenizer as export writes it: carrying the run's recorded ``ChatTemplate`` (``template``, its
    dict) as Jinja when it has no chat template of its own and holds the template's markers."""
    tok = tok_lib.load(run_dir)
    if tok.chat_template is None and template:
        source = chat_template_source(tok, ChatTemplate.from_dict(template))
        tok = tok if source is None else tok.with_chat_template(source)
    return tok


# ----- import -------------------------------------------------------------------------------------------------
def hub_blobs(root: Path) -> Path | None:
    """The ``blobs/`` directory of the Hugging Face hub repository whose snapshot is ``root`` (a resolved path of
    the shape ``…/models--ORG--NAME/snapshots/<rev>``), or None when ``root`` is no such snapshot. blobs/ must be
    a directory of its own, not a link (which could lead anywhere)."""
    blobs = root.parent.parent / "blobs"
    return blobs if root.parent.name == "snapshots" and blobs.is_dir() and not blobs.is_symlink() else None


def hf_file(hf_dir, name, what: str, error: type[Exception] = DataError) -> Path:
    """``hf_dir / name`` for a file name of a transformers directory (untrusted: a fixed name, or a shard an index
    names), once checked. The name must stay inside ``hf_dir`` (not absolute, not climbing out with ``..``), and
    where it is a link, the link must resolve inside ``hf_dir`` or, when ``hf_dir`` is a snapshot of the hub cache
    (``snapshots/<rev>``, whose files are links to ``../../blobs/<sha256>``), inside its repository's ``blobs/``
    (``hub_blobs``); anything else raises ``error`` in one line naming the name, ``what`` named it, and the link's
    target. The file need not exist (callers check); a file read through a link has the size limits of a plain
    one (the readers stat what they open)."""
    if not isinstance(name, str) or not name:
        raise error(f"{what} names {name!r}, not a file name")
    root = Path(hf_dir).resolve()
    if Path(name).is_absolute() or not Path(os.path.normpath(root / name)).is_relative_to(root):
        raise error(f"{what} names {name!r}, which is outside {hf_dir}: a checkpoint directory's files must lie "
                    f"inside it")
    path, blobs = (root / name).resolve(), hub_blobs(root)
    if path.is_relative_to(root) or (blobs is not None and path.is_relative_to(blobs)):
        return Path(hf_dir) / name
    where = (f"inside it or in its repository's {blobs}" if blobs else
             "inside it (or, in a snapshot of the Hugging Face hub cache, in its repository's blobs/)")
    raise error(f"{what} names {name!r}, which is outside {hf_dir}: it is a link to {path}; a checkpoint "
                f"directory's files must lie {where}")


def _read_json(path: Path, required: bool) -> dict:
    path = hf_file(path.parent, path.name, str(path.parent), DataError)  # a link may not lead out
    if not path.is_file():
        if required:
            raise DataError(f"{path.parent} has no {path.name}: an imported run needs the tokenizer that matches its "
                            f"embedding (a transformers 'fast' tokenizer file)")
        return {}
    try:
        obj = read_json(path)
    except JsonProblem as exc:
        raise DataError(f"{path} cannot be read as JSON: {exc.detail}" + (f" (line {exc.line})" if exc.line else "")
                        ) from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} is not a JSON object")
    return obj


def _token_string(value, where: Path, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken object, or null."""
    if value is None or (isinstance(value, str) and value):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str) and value["content"]:
        return value["content"]
    raise DataError(f"{where}: {key} = {value!r:.80} is not a token (a string, an AddedToken object or null)")


def _role_token(role: str, added: dict, tok_cfg: dict, config: dict, hf_dir: Path) -> str | None:
    """The token playing ``role`` (the order of the module docstring), checked to be an added token."""
    key, id_key = f"{role}_token", f"{role}_token_id"
    if key in tok_cfg:
        where, what = hf_dir / TOKENIZER_CONFIG_FILE, key
        token = _token_string(tok_cfg[key], where, key)
    elif config.get(id_key) is not None:
        ids = config[id_key] if isinstance(config[id_key], list) else [config[id_key]]
        where, what = hf_dir / HF_CONFIG_FILE, f"{id_key} = {config[id_key]!r}"
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise DataError(f"{where}: {what} is not a token id (an integer, or a list of them for eos)")
        by_id = {t["id"]: t["content"] for t in added.values()}
        token = by_id.get(ids[0])
        if token is None and role != "pad":
            raise DataError(f"{where}: {what} names no added token of {TOKENIZER_FILE}: mlx_llm needs the {role} "
                            f"token to be a special token")
    else:
        token = tok_lib.DEFAULT_ROLES[role] if tok_lib.DEFAULT_ROLES[role] in added else None
        where, what = hf_dir / TOKENIZER_FILE, role
    if token is not None and token not in added:
        if role == "pad":
            return None
        raise DataError(f"{where}: {what} is {token!r}, which is not an added token of {TOKENIZER_FILE}: mlx_llm "
                        f"needs the {role} token to be a special token")
    return token


def _roles(obj: dict, tok_cfg: dict, config: dict, hf_dir: Path) -> dict[str, str]:
    added = {t["content"]: t for t in obj.get("added_tokens", [])}
    roles = {role: _role_token(role, added, tok_cfg, config, hf_dir) for role in tok_lib.TOKEN_ROLES}
    if roles["eos"] is None:
        raise DataError(f"{hf_dir}: no end-of-sequence token: neither {TOKENIZER_CONFIG_FILE}'s eos_token nor "
                        f"{HF_CONFIG_FILE}'s eos_token_id names one (mlx_llm ends every document with it)")
    return {role: token for role, token in roles.items() if token is not None}


def _mark_specials(obj: dict, tok_cfg: dict, roles: dict, hf_dir: Path) -> list[str]:
    """Flag as special (in ``obj``) the roles' tokens and added_tokens_decoder's special entries; the specials
    in id order."""
    added = {t["content"]: t for t in obj.get("added_tokens", [])}
    decoder = tok_cfg.get("added_tokens_decoder") or {}
    flagged = set(roles.values())
    for key, entry in (decoder.items() if isinstance(decoder, dict) else ()):
        if isinstance(entry, dict) and entry.get("special"):
            content = entry.get("content")
            if content not in added or str(added[content]["id"]) != str(key):
                raise DataError(f"{hf_dir / TOKENIZER_CONFIG_FILE}: added_tokens_decoder has {content!r} at id {key}, "
                                f"which {TOKENIZER_FILE} does not: the two files describe different tokenizers")
            flagged.add(content)
    for content in flagged:
        added[content]["special"] = True
    return [t["content"] for t in sorted(added.values(), key=lambda t: t["id"]) if t.get("special")]


def _chat_template(hf_dir: Path, tok_cfg: dict) -> tuple[str | None, Path]:
    """(source or None, the file it came from): chat_template.jinja, else tokenizer_config.json's."""
    jinja = hf_file(hf_dir, CHAT_TEMPLATE_FILE, str(hf_dir), DataError)
    if jinja.is_file():
        return _read_template(jinja), jinja
    where, value = hf_dir / TOKENIZER_CONFIG_FILE, tok_cfg.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise DataError(f"{where}: chat_template lists the templates {sorted(map(str, named))}, none named "
                            f"'default' (the one mlx_llm uses)")
        value = named["default"]
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: chat_template must be a Jinja string or a list of named templates, got "
                        f"{type(value).__name__}")
    return value, where


def _read_template(path: Path) -> str:
    """chat_template.jinja as text, never reading more than a template's source may hold (``MAX_SOURCE_CHARS``
    characters of at most 4 UTF-8 bytes each): a larger file is refused before it is read whole."""
    limit = 4 * template_sandbox.MAX_SOURCE_CHARS
    try:
        with path.open("rb") as fh:
            raw = fh.read(limit + 1)
        if len(raw) > limit:
            raise DataError(f"{path}: the chat template is refused: its file is more than {limit:,} bytes (a "
                            f"template's source may have at most {template_sandbox.MAX_SOURCE_CHARS:,} characters)")
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} cannot be read as text: {exc}") from None


def _checked_template(source: str, where: Path, tok: tok_lib.Tokenizer) -> None:
    """Refuse an empty template, compile it and render a short conversation with it: a syntax error, an operation
    the sandbox forbids, a rendering past the sandbox's deadline, memory cap or output limit, or one that is no
    text at all refuses the import (its own ``raise_exception`` does not: it judges conversations). An empty
    template would render every prompt as no tokens, which no model can continue."""
    field = "the file" if where.name == CHAT_TEMPLATE_FILE else "chat_template"
    if not source.strip():
        raise DataError(f"{where}: {field} is {'empty' if not source else 'whitespace only'}: it would render "
                        f"every conversation as no text; remove it (the model then has no chat template of its own) "
                        f"or give the model's template")
    template = JinjaTemplate(source, tok, str(where))
    for messages, prompt in (([{"role": "user", "content": "Hi"}], True),
                             ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello"}], False)):
        try:
            text = template.render(messages, generation_prompt=prompt)
        except TemplateTooCostly as err:
            raise DataError(f"{where}: the chat template is refused: {str(err).partition(': ')[2]}") from None
        except InputError:
            continue
        if not text.strip():
            raise DataError(f"{where}: the chat template is refused: it renders the conversation {messages!r} as "
                            f"{text!r}, no text to send a model")


def from_hf(hf_dir: Path, config: dict | None = None) -> tok_lib.Tokenizer:
    """Our tokenizer from ``hf_dir``'s tokenizer.json, tokenizer_config.json and chat template, with the roles
    they and ``config`` (config.json's dict; read from ``hf_dir`` when None) give (the module docstring)."""
    hf_dir = Path(hf_dir)
    path = hf_dir / TOKENIZER_FILE
    obj = _read_json(path, required=True)
    tok_cfg = _read_json(hf_dir / TOKENIZER_CONFIG_FILE, required=False)
    config = _read_json(hf_dir / HF_CONFIG_FILE, required=False) if config is None else config
    roles = _roles(obj, tok_cfg, config, hf_dir)
    specials = _mark_specials(obj, tok_cfg, roles, hf_dir)
    source, where = _chat_template(hf_dir, tok_cfg)
    try:
        tok = _build(obj, specials, roles, path)
    except ConfigError as err:
        raise DataError(f"{path}: {err}") from None
    if source is not None:
        _checked_template(source, where, tok)
        ours = roles == tok_lib.DEFAULT_ROLES and source == chat_template_source(tok)
        tok = tok if ours else tok.with_chat_template(source)  # our default template: ChatTemplate() applies
    return tok


def _build(obj: dict, specials: list[str], roles: dict, path: Path) -> tok_lib.Tokenizer:
    if _is_byte_alphabet(obj, specials):
        return tok_lib.ByteTokenizer(specials, roles=roles)
    if "bos" in roles and obj.get("post_processor") == _bos_processor(roles["bos"], _id_of(obj, roles["bos"])):
        obj["post_processor"] = None
    from tokenizers import Tokenizer

    try:
        hf = Tokenizer.from_str(json.dumps(obj))
    except Exception as exc:  # the Rust side raises its own exception type
        raise DataError(f"{path} could not be read by tokenizers: {exc}") from None
    return tok_lib.BPETokenizer(hf, specials, roles=roles)


def _id_of(obj: dict, token: str) -> int:
    return next(t["id"] for t in obj["added_tokens"] if t["content"] == token)


def _is_byte_alphabet(obj: dict, specials: list[str]) -> bool:
    model = obj.get("model") or {}
    ids = sorted(t["id"] for t in obj.get("added_tokens", []) if t.get("special"))
    return (model.get("type") == "BPE" and not model.get("merges")
            and model.get("vocab") == {c: b for b, c in enumerate(byte_chars())}
            and ids == list(range(256, 256 + len(specials))) and len(obj.get("added_tokens", [])) == len(specials))
