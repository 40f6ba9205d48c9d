"""The model's own tokenizer and chat template, hardened against special-token injection.

NOTE: user text never becomes special tokens. `encode` treats special-token strings as plain
text; `apply_chat_template` renders the template with each message content replaced by a
sentinel, so only the template's own text can produce special ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from service.engine.families.family import TokenizerQuirks, UnsupportedModelError
from service.engine.values import TEMPLATE_RESERVED

# Trailing tokens the families emit to end a turn, a message or a document (SmolLM and Qwen's
# ChatML, Llama 3's turn and tool-call message ends, Mistral's, Gemma's, Phi-3's): stopping on
# them is safe, and a checkpoint's config often names only one.
_END_MARKERS = (
    *("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>"),
    *("<end_of_turn>", "<|end|>"),
)

# How a family's byte-level BPE splits text before merging (llama.cpp's pre-tokenizer regexes,
# by GGUF `tokenizer.ggml.pre`): Llama 3's keeps runs of up to three digits, Qwen2's single
# digits. SmolLM's and GPT-2's are the tokenizers library's own (below).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# GGUF `tokenizer.ggml.pre` values whose pre-tokenizer we can rebuild exactly.
_GGUF_PRE_TOKENIZERS = ("smollm", "gpt-2", *_GGUF_SPLITS)

_SPACE_PIECE = "\u2581"  # SentencePiece's visible space

# gguf token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Sentinels only ever meet the template's own text, never user content, so a fixed string works.
_SENTINEL = "\ue000pagechat-content-{}\ue001"
_SENTINEL_RE = re.compile("\ue000pagechat-content-(\\d+)\ue001")


class Tokenizer:
    """Wraps a `tokenizers` backend; takes ownership of it (special-token parsing is switched
    off on it, so plain `encode` can never produce a special id)."""

    def __init__(
        self,
        backend: Backend,
        *,
        chat_template: str | None,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        add_bos: bool = False,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("a tokenizer needs at least one eos token id")
        self._backend = backend
        self._backend.encode_special_tokens = True
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        # A raw prompt starts with BOS (`encode_prompt`), as the model was trained; a chat
        # template writes its own.
        self.add_bos = add_bos and bos_token_id is not None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self._specials = {
            tok.content: tid
            for tid, tok in backend.get_added_tokens_decoder().items()
            if tok.special
        }
        # Longest first, so a special that prefixes another never wins the match.
        alternatives = sorted(self._specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, alternatives)) or "(?!)")
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.filters["tojson"] = _tojson
            self._template = env.from_string(chat_template)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, quirks: TokenizerQuirks) -> Tokenizer:
        """Rebuild the tokenizer llama.cpp's converter stored in the metadata: a byte-level BPE
        (`gpt2`: Llama 3, Qwen, SmolLM) or a SentencePiece BPE (`llama`: Gemma's, and Llama 2's,
        Mistral's and Phi-3's), as the file's family stores it (`quirks`: its
        `GGUFFormat.tokenizer`; service.engine.loader.gguf_tokenizer finds it)."""
        if problem := gguf_tokenizer_problem(reader):
            raise UnsupportedModelError(problem)
        kind = _gguf_field(reader, "tokenizer.ggml.model")
        tokens: list[str] = _gguf_field(reader, "tokenizer.ggml.tokens")
        types: list[int] = _gguf_field(reader, "tokenizer.ggml.token_type")
        if kind == "gpt2":
            backend = _byte_level_bpe(reader, tokens)
        else:
            backend = _sentencepiece_from(reader, tokens, quirks)
        # Control and user-defined tokens match whole in the text; not those the model spells
        # otherwise (Gemma's runs of spaces), which would be new ids past the vocabulary.
        kept = backend.get_vocab()
        added = [(tok, t) for i, (tok, t) in enumerate(zip(tokens, types, strict=True))
                 if kept.get(tok) == i]  # fmt: skip
        backend.add_special_tokens(
            [AddedToken(tok, special=True, normalized=False) for tok, t in added
             if t == _TOKEN_CONTROL]
        )  # fmt: skip
        backend.add_tokens(
            [AddedToken(tok, special=False, normalized=False) for tok, t in added
             if t == _TOKEN_USER_DEFINED]
        )  # fmt: skip
        eos = int(_gguf_field(reader, "tokenizer.ggml.eos_token_id"))
        bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id", None)
        template = _gguf_field(reader, "tokenizer.chat_template", None)
        if template is None and all(backend.token_to_id(t) is not None
                                    for t in quirks.template_tokens):  # fmt: skip
            template = quirks.chat_template
        return cls(
            backend,
            chat_template=template,
            eos_token_ids=[eos, *_end_marker_ids(backend)],
            bos_token_id=None if bos is None else int(bos),
            add_bos=bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")),
        )

    @classmethod
    def from_hf_dir(cls, directory: Path) -> Tokenizer:
        """`tokenizer.json`, plus the chat template and eos from the files beside it."""
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        backend = Backend.from_file(str(path))
        config = _read_json(directory / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the unnamed one is "default"
            template = next((t["template"] for t in template if t["name"] == "default"), None)
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        eos: list[int] = []
        eos_token = _token_content(config.get("eos_token"))
        if eos_token is not None and (tid := backend.token_to_id(eos_token)) is not None:
            eos.append(tid)
        for name in ("generation_config.json", "config.json"):
            value = _read_json(directory / name).get("eos_token_id")
            eos.extend([value] if isinstance(value, int) else value or [])
        bos_token = _token_content(config.get("bos_token"))
        bos = None if bos_token is None else backend.token_to_id(bos_token)
        # Whether a raw prompt starts with BOS: as the files' post-processor does it.
        adds_bos = bos is not None and backend.encode("").ids[:1] == [bos]
        return cls(
            backend,
            chat_template=template,
            eos_token_ids=[*eos, *_end_marker_ids(backend)],
            bos_token_id=bos,
            add_bos=bool(config.get("add_bos_token", adds_bos)),
        )

    def encode(self, text: str) -> list[int]:
        """Plain text: special-token strings in `text` tokenize as ordinary characters."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt (no chat template) as the model reads one: `encode`, after BOS where
        the model's files ask for it (Gemma's, Llama's)."""
        ids = self.encode(text)
        if self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_to_id(self, token: str) -> int | None:
        tid: int | None = self._backend.token_to_id(token)
        return tid

    def id_to_token(self, token_id: int) -> str | None:
        token: str | None = self._backend.id_to_token(token_id)
        return token

    def render_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The template's text, special tokens as strings (for display and tests, never for
        tokenizing: use `apply_chat_template`)."""
        checked = [_checked(m) for m in messages]
        return self._render(checked, add_generation_prompt, template_kwargs)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat, with message contents encoded as plain text.

        Equals the tokenizer library's own encoding of `render_chat(...)` when no content
        contains special-token strings: plain runs (template text and contents together) are
        encoded whole, split only at the template's special tokens. `template_kwargs`: more
        variables for the template (`enable_thinking`: TEMPLATE_RESERVED names excepted).
        """
        checked = [_checked(m) for m in messages]
        masked = [{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(checked)]
        parts = _SENTINEL_RE.split(self._render(masked, add_generation_prompt, template_kwargs))
        expected = self._render(checked, add_generation_prompt, template_kwargs)
        contents = [m["content"] for m in checked]
        if _splice(parts, contents) != expected:
            # Some templates trim contents (Llama 3's `| trim`); splice what they would print.
            contents = [c.strip() for c in contents]
            if _splice(parts, contents) != expected:
                raise ValueError("the chat template rewrites message contents; cannot splice")
        ids: list[int] = []
        plain: list[str] = []
        for j, part in enumerate(parts):
            if j % 2:
                plain.append(contents[int(part)])
                continue
            pos = 0
            for match in self._special_re.finditer(part):
                plain.append(part[pos : match.start()])
                ids.extend(self.encode("".join(plain)))
                plain.clear()
                ids.append(self._specials[match.group()])
                pos = match.end()
            plain.append(part[pos:])
        ids.extend(self.encode("".join(plain)))
        return ids

    def backend_json(self) -> str:
        """The whole tokenizer as Hugging Face's `tokenizer.json` text (what llguidance reads)."""
        text: str = self._backend.to_str()
        return text

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    def save_hf(self, directory: Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` as Hugging Face lays them out."""
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            "eos_token": self.id_to_token(self.eos_token_ids[0]),
        }
        if self.bos_token_id is not None:
            config["bos_token"] = self.id_to_token(self.bos_token_id)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    def _render(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template")
        if reserved := TEMPLATE_RESERVED.intersection(template_kwargs or {}):
            raise ValueError(f"the template's own variables cannot be set: {sorted(reserved)}")
        bos = None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)
        return self._template.render(
            **(template_kwargs or {}),
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos or "",
            eos_token=self.id_to_token(self.eos_token_ids[0]),
        )


class IncrementalDetokenizer:
    """Streams text one token at a time without splitting a character.

    A token can end inside a multi-byte UTF-8 character (an emoji spans several byte-level
    tokens); such text decodes to a trailing U+FFFD and is held back until a later token
    completes it. A small window of earlier tokens is re-decoded for context, because some
    decoders (SentencePiece's leading space) render a token differently at a sequence start.
    """

    __slots__ = ("_ids", "_prefix", "_read", "_skip", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens before this have been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completed ('' while a character is partial)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        seen = decode(self._ids[self._prefix : self._read], self._skip)
        text = decode(self._ids[self._prefix :], self._skip)
        if len(text) <= len(seen) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen) :]

    def flush(self) -> str:
        """Whatever is held back, incomplete characters included (at the end of a stream)."""
        seen = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(seen) :]


def _splice(parts: list[str], contents: list[str]) -> str:
    return "".join(contents[int(p)] if j % 2 else p for j, p in enumerate(parts))


def _merge_pair(merge: str) -> tuple[str, str]:
    left, right = merge.split(" ", 1)  # byte-level tokens hold no spaces (they are "Ġ")
    return left, right


def _checked(message: Mapping[str, str]) -> dict[str, str]:
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError("each message needs a string 'role' and a string 'content'")
    return {"role": role, "content": content}


def gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """How a GGUF's byte-level BPE splits text before merging, by its `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GGUF_SPLITS:
        split = pre_tokenizers.Split(Regex(_GGUF_SPLITS[pre]), behavior="isolated")
        bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, bytes_only])
    if pre == "smollm":
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level])
    if pre == "gpt-2":
        return byte_level
    raise ValueError(f"no pre-tokenizer {pre!r}")


