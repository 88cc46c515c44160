"""BERT, MPNet and XLM-RoBERTa tokenizers straight from `tokenizer.json`, without importing
transformers.

`transformers.AutoTokenizer` costs a second or more of CPU per process start just to import
(and, for a 250,000-piece XLM-R vocabulary, to rebuild the tokenizer from a Python list), while
the packed forward pass (packed.py) already runs BERT-family models without transformers.

BERT (WordPiece, BertNormalizer, the [CLS] ... [SEP] template; DistilBERT's is the same
tokenizer without token type ids among its inputs): `tokenizer.json` holds
everything: the `tokenizers` library encodes exactly as transformers' fast tokenizer does once
the file's own truncation and padding are switched off (transformers switches them off for a
call without truncation or padding, as the server's are). Only folders where the two agree are
taken:
- `tokenizer_class` BertTokenizer or BertTokenizerFast (DistilBertTokenizer or
  DistilBertTokenizerFast), with a `tokenizer.json`;
- the normalizer's `lowercase`, `strip_accents` and `handle_chinese_chars` equal to
  `do_lower_case`, `strip_accents` and `tokenize_chinese_chars` in `tokenizer_config.json`
  (BertTokenizerFast rebuilds the normalizer from the config when they differ);
- every added token of `tokenizer_config.json` already in `tokenizer.json`.

XLM-RoBERTa (bge-m3, multilingual-e5, KURE, arctic-embed-l-v2.0): transformers 5 does not run
the file's pipeline; it rebuilds one from the file's Unigram pieces and SentencePiece character
map (`XLMRobertaTokenizer.__init__`): that map as the only normalizer, whitespace split then
Metaspace (its prefix space from `add_prefix_space`), `<s> ... </s>`, the unknown piece at id
3, the added tokens of `tokenizer_config.json` with their flags, then its special tokens that
those do not list, from their text alone (a `<mask>` written with flags of its own is added
without them). `XLMRobertaTokenizer` here builds the same from the same parts, taken only
where that is all there is: a Unigram model whose first four pieces are `<s> <pad> </s> <unk>`,
every added or special token already a piece, no `special_tokens_map.json` that says
otherwise. tests/server/test_tokenizer.py compares both with transformers' on multilingual
text, so a transformers release that builds differently fails there.

MPNet (all-mpnet-base-v2): transformers 5 rebuilds it too, from the file's WordPiece vocabulary
with its own defaults, a BertNormalizer from `tokenizer_config.json`, BERT's pre-tokenizer and
`<s> ... </s>` (RobertaProcessing), its special tokens built as MPNetTokenizer's __init__ builds
them (`<mask>` strips the space on its left); `MPNetTokenizer` here builds the same.

For anything else `from_folder` raises ValueError saying why, and the server loads
`AutoTokenizer` instead.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

BERT_CLASSES = ("BertTokenizer", "BertTokenizerFast")
# transformers' DistilBertTokenizer is BertTokenizer with other input names (no token types).
DISTILBERT_CLASSES = ("DistilBertTokenizer", "DistilBertTokenizerFast")
XLMR_CLASSES = ("XLMRobertaTokenizer", "XLMRobertaTokenizerFast")
MPNET_CLASSES = ("MPNetTokenizer", "MPNetTokenizerFast")
# MPNetTokenizer's special tokens and their defaults (its __init__'s).
MPNET_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>",
                  "unk_token": "[UNK]", "pad_token": "<pad>", "mask_token": "<mask>"}  # fmt: skip
XLMR_FIRST_PIECES = ["<s>", "<pad>", "</s>", "<unk>"]
# XLMRobertaTokenizer's special tokens and their defaults (its __init__'s).
XLMR_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>",
                 "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>"}  # fmt: skip
BERT_INPUT_NAMES = ["input_ids", "token_type_ids", "attention_mask"]
NO_LIMIT = int(1e30)  # transformers' VERY_LARGE_INTEGER: no model_max_length configured


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer(Protocol):
    """The part of transformers' tokenizer interface the server uses, which BertTokenizer (and
    its subclasses) offers without transformers."""

    pad_token_id: int | None
    cls_token_id: int | None
    model_max_length: int
    model_input_names: list[str]

    def __call__(self, texts: list[str], **options: bool) -> Any: ...
    def __len__(self) -> int: ...
    def convert_ids_to_tokens(self, ids: list[int]) -> Any: ...
    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> Any: ...


class BertTokenizer:
    """A tokenizer without transformers (BERT's; XLM-R's through the subclass). The part of
    transformers' tokenizer interface the server uses: `__call__` with special
    tokens, their mask and offsets, `len()`, `convert_ids_to_tokens`, `batch_decode`,
    `pad_token_id`, `cls_token_id`, `model_max_length` and `model_input_names`."""

    input_names = BERT_INPUT_NAMES
    """`model_input_names` when tokenizer_config.json names none (the class's own)."""
    classes = BERT_CLASSES
    """The tokenizer_config.json classes this builds as transformers does."""

    def __init__(self, tokenizer: Any, config: dict[str, Any]) -> None:
        self._tokenizer = tokenizer
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.pad_token_id = self._id(config.get("pad_token"))
        self.cls_token_id = self._id(config.get("cls_token"))
        self.eos_token_id = self._id(config.get("eos_token"))
        self.unk_token_id = self._id(config.get("unk_token"))
        max_length = config.get("model_max_length", NO_LIMIT)
        self.model_max_length = int(max_length) if isinstance(max_length, int | float) else NO_LIMIT
        self.model_input_names = list(config.get("model_input_names") or self.input_names)

    def _id(self, token: Any) -> int | None:
        text = _token_text(token)
        return None if text is None else self._tokenizer.token_to_id(text)

    @classmethod
    def from_folder(cls, path: Path) -> BertTokenizer:
        return cls._from_files(path, *_read_folder(path))

    @classmethod
    def _from_files(cls, path: Path, config: dict[str, Any], text: str) -> BertTokenizer:
        """From tokenizer_config.json's `config` and tokenizer.json's `text`."""
        found = config.get("tokenizer_class")
        if found not in cls.classes:
            raise ValueError(f"tokenizer_class {found!r} is not one of {', '.join(cls.classes)}")
        return cls._build(path, config, text)

    @classmethod
    def _build(cls, path: Path, config: dict[str, Any], text: str) -> BertTokenizer:
        spec = json.loads(text)
        normalizer = spec.get("normalizer") or {}
        if normalizer.get("type") != "BertNormalizer":
            raise ValueError(f"normalizer {normalizer.get('type')!r} is not BertNormalizer")
        wanted = {
            "lowercase": config.get("do_lower_case", True),
            "strip_accents": config.get("strip_accents"),
            "handle_chinese_chars": config.get("tokenize_chinese_chars", True),
        }
        for key, value in wanted.items():
            if normalizer.get(key) != value:
                raise ValueError(f"tokenizer.json's {key} differs from tokenizer_config.json")
        known = {token.get("content") for token in spec.get("added_tokens") or []}
        for token in (config.get("added_tokens_decoder") or {}).values():
            if _token_text(token) not in known:
                raise ValueError(f"added token {_token_text(token)!r} is not in tokenizer.json")
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(text), config)

    def __call__(
        self,
        texts: list[str],
        return_special_tokens_mask: bool = False,
        verbose: bool = True,
        add_special_tokens: bool = True,
        return_offsets_mapping: bool = False,
    ) -> dict[str, list[list[Any]]]:
        del verbose  # transformers' warnings about length; the server checks lengths itself
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        result: dict[str, list[list[Any]]] = {"input_ids": [e.ids for e in encodings]}
        if return_special_tokens_mask:
            result["special_tokens_mask"] = [e.special_tokens_mask for e in encodings]
        if return_offsets_mapping:
            result["offset_mapping"] = [list(e.offsets) for e in encodings]
        return result

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._tokenizer.id_to_token(token) or "" for token in ids]

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return self._tokenizer.decode_batch(ids, skip_special_tokens=skip_special_tokens)


