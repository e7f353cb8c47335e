"""Tokenizer: a `tokenizers.Tokenizer` plus what serving needs around it.

Built from a Hugging Face ``tokenizer.json`` (with ``tokenizer_config.json`` and
``generation_config.json``) or from the vocabulary stored in a GGUF file (byte-level BPE,
``tokenizer.ggml.model == "gpt2"``, or SentencePiece BPE, ``"llama"``).

`token_bytes` gives the exact bytes of one token, and `IncrementalDetokenizer` turns a stream of
token ids into text without ever splitting a UTF-8 character.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

log = logging.getLogger(__name__)

ByteEncoding = Literal["byte_level", "sentencepiece", "text"]

# Special tokens that stop generation like EOS does: end-of-turn markers when the chat template uses
# them, end-of-text markers always (as llama.cpp does: nothing sensible follows them).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>")

# Pre-tokenizer split patterns, by the name GGUF files give them in ``tokenizer.ggml.pre``.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PATTERNS = {
    "llama3": _LLAMA3_PATTERN,
    "llama-v3": _LLAMA3_PATTERN,
    "llama-bpe": _LLAMA3_PATTERN,
    "smaug-bpe": _LLAMA3_PATTERN,
    "dbrx": _LLAMA3_PATTERN,
    "qwen2": _QWEN2_PATTERN,
    "deepseek-r1-qwen": _QWEN2_PATTERN,
}
# GPT-2's own split, optionally after cutting numbers into single digits.
_GPT2_STYLE_PRE = {"default": False, "gpt2": False, "gpt-2": False, "smollm": True, "starcoder": True}
_IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe"})
_NFC_PRE = frozenset({"qwen2", "deepseek-r1-qwen"})

CHUNK_CHARS = 1 << 16
"""Characters per piece when a long text is encoded in pieces (`Tokenizer.encode`)."""
# A cut point: the space between two ASCII letters. In the byte-level split patterns Helios accepts
# (GPT-2's, Llama 3's, Qwen 2's), a letter run never takes the space after it and a space before a
# letter always starts a new pre-token, so the whole text has a pre-token boundary right there.
_SAFE_CUT = re.compile(r"[A-Za-z] (?=[A-Za-z])")

_GGUF_TOKEN_CONTROL = 3
_GGUF_TOKEN_USER_DEFINED = 4
_GGUF_TOKEN_BYTE = 6
_SPM_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPM_SPACE = "\u2581"


class PromptTooLong(Exception):
    """A text has more tokens than the caller's `max_tokens` (`Tokenizer.encode`): their exact number."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(f"{num_tokens} tokens")
        self.num_tokens = num_tokens


