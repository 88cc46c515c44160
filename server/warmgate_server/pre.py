"""pre: a request's inputs to token ids, in the tokenizer threads, never on the event loop:
OpenAI's token ids back to text (with --openai-token-ids), the prompt, the model's tokenizer,
truncation (`Tokenization`, synchronous; `Preprocessor` runs it in the threads). TEI's
/tokenize and /decode run on the same threads."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .errors import InputTooLong, NotAPair
from .metrics import Metrics
from .openai_ids import OpenAITokenIds
from .schemas import EmbedRequest
from .tokenizer import BertTokenizer, Tokenizer

T = TypeVar("T")


class TokenIds(list):
    """One input's token ids, and how many of its first tokens pooling leaves out: the prompt
    of a model whose Pooling says include_prompt: false (0: pool them all); for a pair, where
    its second text's tokens begin (`type_from`: token type 1 from there, as the tokenizer
    marks them; None: every token is of type 0)."""

    __slots__ = ("pool_from", "type_from")

    def __init__(
        self, ids: Sequence[int] = (), pool_from: int = 0, type_from: int | None = None
    ) -> None:
        super().__init__(ids)
        self.pool_from = pool_from
        self.type_from = type_from


def _leading_ones(mask: Sequence[int]) -> int:
    count = 0
    for value in mask:
        if value != 1:
            break
        count += 1
    return count


class ChatPairs:
    """How a causal-LM re-ranker's pairs become conversations for its chat template."""

    def __init__(self, system: str = "") -> None:
        self.system = system
        """The model's default prompt (its instruction), a system message first; "": none."""
        self.suffix: list[int] | None = None
        """The template's fixed tail in tokens, once found (Tokenization._chat_suffix)."""

    def messages(self, query: str, document: str) -> list[dict[str, str]]:
        pair = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        return [{"role": "system", "content": self.system}, *pair] if self.system else pair