class DistilBertTokenizer(BertTokenizer):
    """DistilBERT's: BERT's WordPiece tokenizer whose model takes no token type ids."""

    input_names = ["input_ids", "attention_mask"]
    classes = DISTILBERT_CLASSES


class MPNetTokenizer(BertTokenizer):
    """MPNet's tokenizer (all-mpnet-base-v2), built as transformers 5's MPNetTokenizer builds
    it: the file's WordPiece vocabulary with transformers' defaults, a BertNormalizer from
    tokenizer_config.json, BERT's pre-tokenizer, `<s> ... </s>` (RobertaProcessing), the
    config's added tokens and its special tokens (named as text, they are built as
    MPNetTokenizer builds them: normalized, `<mask>` taking the space before it). Taken only
    where every added and special token is a piece of the vocabulary and no
    special_tokens_map.json says otherwise."""

    input_names = ["input_ids", "attention_mask"]
    classes = MPNET_CLASSES

    def __init__(self, tokenizer: Any, config: dict[str, Any]) -> None:
        super().__init__(tokenizer, {**MPNET_SPECIALS, **config})

    @classmethod
    def _build(cls, path: Path, config: dict[str, Any], text: str) -> MPNetTokenizer:
        spec = json.loads(text)
        specials = _special_tokens(path, config, MPNET_SPECIALS)
        model = spec.get("model") or {}
        vocab = model.get("vocab")
        if model.get("type", "WordPiece") != "WordPiece" or not isinstance(vocab, dict):
            raise ValueError(f"model {model.get('type')!r} is not WordPiece")
        added = (config.get("added_tokens_decoder") or {}).values()
        file_added = spec.get("added_tokens") or []
        for token in [*added, *specials.values(), *file_added]:
            if _token_text(token) not in vocab:
                raise ValueError(f"added token {_token_text(token)!r} is not in the vocabulary")
        return cls(_mpnet_backend(vocab, spec, config, specials), config)