class Tokenizer:
    """Text <-> token ids for one model.

    ``encode`` prepends BOS only when the model asks for it (``add_bos_token``) and the text does not
    already start with it; special tokens written in the text (chat markup) are recognised.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], add_bos_token: bool,
                 byte_encoding: ByteEncoding = "byte_level") -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.byte_encoding: ByteEncoding = byte_encoding
        added = backend.get_added_tokens_decoder()
        self._added_text = {token_id: token.content for token_id, token in added.items()}
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, token in added.items() if token.special
        )
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._bytes_cache: dict[int, bytes] = {}
        self._unicode_to_byte = _unicode_to_byte() if byte_encoding == "byte_level" else {}
        # Long texts are encoded in pieces when that gives exactly the whole text's ids (`encode`).
        self.splittable: bool = _is_splittable(backend)
        self.chunk_chars = CHUNK_CHARS

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_hf_files(cls, tokenizer_json: str | Path, tokenizer_config: Mapping[str, Any] | None = None,
                      generation_config: Mapping[str, Any] | None = None,
                      chat_template: str | None = None) -> Tokenizer:
        """From a Hugging Face ``tokenizer.json`` and the parsed ``tokenizer_config.json`` /
        ``generation_config.json`` of the same model directory."""
        text = Path(tokenizer_json).read_text(encoding="utf-8")
        spec = json.loads(text)
        backend = tokenizers.Tokenizer.from_str(text)
        tok_cfg = tokenizer_config or {}
        gen_cfg = generation_config or {}
        bos_token_id = _resolve_token(backend, tok_cfg.get("bos_token"), gen_cfg.get("bos_token_id"))
        eos_token_id = _resolve_token(backend, tok_cfg.get("eos_token"), None)
        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is None:
            # No word from the config: do what the tokenizer's own post-processor does.
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_token_id is not None and probe[:1] == [bos_token_id]
        eos_ids = _eos_ids(backend, eos_token_id, gen_cfg.get("eos_token_id"), chat_template)
        return cls(backend, bos_token_id=bos_token_id, eos_token_ids=eos_ids, add_bos_token=bool(add_bos),
                   byte_encoding=_detect_byte_encoding(spec))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From the ``tokenizer.*`` keys of GGUF metadata (values already decoded to Python)."""
        model = metadata.get("tokenizer.ggml.model")
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        byte_encoding: ByteEncoding
        if model == "gpt2":
            backend = _gguf_byte_level_bpe(metadata, tokens)
            byte_encoding = "byte_level"
        elif model == "llama":
            backend = _gguf_sentencepiece_bpe(metadata, tokens, token_types)
            byte_encoding = "sentencepiece"
        else:
            raise NotImplementedError(f"GGUF tokenizer model {model!r} is not supported (only 'gpt2' and 'llama')")
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, kind in enumerate(token_types) if kind == _GGUF_TOKEN_CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, kind in enumerate(token_types) if kind == _GGUF_TOKEN_USER_DEFINED]
        if special:
            backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)
        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        extra_eos = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")]
        eos_ids = _eos_ids(backend, eos_id, [e for e in extra_eos if e is not None],
                           metadata.get("tokenizer.chat_template"))
        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:
            add_bos = model == "llama"
        return cls(backend, bos_token_id=None if bos_id is None else int(bos_id), eos_token_ids=eos_ids,
                   add_bos_token=bool(add_bos), byte_encoding=byte_encoding)

    # -- text <-> ids ---------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True, *, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`, computed so that nothing else stops while a long text tokenizes:

        - through the backend's batch path, which releases the GIL while it works (its single
          `encode` holds it throughout: a 30 MB prompt froze the event loop and the engine thread
          for 16 s);
        - in pieces of about `chunk_chars` characters when the tokenizer allows it (`splittable`),
          cut only where the whole text's pre-tokenization has a boundary anyway (a space between two
          ASCII letters), so the ids are exactly the whole text's. Each piece's ids become Python
          objects in a short GIL hold, and the backend's working memory (about 130 bytes per input
          byte) is bounded by the piece, not the prompt.

        With `max_tokens`, a text of more tokens raises PromptTooLong with their exact number, and
        its ids past the limit are never made into Python objects (an over-context prompt of 30 MB
        would be millions of them, and building and freeing them are long GIL holds).
        """
        ids: list[int] = []
        num_tokens = 0
        first: int | None = None
        for piece in self._pieces(text):
            encoding = self._backend.encode_batch([piece], add_special_tokens=False)[0]
            num_tokens += len(encoding)
            if max_tokens is not None and num_tokens > max_tokens:
                if first is None and len(encoding):  # without building the piece's ids: an added
                    bos_text = self.bos_token  # token at the very start is matched before anything else
                    first = self.bos_token_id if bos_text and text.startswith(bos_text) else -1
                ids.clear()
                continue
            ids.extend(encoding.ids)
            if first is None and ids:
                first = ids[0]
        bos = self.bos_token_id if add_special_tokens and self.add_bos_token and first != self.bos_token_id else None
        if max_tokens is not None and num_tokens + (bos is not None) > max_tokens:
            raise PromptTooLong(num_tokens + (bos is not None))
        if bos is not None:
            ids.insert(0, bos)
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(text, add_special_tokens) for text in texts]

    def _pieces(self, text: str) -> Iterable[str]:
        size = self.chunk_chars
        if not self.splittable or len(text) < 2 * size:
            yield text
            return
        start = 0
        while len(text) - start >= 2 * size:
            cut = _SAFE_CUT.search(text, start + size)
            if cut is None:
                break
            yield text[start:cut.start() + 1]
            start = cut.start() + 1
        yield text[start:]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token ``token_id`` stands for (special tokens: their UTF-8 text)."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._compute_token_bytes(token_id)
            self._bytes_cache[token_id] = cached
        return cached

    def all_token_bytes(self) -> list[bytes]:
        return [self.token_bytes(i) for i in range(self.vocab_size)]

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def vocabulary_difference(self, other: Tokenizer) -> str | None:
        """Why ``other`` does not map the same ids to the same tokens (None: it does; added and
        special tokens included): what a draft model must share with the model it drafts for."""
        if self.vocab_size != other.vocab_size:
            return f"{self.vocab_size} tokens against {other.vocab_size}"
        mine = self._backend.get_vocab(with_added_tokens=True)
        theirs = other._backend.get_vocab(with_added_tokens=True)
        if mine == theirs:
            return None
        by_id = {i: t for t, i in theirs.items()}
        for token, token_id in sorted(mine.items(), key=lambda kv: kv[1]):
            if by_id.get(token_id) != token:
                return f"token {token_id} is {token!r} against {by_id.get(token_id)!r}"
        return "the vocabularies differ"

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_token_ids

    def incremental_detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def _compute_token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added_text:
            return self._added_text[token_id].encode("utf-8")
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            raise KeyError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
        if self.byte_encoding == "byte_level":
            table = self._unicode_to_byte
            return b"".join(bytes((table[ch],)) if ch in table else ch.encode("utf-8") for ch in piece)
        if self.byte_encoding == "sentencepiece":
            match = _SPM_BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes((int(match.group(1), 16),))
            return piece.replace(_SPM_SPACE, " ").encode("utf-8")
        return self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")


class IncrementalDetokenizer:
    """Per-request streaming detokenizer.

    `push` returns the text that became final with this token: whole UTF-8 characters only (bytes
    of a character split across tokens are held back until it completes); `flush` returns what is
    left at the end (an incomplete character becomes U+FFFD). Special tokens contribute nothing when
    ``skip_special_tokens`` (the default, like vLLM).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(token_id) for token_id in token_ids)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)

    @property
    def has_pending_bytes(self) -> bool:
        return bool(self._decoder.getstate()[0])