def gguf_tokenizer_problem(reader: gguf.GGUFReader) -> str | None:
    """What keeps a GGUF's tokenizer from being rebuilt here, in one line; None: nothing.
    Read from the metadata alone (`loader.check_model` asks before any weight is read)."""
    kind = _gguf_field(reader, "tokenizer.ggml.model")
    instead = "; load the model from its Hugging Face directory instead"
    if kind == "gpt2":
        pre = _gguf_field(reader, "tokenizer.ggml.pre", "gpt-2")
        return (
            None
            if pre in _GGUF_PRE_TOKENIZERS
            else f"unsupported GGUF pre-tokenizer {pre!r}{instead}"
        )
    if kind == "llama":
        return None
    return f"unsupported GGUF tokenizer model {kind!r} (only gpt2 and llama){instead}"


def _byte_level_bpe(reader: gguf.GGUFReader, tokens: list[str]) -> Backend:
    pre = _gguf_field(reader, "tokenizer.ggml.pre", "gpt-2")
    merges: list[str] = _gguf_field(reader, "tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=[_merge_pair(m) for m in merges]))
    backend.pre_tokenizer = gguf_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_from(
    reader: gguf.GGUFReader, tokens: list[str], quirks: TokenizerQuirks
) -> Backend:
    """The SentencePiece BPE of a file, as its family stores it: merges by the file's scores or
    in vocabulary order (Gemma's: earlier tokens merge first), tokens of spaces respelled as
    "▁" where the file stores them as spaces, a space before the text as the file or the
    family says."""
    if quirks.spaces_stored_as_spaces:
        tokens = [_SPACE_PIECE * len(t) if " " in t and not t.strip() else t for t in tokens]
    scores: Sequence[float] = (
        range(0, -len(tokens), -1) if quirks.merges_in_vocabulary_order
        else _gguf_field(reader, "tokenizer.ggml.scores")
    )  # fmt: skip
    prefix_space = quirks.space_prefix
    if prefix_space is None:
        prefix_space = bool(_gguf_field(reader, "tokenizer.ggml.add_space_prefix", True))
    return _sentencepiece(tokens, scores, prefix_space=prefix_space)


def _sentencepiece(
    tokens: Sequence[str], scores: Sequence[float], *, prefix_space: bool
) -> Backend:
    """SentencePiece BPE (Llama 2's, Mistral's, Phi-3's, Gemma's): spaces as "▁", a
    space before the text where the file says so (`add_space_prefix`), no split into words,
    bytes for what the vocabulary lacks; a token that is two pieces of the vocabulary merges
    them, higher-scored tokens first."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Backend(
        models.BPE(
            vocab=vocab, merges=_merges(tokens, scores), unk_token="<unk>",
            fuse_unk=True, byte_fallback=True,
        )
    )  # fmt: skip
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE_PIECE, prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace(_SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges, best first: each token that is two pieces of the
    vocabulary merges them, higher-scored tokens first, then longer left pieces (transformers'
    order, so that both rebuild the same tokenizer from one file)."""
    vocab = set(tokens)
    found: list[tuple[float, int, int, int, str, str]] = []
    for order, (token, score) in enumerate(zip(tokens, scores, strict=True)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-score, -len(left), -len(right), order, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _end_marker_ids(backend: Backend) -> list[int]:
    specials = {tok.content: tid for tid, tok in backend.get_added_tokens_decoder().items()}
    return [specials[m] for m in _END_MARKERS if m in specials]


def _gguf_field(reader: gguf.GGUFReader, key: str, *default: Any) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default:
            return default[0]
        raise ValueError(f"GGUF metadata has no {key!r}")
    return field.contents()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _token_content(token: object) -> str | None:
    if isinstance(token, dict):  # {"content": ..., "lstrip": ...} in older configs
        token = token.get("content")
    return token if isinstance(token, str) else None


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: object, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)