class XLMRobertaTokenizer(BertTokenizer):
    """XLM-RoBERTa's tokenizer, built as transformers 5's XLMRobertaTokenizer builds it."""

    input_names = ["input_ids", "attention_mask"]
    classes = XLMR_CLASSES

    @classmethod
    def _build(cls, path: Path, config: dict[str, Any], text: str) -> XLMRobertaTokenizer:
        spec = json.loads(text)
        specials = _special_tokens(path, config, XLMR_SPECIALS)
        model = spec.get("model") or {}
        if model.get("type") != "Unigram":
            raise ValueError(f"model {model.get('type')!r} is not Unigram")
        vocab = [(str(piece), float(score)) for piece, score in model.get("vocab") or []]
        if [piece for piece, _score in vocab[:4]] != XLMR_FIRST_PIECES:
            raise ValueError("the first pieces are not <s> <pad> </s> <unk>")
        pieces = {piece for piece, _score in vocab}
        added = [*(config.get("added_tokens_decoder") or {}).values(), *specials.values()]
        for token in [*added, *(spec.get("added_tokens") or [])]:
            if _token_text(token) not in pieces:
                raise ValueError(f"added token {_token_text(token)!r} is not a piece")
        return cls(_xlmr_backend(vocab, spec, config, specials), config)


def _xlmr_backend(
    vocab: list[tuple[str, float]],
    spec: dict[str, Any],
    config: dict[str, Any],
    specials: dict[str, Any],
) -> Any:
    """The `tokenizers.Tokenizer` that transformers 5's XLMRobertaTokenizer builds."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram

    tokenizer = Tokenizer(Unigram(vocab=vocab, unk_id=3, byte_fallback=False))
    charsmap = _precompiled_charsmap(spec.get("normalizer"))
    if charsmap is not None:
        tokenizer.normalizer = normalizers.Precompiled(base64.b64decode(charsmap))
    prepend = "always" if config.get("add_prefix_space", True) else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend),
        ]
    )
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    _add_config_tokens(tokenizer, config, spec, specials)
    bos, eos = _token_text(specials["bos_token"]), _token_text(specials["eos_token"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[bos, "$A", eos],
        pair=[bos, "$A", eos, eos, "$B", eos],
        special_tokens=[(bos, tokenizer.token_to_id(bos)), (eos, tokenizer.token_to_id(eos))],
    )
    return tokenizer


def _mpnet_backend(
    vocab: dict[str, int], spec: dict[str, Any], config: dict[str, Any], specials: dict[str, Any]
) -> Any:
    """The `tokenizers.Tokenizer` that transformers 5's MPNetTokenizer builds."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    tokenizer = Tokenizer(WordPiece(vocab, unk_token=_token_text(specials["unk_token"])))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=config.get("tokenize_chinese_chars", True),
        strip_accents=config.get("strip_accents"),
        lowercase=config.get("do_lower_case", True),
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    _add_config_tokens(tokenizer, config, spec, specials, _mpnet_special)
    cls, sep = _token_text(specials["cls_token"]), _token_text(specials["sep_token"])
    tokenizer.post_processor = processors.RobertaProcessing(
        (sep, tokenizer.token_to_id(sep)), (cls, tokenizer.token_to_id(cls)), True, False
    )
    return tokenizer


def _mpnet_special(key: str, text: str) -> Any:
    """A special token MPNetTokenizer's __init__ is given as text: its AddedToken (normalized,
    not stripped; `<mask>` strips the space on its left, "behaves like a normal word")."""
    from tokenizers import AddedToken

    return AddedToken(text, lstrip=key == "mask_token", rstrip=False)


