"""Running the model: tokenize, forward, pool. Knows torch and the model, nothing of HTTP.

Every method that touches torch runs in one of the app's model threads (one per model worker,
see app.py), never on the event loop; `tokenize` runs in the tokenizer thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from warmgate_contract.shapes import Shape

from .errors import InputTooLong
from .faults import FaultInjector
from .loading import LoadedModel
from .tokenizer import BertTokenizer

if TYPE_CHECKING:
    from .graphs import GraphSet
    from .head import Head

log = logging.getLogger(__name__)

# Text whose tokens fill warmup inputs. Real words, so the tokenizer path is the serving one.
_WARMUP_TEXT = (
    "warmgate warms every shape of its plan before it reports ready, so that no user request "
    "ever pays for lazy initialisation, kernel selection or memory pool growth. "
)


class TokenIds(list):
    """One input's token ids, and how many of its first tokens pooling leaves out: the prompt
    of a model whose Pooling says include_prompt: false (0: pool them all)."""

    __slots__ = ("pool_from",)

    def __init__(self, ids: Sequence[int] = (), pool_from: int = 0) -> None:
        super().__init__(ids)
        self.pool_from = pool_from


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """This thread's torch threads set to `threads` for the block (its team only: OpenMP's,
    MKL's local), then back; None leaves them."""
    if threads is None:
        yield
        return
    import torch

    own = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(own)


def pool_starts(batch: Sequence[Sequence[int]]) -> np.ndarray | None:
    """Each input's pool_from (TokenIds), or None when every input pools all its tokens."""
    starts = np.fromiter((getattr(ids, "pool_from", 0) for ids in batch), np.int64, len(batch))
    return starts if starts.any() else None


def fill_padded(
    batch: Sequence[Sequence[int]],
    ids: np.ndarray,
    mask: np.ndarray,
    pool_mask: np.ndarray,
    pad_token_id: int,
    filler_token_id: int,
) -> None:
    """Lay `batch` out right-padded in (rows, seq_len) buffers: token ids, the attention mask
    and the pooling mask (the attention mask less each input's pool_from). Rows past the batch
    get one real token, `filler_token_id`: an all-masked row can turn attention into NaN."""
    ids.fill(pad_token_id)
    mask.fill(0)
    for row, tokens in enumerate(batch):
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
    ids[len(batch) :, 0] = filler_token_id
    mask[len(batch) :, 0] = 1
    pool_mask[:] = mask
    for row, tokens in enumerate(batch):
        pool_mask[row, : getattr(tokens, "pool_from", 0)] = 0


def _leading_ones(mask: Sequence[int]) -> int:
    count = 0
    for value in mask:
        if value != 1:
            break
        count += 1
    return count


@dataclass(frozen=True)
class BatchResult:
    vectors: Sequence[np.ndarray]
    """One output per real input, in batch order, float32: pooled, the rows of an (inputs,
    output) array, as the module chain left them; unpooled, each input's (tokens, hidden)
    token states."""
    seconds: float
    """Wall time of the forward pass, in the model thread."""
    first_time: bool
    """This shape ran for the first time in this process (a cold hit unless warming)."""
    cpu_seconds: float = 0.0
    """CPU time the model thread spent on it: well below `seconds` when the thread waited for a
    CPU (other processes, a CPU limit) rather than computed."""