def _gguf_byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    pre = str(metadata.get("tokenizer.ggml.pre") or "default")
    merges = [_split_merge(m) for m in metadata.get("tokenizer.ggml.merges") or []]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE))
    pattern = _SPLIT_PATTERNS.get(pre)
    if pattern is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        if pre not in _GPT2_STYLE_PRE:
            log.warning("unknown GGUF pre-tokenizer %r: using GPT-2 splitting", pre)
        steps: list[pre_tokenizers.PreTokenizer] = []
        if _GPT2_STYLE_PRE.get(pre, False):
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if pre in _NFC_PRE:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str],
                            token_types: list[int]) -> tokenizers.Tokenizer:
    scores: list[float] = list(metadata.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))])
    vocab = {token: i for i, token in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    merges = metadata.get("tokenizer.ggml.merges")
    pairs = [_split_merge(m) for m in merges] if merges else _merges_from_scores(tokens, scores, token_types)
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=pairs, unk_token=None if unk_id is None else tokens[int(unk_id)],
        byte_fallback=True, fuse_unk=True,
    ))
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPM_SPACE, prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps: list[decoders.Decoder] = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE stores no merges: a piece is the merge of any two pieces that spell it,
    ranked by the merged piece's score (higher first)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score, kind in zip(tokens, scores, token_types, strict=False):
        if kind != 1 or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _split_merge(merge: str | Sequence[str]) -> tuple[str, str]:
    if isinstance(merge, str):
        left, _, right = merge.partition(" ")
        return left, right
    return merge[0], merge[1]


def _resolve_token(backend: tokenizers.Tokenizer, token: Any, fallback_id: Any) -> int | None:
    """Id of a tokenizer_config token entry (a string or ``{"content": ...}``)."""
    if isinstance(token, Mapping):
        token = token.get("content")
    if isinstance(token, str):
        token_id = backend.token_to_id(token)
        if token_id is not None:
            return token_id
    if isinstance(fallback_id, list):
        fallback_id = fallback_id[0] if fallback_id else None
    return None if fallback_id is None else int(fallback_id)


def _eos_ids(backend: tokenizers.Tokenizer, eos_id: Any, extra: Any, chat_template: str | None) -> list[int]:
    ids: list[int] = []
    if eos_id is not None:
        ids.append(int(eos_id))
    if isinstance(extra, int):
        ids.append(extra)
    elif isinstance(extra, list):
        ids.extend(int(x) for x in extra)
    special = {token.content: token_id for token_id, token in backend.get_added_tokens_decoder().items()
               if token.special}
    if chat_template:
        ids.extend(special[t] for t in END_OF_TURN_TOKENS if t in special and t in chat_template)
    ids.extend(special[t] for t in END_OF_TEXT_TOKENS if t in special)
    return list(dict.fromkeys(ids))


def _detect_byte_encoding(spec: Mapping[str, Any]) -> ByteEncoding:
    decoder = spec.get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds or "Metaspace" in kinds or (spec.get("model") or {}).get("byte_fallback"):
        return "sentencepiece"
    return "text"


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _is_splittable(backend: tokenizers.Tokenizer) -> bool:
    """Whether encoding a text in pieces cut at `_SAFE_CUT` gives exactly the whole text's ids:
    byte-level pre-tokenization by a known split pattern (or GPT-2's built into ByteLevel), digit
    splitting, no normalizer or only position-independent ones, and no added token that a cut could
    split or that takes the whitespace around it."""
    try:
        # Each component's own JSON (``backend.to_str()`` would serialize the whole vocabulary: 0.3 s,
        # and 0.6 s more to parse, for a 152k-token one).
        normalizer = None if backend.normalizer is None else json.loads(backend.normalizer.__getstate__())
        pre = {} if backend.pre_tokenizer is None else json.loads(backend.pre_tokenizer.__getstate__())
    except Exception:  # an unusual backend is simply not split
        return False
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word or any(ch.isspace() for ch in token.content):
            return False
    steps = normalizer.get("normalizers", []) if normalizer and normalizer.get("type") == "Sequence" else \
        [normalizer] if normalizer else []
    if any(step.get("type") not in ("NFC", "NFKC", "Lowercase") for step in steps):
        return False
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    has_byte_level = has_split = False
    for part in parts:
        kind = part.get("type")
        if kind == "ByteLevel":
            has_byte_level = True
            has_split = has_split or bool(part.get("use_regex", True))
        elif kind == "Split":
            pattern = part.get("pattern") or {}
            if pattern.get("Regex") not in _SPLIT_PATTERNS.values() or part.get("invert") \
                    or part.get("behavior") != "Isolated":
                return False
            has_split = True
        elif kind != "Digits":
            return False
    return has_byte_level and has_split
