"""Running the model: one served model's inputs to token ids (pre.Tokenization) and its batches
through the forward path the backends' registry chose (backends/), and the set of shapes
already run. Knows the model, nothing of HTTP.

Every method that touches torch runs in one of the app's model threads (one per model worker,
see app.py), never on the event loop; `tokenize` runs in the tokenizer thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from warmgate_contract.shapes import Shape

from . import backends
from .backends.base import torch_threads
from .faults import FaultInjector
from .loading import LoadedModel
from .pre import Tokenization

if TYPE_CHECKING:
    from .backends.graphs import GraphSet
    from .head import Head
    from .multi import MultiHead
    from .splade import SpladeHead

# Text whose tokens fill warmup inputs. Real words, so the tokenizer path is the serving one.
_WARMUP_TEXT = (
    "warmgate warms every shape of its plan before it reports ready, so that no user request "
    "ever pays for lazy initialisation, kernel selection or memory pool growth. "
)


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
        backend: str = "torch",
        multi: MultiHead | SpladeHead | None = None,
    ) -> None:
        """`packed`: warmgate's padding-free pass where the load made one (False: the model's
        own, padded); `backend`: --backend (torch or onnxruntime); `multi`: bge-m3's sparse and
        ColBERT heads (multi.py), or a SparseEncoder's (splade.py), which every pooled batch
        then runs on its token states."""
        from .head import Head

        self.loaded = loaded
        self.head = (
            pooling
            if isinstance(pooling, Head)
            else Head((pooling,), (), loaded.hidden_size, loaded.device)
        )
        """Pooling and the modules after it (head.py)."""
        self.pooling = "+".join(self.head.modes)
        self.tokenization = Tokenization(
            loaded.tokenizer, max_input_length, prompt, include_prompt, lowercase
        )
        """The pre stage's half: inputs to token ids."""
        self.backend = backends.choose(loaded, self.head, backends.Wanted(packed, backend))
        """The forward path (backends/), chosen once; CUDA graphs wrap it (`graphs`)."""
        self.multi = multi
        """bge-m3's heads: a pooled batch's outputs are then multi.MultiOutput (dense, sparse
        and ColBERT from the same token states), not vectors."""
        self._executed: set[tuple[int, Shape, str, int | None]] = set()
        """(worker, shape, backend route, threads) already run: a shape's eager pass and its
        graph are warm apart."""
        self.faults: FaultInjector | None = None
        """Test-only fault injection (faults.py); None in normal operation."""

    @property
    def max_input_length(self) -> int:
        return self.tokenization.max_input_length

    def tokenize(
        self,
        texts: Sequence[str | Sequence[int]],
        truncate: bool = False,
        truncate_left: bool = False,
        max_length: int | None = None,
        prompt: str | None = None,
    ) -> list[list[int]]:
        """Token ids with special tokens, unpadded (pre.Tokenization.tokenize)."""
        return self.tokenization.tokenize(texts, truncate, truncate_left, max_length, prompt)

    @property
    def vocab_size(self) -> int:
        return self.tokenization.vocab_size

    @property
    def graphs(self) -> GraphSet | None:
        """The planned shapes' CUDA graphs (backends/graphs.py), or None: every pass runs
        eagerly."""
        return getattr(self.backend, "graphs", None)

    @graphs.setter
    def graphs(self, graphs: GraphSet | None) -> None:
        from .backends.graphs import GraphBackend

        eager = self.backend.inner if isinstance(self.backend, GraphBackend) else self.backend
        self.backend = eager if graphs is None else GraphBackend(eager, graphs)

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
        hidden states (/embed_all). `threads`: the CPU threads of this pass only (a solo
        batch), else the worker's own. `layers`: the packed pass's first layers only (warmup
        of a long pass: the layers share their kernels and shapes); other passes run whole."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        backend = self.backend
        multi = self.multi if pool else None
        pool = pool and multi is None  # the heads take every token's state
        key = (worker, shape, backend.route(shape, worker, pool), threads)
        first_time = key not in self._executed
        if self.faults is not None:
            self.faults.before_forward(shape)
        vectors = backend.forward(
            batch, shape, worker=worker, pool=pool, threads=threads, layers=layers
        )
        if multi is not None:
            with torch_threads(threads):
                vectors = multi(vectors, batch)
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
        return self.backend.layer_count

    def warm_kernels(self, threads: int | None = None) -> int:
        """Make the packed pass's oneDNN primitives for every row count a batch can bring
        (models/linear.py's warm: a batch's rows are its real tokens, which the planned shapes
        do not cover), on this model thread's torch threads or `threads` (a solo batch's).
        Returns the row counts run (0: no oneDNN kernel, nothing to make)."""
        return self.backend.warm_kernels(threads)

    def export_onnx(
        self,
        solo_threads: int,
        cache: Path | None = None,
        before_export: Callable[[], None] | None = None,
    ) -> float | None:
        """--backend onnxruntime: export the model (or open its export in `cache`) and open its
        ONNX Runtime sessions (in a model thread, as the warmup's first step, so it counts in
        warmup_seconds); from then on the padded passes run there and the torch model is let
        go. Returns the seconds taken; None when there is nothing to export (another backend,
        or exported already)."""
        from .backends.ort import OrtBackend

        backend = self.backend
        if not isinstance(backend, OrtBackend) or backend.exported is not None:
            return None
        return backend.export(solo_threads, cache, before_export)

    def capture(self, shape: Shape, worker: int) -> None:
        """Capture `shape`'s CUDA graph for `worker` (its model thread, during warmup)."""
        assert self.graphs is not None
        self.graphs.capture(shape, worker)