class ModelRunner:
    """tokenize / forward / pool for one served model, and the set of shapes already run."""

    def __init__(
        self,
        loaded: LoadedModel,
        pooling: str | Head,
        max_input_length: int,
        packed: bool = True,
        prompt: str = "",
        include_prompt: bool = True,
        lowercase: bool = False,
    ) -> None:
        from .head import Head

        self.loaded = loaded
        self.head = (
            pooling
            if isinstance(pooling, Head)
            else Head((pooling,), (), loaded.hidden_size, loaded.device)
        )
        """Pooling and the modules after it (head.py)."""
        self.pooling = "+".join(self.head.modes)
        # The model's default prompt, put before every input as sentence-transformers does.
        self.prompt = prompt
        self.include_prompt = include_prompt
        """False: a prompt's tokens are left out of the pooling (TokenIds.pool_from)."""
        self.lowercase = lowercase
        """sentence_bert_config.json's do_lower_case: lowercase every text first."""
        self._prompt_lengths: dict[str, int] = {}
        self.max_input_length = max_input_length
        self.packed = loaded.packed if packed else None
        """The padding-free forward pass in use, or None (the model's own, padded)."""
        if self.packed is None and loaded.model is None and loaded.ort is None:
            raise ValueError("the padded forward pass needs a model loaded with --packing off")
        self._executed: set[tuple[int, Shape, bool]] = set()
        """(worker, shape, by its graph) pairs already run: a shape's eager pass and its graph
        are warm apart."""
        self.faults: FaultInjector | None = None
        """Test-only fault injection (faults.py); None in normal operation."""
        self.graphs: GraphSet | None = None
        """The planned shapes' CUDA graphs (graphs.py), or None: every pass runs eagerly."""
        # warmgate's BERT tokenizer is stateless; transformers' sets truncation and padding on
        # its Rust tokenizer at each call, which raises when two threads call at once.
        self._tokenizer_lock = (
            None if isinstance(loaded.tokenizer, BertTokenizer) else threading.Lock()
        )

    def _encode(self, strings: list[str], **options: bool) -> dict:
        if self._tokenizer_lock is None:
            return self.loaded.tokenizer(strings, verbose=False, **options)
        with self._tokenizer_lock:
            return self.loaded.tokenizer(strings, verbose=False, **options)

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
        return len(self.loaded.tokenizer)

    def tokens(
        self, texts: Sequence[str], add_special_tokens: bool, prompt: str | None = None
    ) -> list[list[dict]]:
        """Each text's tokens as text-embeddings-inference's /tokenize lists them: id, text,
        special, and the UTF-8 byte span of the text it came from (none for special tokens).
        Texts get `prompt` before them (None: the model's default prompt)."""
        tokenizer = self.loaded.tokenizer
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
        lists, tokenizer = [list(item) for item in ids], self.loaded.tokenizer
        if self._tokenizer_lock is None:
            return tokenizer.batch_decode(lists, skip_special_tokens=skip_special_tokens)
        with self._tokenizer_lock:
            return tokenizer.batch_decode(lists, skip_special_tokens=skip_special_tokens)

    def release_memory(self) -> None:
        """After a failed allocation on a GPU, give the allocator's cached blocks back (a CPU
        has no such cache: nothing to do)."""
        if self.loaded.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def warmup_inputs(self, shape: Shape) -> list[list[list[int]]]:
        """The batches warmup runs `shape` with, in turn: `shape.batch_size` inputs of
        `shape.seq_len` tokens (the input limit, when the bucket is longer than the model
        takes), via the tokenizer, and, for more than one input, the same with the last input
        about half as long. The packed pass on a CPU runs inputs all of one length without
        padding and mixed lengths with padded, masked keys: both routes serve this shape."""
        length = min(shape.seq_len, self.max_input_length)
        text = _WARMUP_TEXT * (length // 8 + 1)
        ids = self.tokenize([text], truncate=True, max_length=length)[0]
        full = [ids] * shape.batch_size
        if shape.batch_size == 1 or len(ids) < 3:
            return [full]
        shorter = [*ids[: max(1, len(ids) // 2 - 1)], ids[-1]]  # its last (special) token kept
        return [full, [*full[:-1], shorter]]

    def execute(
        self,
        batch: Sequence[Sequence[int]],
        shape: Shape,
        worker: int = 0,
        pool: bool = True,
        threads: int | None = None,
        layers: int | None = None,
    ) -> BatchResult:
        """Run one padded batch of `shape` in model worker `worker`'s thread; the first
        `len(batch)` rows are real inputs. A shape is warm per worker and thread count: each
        thread has its own allocator arena, BLAS buffers and thread team, and oneDNN's kernels
        are chosen per thread count. `pool=False`: each input's output is its tokens' last
        hidden states (/embed_all). `threads`: torch threads for this pass only (a solo
        batch), else the worker's own. `layers`: the packed pass's first layers only (warmup
        of a long pass: the layers share their kernels and shapes); other passes run whole."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        graphs = self.graphs
        by_graph = pool and graphs is not None and graphs.has(shape, worker)
        key = (worker, shape, by_graph, threads)
        first_time = key not in self._executed
        if self.faults is not None:
            self.faults.before_forward(shape)
        if by_graph:
            assert graphs is not None
            vectors = graphs.run(batch, shape, worker)
        elif threads is None or self.loaded.ort is not None:
            vectors = self._forward(batch, shape, pool, threads, layers)
        else:
            with torch_threads(threads):
                vectors = self._forward(batch, shape, pool, layers=layers)
        self._executed.add(key)
        return BatchResult(
            vectors,
            time.perf_counter() - started,
            first_time,
            cpu_seconds=time.thread_time() - cpu_started,
        )

    @property
    def layer_count(self) -> int | None:
        """The packed pass's layers (what `execute(layers=...)` can shorten), or None: the
        pass runs whole."""
        kernels = getattr(self.packed, "kernels", None)
        return None if kernels is None else len(kernels.small.layers)

    def warm_kernels(self, threads: int | None = None) -> int:
        """Make the packed pass's oneDNN primitives for every row count a batch can bring
        (linear.warm: a batch's rows are its real tokens, which the planned shapes do not
        cover), on this model thread's torch threads or `threads` (a solo batch's). Returns
        the row counts run (0: no oneDNN kernel, nothing to make)."""
        kernels = getattr(self.packed, "kernels", None)
        if kernels is None or self.loaded.device.type != "cpu":
            return 0
        from .linear import warm

        with torch_threads(threads):
            return warm(kernels)

    def export_onnx(
        self,
        solo_threads: int,
        cache: Path | None = None,
        before_export: Callable[[], None] | None = None,
    ) -> float:
        """--backend onnxruntime: export the model (or open its export in `cache`) and open its
        ONNX Runtime sessions (in a model thread, as the warmup's first step, so it counts in
        warmup_seconds); from then on the padded passes run there and the torch model is let
        go. Returns the seconds taken."""
        import torch

        from .ort import export

        loaded = self.loaded
        threads = torch.get_num_threads()  # a model worker's (load_model set it)
        loaded.ort = export(
            loaded.model, loaded.uses_token_type_ids, threads, solo_threads, cache, before_export
        )
        loaded.model = None
        release_freed_memory()
        return loaded.ort.export_seconds

    def capture(self, shape: Shape, worker: int) -> None:
        """Capture `shape`'s CUDA graph for `worker` (its model thread, during warmup)."""
        assert self.graphs is not None
        self.graphs.capture(shape, worker)

    def _forward(
        self,
        batch: Sequence[Sequence[int]],
        shape: Shape,
        pool: bool,
        threads: int | None = None,
        layers: int | None = None,
    ) -> Sequence[np.ndarray]:
        """`threads`: ONNX Runtime's session for that many threads (None: the worker's); torch
        passes run on the calling thread's torch threads (execute sets them)."""
        import torch

        loaded = self.loaded
        if self.packed is not None:
            with torch.inference_mode():
                states, starts, lengths = self.packed.encode(
                    batch, shape.seq_len, shape.batch_size, layers
                )
                if not pool:  # every real token's state, input after input
                    return _per_input(states.float().cpu().numpy(), batch)
                pool_from = pool_starts(batch)
                return self.head.packed(states, starts, lengths, pool_from).cpu().numpy()
        count = len(batch)
        ids, mask, pool_mask = (np.empty(shape, dtype=np.int64) for _ in range(3))
        fill_padded(batch, ids, mask, pool_mask, loaded.pad_token_id, loaded.cls_token_id)
        device = loaded.device
        if loaded.ort is not None:
            hidden = torch.from_numpy(loaded.ort.run(ids, mask, threads)[:count])
            with torch.inference_mode():
                if not pool:
                    states = [hidden[row, : len(tokens)] for row, tokens in enumerate(batch)]
                    return _per_input(torch.cat(states).numpy(), batch)
                return self.head.padded(hidden, torch.from_numpy(pool_mask[:count])).numpy()
        inputs = {
            "input_ids": torch.from_numpy(ids).to(device),
            "attention_mask": torch.from_numpy(mask).to(device),
        }
        if loaded.uses_token_type_ids:
            inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
        with torch.inference_mode():
            output = loaded.model(**inputs)
            hidden = output[0][:count].float()
            if not pool:
                states = [hidden[row, : len(tokens)] for row, tokens in enumerate(batch)]
                return _per_input(torch.cat(states).cpu().numpy(), batch)
            # Inputs are right-padded: "last" is each row's last real token.
            pooled = self.head.padded(hidden, torch.from_numpy(pool_mask[:count]).to(device))
            # .cpu() waits for the device, so the timing covers the whole forward pass.
            return pooled.cpu().numpy()


def release_freed_memory() -> None:
    """Hand the heap memory freed by the export (its peak, several times the weights) and by
    the torch model back to the system: glibc keeps freed blocks of the main heap for reuse,
    so without this the process stays at the export's peak for its whole life."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _per_input(states: np.ndarray, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """(tokens, hidden) states of the batch's inputs one after another, split by input (copied
    to the host in one piece, then cut)."""
    ends = np.cumsum([len(tokens) for tokens in batch])
    return np.split(states, ends[:-1])
