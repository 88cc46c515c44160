"""pre: a request's inputs to token ids, in the tokenizer threads, never on the event loop:
OpenAI's token ids back to text (with --openai-token-ids), the prompt, the model's tokenizer,
truncation. TEI's /tokenize and /decode run on the same threads."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .metrics import Metrics
from .openai_ids import OpenAITokenIds
from .runner import ModelRunner
from .schemas import EmbedRequest

T = TypeVar("T")


class Preprocessor:
    def __init__(
        self,
        runner: ModelRunner,
        openai_ids: OpenAITokenIds | None,
        pool: ThreadPoolExecutor,
        metrics: Metrics,
    ) -> None:
        self._runner = runner
        self._openai_ids = openai_ids
        self._pool = pool
        self._metrics = metrics
        self.busy = 0
        """Requests being tokenized now: the batcher may wait for them to fill a batch."""

    async def token_ids(
        self, request: EmbedRequest, record: bool = True
    ) -> tuple[list[list[int]], float]:
        """Each input's token ids, and the seconds tokenizing took. Raises InputTooLong, and
        InvalidTokenIds for OpenAI ids that are not the encoding's. `record=False` keeps the
        inputs out of the token-count metric (the server's own requests)."""
        self.busy += 1
        started = time.monotonic()
        try:
            token_ids = await self._in_pool(self._tokenize, request)
        finally:
            self.busy -= 1
        if record:
            for ids in token_ids:
                self._metrics.input_tokens.observe(len(ids))
        return token_ids, time.monotonic() - started

    def _tokenize(self, request: EmbedRequest) -> list[list[int]]:
        texts: Sequence[str | Sequence[int]] = request.texts
        if request.openai_ids:
            assert self._openai_ids is not None  # parse_openai sets it only with the encoding
            texts = self._openai_ids.texts(texts)
        return self._runner.tokenize(
            texts, request.truncate, request.truncate_left, prompt=request.prompt
        )

    async def tokens(
        self, texts: Sequence[str], add_special_tokens: bool, prompt: str | None = None
    ) -> list[list[dict]]:
        """TEI's /tokenize: each text's tokens with their text and byte spans."""
        return await self._in_pool(self._runner.tokens, texts, add_special_tokens, prompt)

    async def decode(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        """TEI's /decode: token ids back to text."""
        return await self._in_pool(self._runner.decode, ids, skip_special_tokens)

    async def _in_pool(self, function: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)