def _special_tokens(path: Path, config: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The special tokens as transformers 5 reads them: tokenizer_config.json's (the class's
    defaults for those it lacks); where the config has no added_tokens_decoder (a config
    written before transformers 4.34, as many hub models' are), special_tokens_map.json's take
    their place, their `{"content": ...}` forms special. ValueError when special_tokens_map.json
    names another token than the config, or (without added_tokens_decoder) an
    added_tokens.json adds tokens: transformers would build those otherwise."""
    specials = {key: config.get(key, default) for key, default in defaults.items()}
    legacy = "added_tokens_decoder" not in config
    special_map = path / "special_tokens_map.json"
    if special_map.is_file():
        for key, value in json.loads(special_map.read_text()).items():
            if key not in defaults or _token_text(value) != _token_text(specials[key]):
                raise ValueError(f"special_tokens_map.json's {key} differs")
            if legacy:
                specials[key] = {**value, "special": True} if isinstance(value, dict) else value
    if legacy and (path / "added_tokens.json").is_file():
        raise ValueError("added_tokens.json without an added_tokens_decoder")
    return specials


def _add_config_tokens(
    tokenizer: Any,
    config: dict[str, Any],
    spec: dict[str, Any],
    specials: dict[str, Any],
    from_text: Callable[[str, str], Any] | None = None,
) -> None:
    """Add the tokens transformers 5's TokenizersBackend adds: the added tokens in id order,
    with their flags (tokenizer_config.json's added_tokens_decoder, or where the config has
    none, as in configs written before transformers 4.34, tokenizer.json's `added_tokens`:
    transformers reads them in its place), then the special tokens not among them, those
    named as special tokens marked special. A special token given as text is built by
    `from_text(key, text)` (the class's __init__'s AddedToken), else as a plain special token;
    one in its `{"content": ...}` form with its own flags."""
    if "added_tokens_decoder" in config:
        decoder = config["added_tokens_decoder"] or {}
        listed = [token for _index, token in sorted(decoder.items(), key=lambda i: int(i[0]))]
    else:
        entries = sorted(spec.get("added_tokens") or [], key=lambda entry: int(entry["id"]))
        listed = [{k: v for k, v in entry.items() if k != "id"} for entry in entries]
    tokens = [_added_token(token) for token in listed]
    named = {_token_text(token) for token in specials.values()}
    for key, token in specials.items():
        text = _token_text(token)
        if text is not None and text not in {str(known) for known in tokens}:
            built = from_text(key, token) if from_text and isinstance(token, str) else None
            tokens.append(built if built is not None else _added_token(token))
    for token in tokens:
        if str(token) in named:
            token.special = True
    tokenizer.add_tokens([token for token in tokens if not token.special])
    tokenizer.add_special_tokens([token for token in tokens if token.special])


def _precompiled_charsmap(normalizer: dict[str, Any] | None) -> str | None:
    """The SentencePiece character map of a Precompiled normalizer (alone or in a Sequence)."""
    if not normalizer:
        return None
    found = normalizer.get("normalizers") if normalizer.get("type") == "Sequence" else [normalizer]
    for item in found or []:
        if item.get("type") == "Precompiled" and item.get("precompiled_charsmap"):
            return item["precompiled_charsmap"]
    return None


def _added_token(token: Any) -> Any:
    """An AddedToken from tokenizer_config.json's form: a string (special) or its fields."""
    from tokenizers import AddedToken

    if isinstance(token, dict):
        flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
        return AddedToken(token["content"], **{key: token[key] for key in flags if key in token})
    return AddedToken(str(token), special=True)


def _read_folder(path: Path) -> tuple[dict[str, Any], str]:
    """tokenizer_config.json, parsed, and tokenizer.json's text; ValueError when either is
    missing."""
    config_file, tokenizer_file = path / "tokenizer_config.json", path / "tokenizer.json"
    if not config_file.is_file() or not tokenizer_file.is_file():
        raise ValueError("no tokenizer.json and tokenizer_config.json")
    return json.loads(config_file.read_text()), tokenizer_file.read_text()


def load_fast(path: Path) -> BertTokenizer:
    """The folder's tokenizer without transformers (BERT's or XLM-R's), or ValueError saying
    why not. Each file is read once."""
    config, text = _read_folder(path)
    if config.get("auto_map"):
        raise ValueError("tokenizer_config.json's auto_map names a tokenizer of the folder's own")
    found = config.get("tokenizer_class")
    cls = next(
        (kind for kind in (XLMRobertaTokenizer, DistilBertTokenizer, MPNetTokenizer)
         if found in kind.classes),
        BertTokenizer,
    )  # fmt: skip
    return cls._from_files(path, config, text)
