"""BERT tokenizers straight from `tokenizer.json`, without importing transformers.

`transformers.AutoTokenizer` costs about a second of CPU per process start just to import, and
the packed forward pass (packed.py) already runs BERT-family models without transformers. For a
BERT tokenizer (WordPiece, BertNormalizer, the [CLS] ... [SEP] template) `tokenizer.json` holds
everything: the `tokenizers` library encodes exactly as transformers' fast tokenizer does once
the file's own truncation and padding are switched off (transformers switches them off for a
call without truncation or padding, as the server's are).

Only folders where the two would agree are taken; for anything else `from_folder` raises
ValueError saying why, and the server loads `AutoTokenizer` instead:
- `tokenizer_class` BertTokenizer or BertTokenizerFast, with a `tokenizer.json`;
- the normalizer's `lowercase`, `strip_accents` and `handle_chinese_chars` equal to
  `do_lower_case`, `strip_accents` and `tokenize_chinese_chars` in `tokenizer_config.json`
  (BertTokenizerFast rebuilds the normalizer from the config when they differ);
- every added token of `tokenizer_config.json` already in `tokenizer.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BERT_CLASSES = ("BertTokenizer", "BertTokenizerFast")
BERT_INPUT_NAMES = ["input_ids", "token_type_ids", "attention_mask"]
NO_LIMIT = int(1e30)  # transformers' VERY_LARGE_INTEGER: no model_max_length configured


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class BertTokenizer:
    """The part of transformers' tokenizer interface the server uses: `__call__` with special
    tokens, their mask and offsets, `len()`, `convert_ids_to_tokens`, `batch_decode`,
    `pad_token_id`, `cls_token_id`, `model_max_length` and `model_input_names`."""

    def __init__(self, tokenizer: Any, config: dict[str, Any]) -> None:
        self._tokenizer = tokenizer
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.pad_token_id = self._id(config.get("pad_token"))
        self.cls_token_id = self._id(config.get("cls_token"))
        max_length = config.get("model_max_length", NO_LIMIT)
        self.model_max_length = int(max_length) if isinstance(max_length, int | float) else NO_LIMIT
        self.model_input_names = list(config.get("model_input_names") or BERT_INPUT_NAMES)

    def _id(self, token: Any) -> int | None:
        text = _token_text(token)
        return None if text is None else self._tokenizer.token_to_id(text)

    @classmethod
    def from_folder(cls, path: Path) -> BertTokenizer:
        config_file, tokenizer_file = path / "tokenizer_config.json", path / "tokenizer.json"
        if not config_file.is_file() or not tokenizer_file.is_file():
            raise ValueError("no tokenizer.json and tokenizer_config.json")
        config = json.loads(config_file.read_text())
        if config.get("tokenizer_class") not in BERT_CLASSES:
            raise ValueError(f"tokenizer_class {config.get('tokenizer_class')!r} is not BERT's")
        text = tokenizer_file.read_text()
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