class Tokenization:
    """A served model's inputs to token ids, as the model's settings say: its default prompt,
    lowercasing, the input limit and truncation. Stateless but for a cache of prompt lengths:
    any tokenizer thread may call it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_input_length: int,
        prompt: str = "",
        include_prompt: bool = True,
        lowercase: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        """warmgate's own (tokenizer.py) or transformers' fast tokenizer."""
        self.max_input_length = max_input_length
        # The model's default prompt, put before every input as sentence-transformers does.
        self.prompt = prompt
        self.include_prompt = include_prompt
        """False: a prompt's tokens are left out of the pooling (TokenIds.pool_from)."""
        self.lowercase = lowercase
        """sentence_bert_config.json's do_lower_case: lowercase every text first."""
        self._prompt_lengths: dict[str, int] = {}
        self.chat: ChatPairs | None = None
        """A causal-LM re-ranker's: each pair rendered by the tokenizer's chat template."""
        # warmgate's BERT tokenizer is stateless; transformers' sets truncation and padding on
        # its Rust tokenizer at each call, which raises when two threads call at once.
        self._tokenizer_lock = None if isinstance(tokenizer, BertTokenizer) else threading.Lock()

    def _encode(
        self, strings: list[str], pairs: list[str | None] | None = None, **options: object
    ) -> dict:
        """`strings` (with `pairs`: each the first text of a pair, its second there; transformers'
        tokenizers only, which loading gives every re-ranker and classifier) through the
        tokenizer."""
        arguments = (strings,) if pairs is None else (strings, pairs)
        if self._tokenizer_lock is None:
            return self.tokenizer(*arguments, verbose=False, **options)
        with self._tokenizer_lock:
            return self.tokenizer(*arguments, verbose=False, **options)

    def tokenize(
        self,
        texts: Sequence[str | Sequence[int]],
        truncate: bool = False,
        truncate_left: bool = False,
        max_length: int | None = None,
        prompt: str | None = None,
    ) -> list[list[int]]:
        """Token ids with special tokens, unpadded. Raises InputTooLong unless truncating.

        An input given as token ids is taken as it is (the model's own ids, no special tokens
        added, no prompt), as text-embeddings-inference does. Texts get `prompt` before them
        (None: the model's default prompt). Truncation keeps the model's
        special tokens and cuts the text between them, on the right (end of the text) or the
        left (start of the text).

        Every text is tokenized whole, however long, and judged on its tokens alone: no count
        of characters bounds a text's tokens (10,000 spaces are no token to WordPiece and
        thousands to a byte-level BPE), so cutting or refusing a text on its characters first
        served other tokens than the tokenizer's, or refused a text of a few tokens (issue
        41). --payload-limit bounds the cost: one string of the default 2 MB took 0.1 to 2 s of
        one AMD EPYC core to tokenize, whatever its text and whichever the tokenizer
        (WordPiece and SentencePiece in tokenizer.py, byte-level BPE in transformers), and
        truncating saves none of it (transformers' tokenizers also cut after tokenizing).
        """
        limit = max_length or self.max_input_length
        strings = [text for text in texts if isinstance(text, str)]
        prompt = self.prompt if prompt is None else prompt
        if prompt:
            strings = [prompt + text for text in strings]
        if self.lowercase:
            strings = [text.lower() for text in strings]
        pool_from = 0 if self.include_prompt or not prompt else self._prompt_length(prompt)
        encoded = (
            self._encode(strings, return_special_tokens_mask=True)
            if strings
            else {"input_ids": [], "special_tokens_mask": []}
        )
        pairs = iter(zip(encoded["input_ids"], encoded["special_tokens_mask"], strict=True))
        result = []
        for index, item in enumerate(texts):
            skip = 0
            if isinstance(item, str):
                ids, special = next(pairs)
                skip = pool_from
            else:
                ids, special = list(item), [0] * len(item)
            if len(ids) > limit:
                if not truncate:
                    raise InputTooLong(index, len(ids), limit)
                head = _leading_ones(special)
                tail = _leading_ones(special[::-1])
                room = max(limit - head - tail, 0)
                content = ids[head : len(ids) - tail]
                content = content[len(content) - room :] if truncate_left else content[:room]
                ids = ids[:head] + content + ids[len(ids) - tail :]
            result.append(TokenIds(ids, skip) if skip else ids)
        return result

    def tokenize_pairs(
        self, first: Sequence[str], second: Sequence[str | None], truncate: bool = False
    ) -> list[list[int]]:
        """Each (first, second) pair as one input, as sentence-transformers' CrossEncoder
        encodes it (its tokenizer's pair template: [CLS] a [SEP] b [SEP], <s> a </s></s> b
        </s>; token type 1 for the second text where the model has token types), or a text
        alone where `second` is None. Over the input limit: InputTooLong unless `truncate`,
        which cuts the longer text first (CrossEncoder's longest_first). Lowercased where the
        folder says so; no prompt (a cross-encoder has none)."""
        limit = self.max_input_length
        if self.chat is not None:
            return self._chat_pairs(first, second, truncate)
        if self.lowercase:
            first = [text.lower() for text in first]
            second = [None if text is None else text.lower() for text in second]
        options: dict = {"return_token_type_ids": True}
        if truncate:
            options.update(truncation="longest_first", max_length=limit)
        # Two batched calls (the pairs, the texts alone): the tokenizer's Rust side takes a
        # batch in one call, where a call per input cost 0.16-0.25 ms each.
        encoded: dict[int, tuple[list[int], list[int] | None]] = {}
        pairs = [index for index, text in enumerate(second) if text is not None]
        alone = [index for index, text in enumerate(second) if text is None]
        for indices, paired in ((pairs, True), (alone, False)):
            if not indices:
                continue
            texts = [first[index] for index in indices]
            others = [second[index] for index in indices] if paired else None
            batch = self._encode(texts, others, **options)
            types = batch.get("token_type_ids")
            for row, index in enumerate(indices):
                encoded[index] = (batch["input_ids"][row], types[row] if types else None)
        ids: list[list[int]] = []
        for index in range(len(first)):
            tokens, types = encoded[index]
            if len(tokens) > limit:
                raise InputTooLong(index, len(tokens), limit)
            type_from = types.index(1) if types and 1 in types else None
            ids.append(TokenIds(tokens, 0, type_from))
        return ids

    def _chat_pairs(
        self, first: Sequence[str], second: Sequence[str | None], truncate: bool
    ) -> list[list[int]]:
        """Each pair as sentence-transformers' CrossEncoder gives a causal-LM re-ranker its
        input: a `query` and a `document` message (the model's default prompt a `system`
        message before them), rendered and tokenized by the tokenizer's apply_chat_template.
        Over the input limit: InputTooLong unless `truncate`, which keeps the first tokens and
        writes the template's fixed tail back over the last ones (CrossEncoder's
        restore_suffix: the score is read at the last token). NotAPair for a text alone."""
        chat = self.chat
        assert chat is not None
        conversations = []
        for index, (query, document) in enumerate(zip(first, second, strict=True)):
            if document is None:
                raise NotAPair(index)
            conversations.append(chat.messages(query, document))
        ids = self._render(conversations) if conversations else []
        limit = self.max_input_length
        result: list[list[int]] = []
        for index, tokens in enumerate(ids):
            if len(tokens) > limit:
                if not truncate:
                    raise InputTooLong(index, len(tokens), limit)
                tokens = tokens[:limit]
                suffix = self._chat_suffix()
                keep = min(len(suffix), limit)
                if keep:
                    tokens[limit - keep :] = suffix[len(suffix) - keep :]
            result.append(tokens)
        return result

    def _render(self, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
        """apply_chat_template's token ids of each conversation (no padding, no truncation),
        under the tokenizer's lock (it calls the tokenizer)."""
        assert self._tokenizer_lock is not None
        with self._tokenizer_lock:
            encoded = self.tokenizer.apply_chat_template(  # type: ignore[union-attr]
                conversations, tokenize=True, return_dict=True
            )
        return [list(ids) for ids in encoded["input_ids"]]

    def _chat_suffix(self) -> list[int]:
        """The chat template's fixed tail in tokens, found as sentence-transformers finds it:
        the pair rendered with two fillers ("0", "1 2 3 4"), the longest run of tokens the two
        end with (none when they never differ)."""
        chat = self.chat
        assert chat is not None
        if chat.suffix is None:
            one, two = self._render([chat.messages("0", "0"), chat.messages("1 2 3 4", "1 2 3 4")])
            count = 0
            for left, right in zip(reversed(one), reversed(two), strict=False):
                if left != right:
                    break
                count += 1
            chat.suffix = one[len(one) - count :] if 0 < count < min(len(one), len(two)) else []
        return chat.suffix

    def _prompt_length(self, prompt: str) -> int:
        """The prompt's tokens at the start of an input, as sentence-transformers counts them
        for include_prompt: false: the prompt tokenized alone, less a trailing special token."""
        if prompt not in self._prompt_lengths:
            text = prompt.lower() if self.lowercase else prompt
            encoded = self._encode([text], return_special_tokens_mask=True)
            ids, special = encoded["input_ids"][0], encoded["special_tokens_mask"][0]
            self._prompt_lengths[prompt] = len(ids) - (1 if ids and special[-1] else 0)
        return self._prompt_lengths[prompt]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def tokens(
        self, texts: Sequence[str], add_special_tokens: bool, prompt: str | None = None
    ) -> list[list[dict]]:
        """Each text's tokens as text-embeddings-inference's /tokenize lists them: id, text,
        special, and the UTF-8 byte span of the text it came from (none for special tokens).
        Texts get `prompt` before them (None: the model's default prompt)."""
        tokenizer = self.tokenizer
        prompt = self.prompt if prompt is None else prompt
        if prompt:
            texts = [prompt + text for text in texts]
        encoded = self._encode(
            list(texts),
            add_special_tokens=add_special_tokens,
            return_offsets_mapping=True,
            return_special_tokens_mask=True,
        )
        result = []
        for text, ids, offsets, special in zip(
            texts,
            encoded["input_ids"],
            encoded["offset_mapping"],
            encoded["special_tokens_mask"],
            strict=True,
        ):
            names = tokenizer.convert_ids_to_tokens(ids)
            tokens = []
            for token_id, (start, stop), is_special, name in zip(
                ids, offsets, special, names, strict=True
            ):
                if is_special:
                    tokens.append(
                        {"id": token_id, "text": name, "special": True, "start": None, "stop": None}
                    )
                    continue
                begin = len(text[:start].encode())
                end = begin + len(text[start:stop].encode())
                tokens.append(
                    {
                        "id": token_id,
                        "text": text[start:stop],
                        "special": False,
                        "start": begin,
                        "stop": end,
                    }
                )
            result.append(tokens)
        return result

    def decode(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        lists, tokenizer = [list(item) for item in ids], self.tokenizer
        if self._tokenizer_lock is None:
            return tokenizer.batch_decode(lists, skip_special_tokens=skip_special_tokens)
        with self._tokenizer_lock:
            return tokenizer.batch_decode(lists, skip_special_tokens=skip_special_tokens)


class Preprocessor:
    def __init__(
        self,
        tokenization: Tokenization,
        openai_ids: OpenAITokenIds | None,
        pool: ThreadPoolExecutor,
        metrics: Metrics,
    ) -> None:
        self._tokenization = tokenization
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
        if request.second is not None:  # a re-ranker's pairs, a classifier's texts or pairs
            strings = [str(text) for text in request.texts]
            return self._tokenization.tokenize_pairs(strings, request.second, request.truncate)
        texts: Sequence[str | Sequence[int]] = request.texts
        if request.openai_ids:
            assert self._openai_ids is not None  # parse_openai sets it only with the encoding
            texts = self._openai_ids.texts(texts)
        return self._tokenization.tokenize(
            texts, request.truncate, request.truncate_left, prompt=request.prompt
        )

    async def tokens(
        self, texts: Sequence[str], add_special_tokens: bool, prompt: str | None = None
    ) -> list[list[dict]]:
        """TEI's /tokenize: each text's tokens with their text and byte spans."""
        return await self._in_pool(self._tokenization.tokens, texts, add_special_tokens, prompt)

    async def decode(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        """TEI's /decode: token ids back to text."""
        return await self._in_pool(self._tokenization.decode, ids, skip_special_tokens)

    async def _in_pool(self, function: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)
