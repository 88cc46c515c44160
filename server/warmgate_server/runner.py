"""The model runner: load, tokenize, forward, pool. Knows torch and the model, nothing of HTTP.

Every method that touches torch runs in one of the app's model threads (one per model worker,
see app.py), never on the event loop; `tokenize` runs in the tokenizer thread.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import ServerConfig
from .shapes import Shape

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Text whose tokens fill warmup inputs. Real words, so the tokenizer path is the serving one.
_WARMUP_TEXT = (
    "warmgate warms every shape of its plan before it reports ready, so that no user request "
    "ever pays for lazy initialisation, kernel selection or memory pool growth. "
)


class ModelLoadError(RuntimeError):
    """The model cannot be loaded; the message says what to change."""


def _leading_ones(mask: Sequence[int]) -> int:
    count = 0
    for value in mask:
        if value != 1:
            break
        count += 1
    return count


class InputTooLong(ValueError):
    def __init__(self, index: int, length: int, limit: int) -> None:
        super().__init__(f"input {index} has {length} tokens, above the limit of {limit}")
        self.index, self.length, self.limit = index, length, limit


def resolve_model_path(model: str) -> Path:
    """A local folder, or a Hugging Face id found in the local cache. Never downloads."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"--model {model}: the folder has no config.json (not a model)")
        return folder.resolve()
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"--model {model}: no such folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=model, local_files_only=True))
    except Exception as exc:
        cache = os.environ.get("HF_HOME", "~/.cache/huggingface")
        raise ModelLoadError(
            f"--model {model}: not a local folder and not in the Hugging Face cache under "
            f"{cache} ({type(exc).__name__}); this server never downloads: put the model in the "
            "cache (HF_HOME) or pass --model /path/to/model-folder"
        ) from None


def _model_max_length(path: Path, positions: Any, tokenizer: Any) -> int:
    """The model's own input limit: sentence-transformers' max_seq_length when present."""
    st_config = path / "sentence_bert_config.json"
    if st_config.is_file():
        value = json.loads(st_config.read_text()).get("max_seq_length")
        if isinstance(value, int) and value > 0:
            return value
    limits = [positions, tokenizer.model_max_length]
    usable = [value for value in limits if isinstance(value, int) and 0 < value < 1_000_000]
    return min(usable) if usable else 512


@dataclass
class LoadedModel:
    """A model and tokenizer in memory, with the facts serving needs about them."""

    path: Path
    model: Any
    """The transformers model (None when the padding-free pass was loaded without it)."""
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    model_max_length: int
    pad_token_id: int
    cls_token_id: int
    uses_token_type_ids: bool
    packed: Any = None
    """A PackedBert running this model padding-free, or None (the model's own forward)."""
    max_positions: int | None = None
    """The model's position embeddings: the hard limit on tokens per input."""

    @property
    def device_name(self) -> str:
        return str(self.device)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _cgroup_cpu_limit(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPU limit of this process's own cgroup (a pod's resources.limits.cpu), or None.

    cgroup v2: `cpu.max` ("200000 100000" = 2 CPUs, "max 100000" = none); cgroup v1:
    `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1 = none), in the `cpu` hierarchy. The cgroup is
    the one /proc/self/cgroup names (inside a container's cgroup namespace that is "/").
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _hierarchy, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            try:
                quota, period = (root / relative / "cpu.max").read_text().split()[:2]
                return None if quota == "max" else int(quota) / int(period)
            except (OSError, ValueError):
                continue
        if "cpu" in controllers.split(","):
            for mount in (root / "cpu", root / controllers):
                try:
                    quota_us = int((mount / relative / "cpu.cfs_quota_us").read_text())
                    period_us = int((mount / relative / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity, capped by its cgroup CPU limit, which
    sched_getaffinity does not see (a pod limited to 2 CPUs on a 64-CPU node sees 64)."""
    count = len(os.sched_getaffinity(0))
    limit = _cgroup_cpu_limit()
    if limit is not None:
        count = min(count, max(1, int(limit)))
    return count


@dataclass(frozen=True)
class ThreadPlan:
    """How the CPUs are split: `workers` forward passes at once, `threads` torch threads each."""

    workers: int
    threads: int


def plan_threads(config: ServerConfig, device_type: str, cpus: int | None = None) -> ThreadPlan:
    """Defaults: on a GPU one worker (the device serialises its passes anyway); on a CPU two
    workers when there are at least two CPUs, like Triton's two instances of a CPU model.

    Two single-threaded passes side by side use two cores fully, where one pass on two threads
    loses time at every operator's fork and join (small matrices: 384 wide for MiniLM); a batch
    arriving while the other worker is busy starts at once instead of queueing behind it.
    """
    cpus = cpus or usable_cpus()
    workers = config.model_workers or (1 if device_type == "cuda" or cpus < 2 else 2)
    threads = config.torch_threads or max(1, cpus // workers)
    return ThreadPlan(workers, threads)


def _pick_device(requested: str) -> torch.device:
    import torch

    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(
            f"--device {requested}: CUDA is not available in this process "
            f"(torch {torch.__version__}); use --device cpu or auto"
        )
    return torch.device(requested)


def _pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    import torch

    if requested == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return getattr(torch, requested)


def load_model(config: ServerConfig) -> LoadedModel:
    """Resolve, load and place the model. Slow: call it in the model thread.

    With --packing auto or on, a BERT-family model on the CPU is loaded straight from its
    folder into the padding-free forward pass (transformers' modeling stack is never imported:
    seconds of CPU less per start); anything else goes through transformers' AutoModel.
    """
    path = resolve_model_path(config.model)
    import torch

    device = _pick_device(config.device)
    threads = plan_threads(config, device.type)
    torch.set_num_threads(threads.threads)  # the intra-op pool size every model thread uses
    dtype = _pick_dtype(config.dtype, device)
    started = time.perf_counter()
    tokenizer = _load_tokenizer(config, path)
    packed, why_not = _load_packed(config, path, device, dtype)
    model = None
    if packed is None:
        if config.packing == "on":
            raise ModelLoadError(f"--packing on: {why_not}; use --packing auto or off")
        if config.packing == "auto":
            log.info("padded forward pass: %s", why_not)
        model = _load_transformers_model(config, path, device, dtype)
        positions = getattr(model.config, "max_position_embeddings", None)
        hidden_size = int(model.config.hidden_size)
    else:
        positions, hidden_size = packed.max_positions, packed.hidden
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else pad_id
    loaded = LoadedModel(
        path=path,
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        hidden_size=hidden_size,
        model_max_length=_model_max_length(path, positions, tokenizer),
        pad_token_id=int(pad_id),
        cls_token_id=int(cls_id),
        uses_token_type_ids="token_type_ids" in tokenizer.model_input_names,
        packed=packed,
        max_positions=positions if isinstance(positions, int) else None,
    )
    log.info(
        "loaded %s on %s as %s in %.1fs (%d model workers x %d torch threads, %s)",
        path,
        loaded.device_name,
        loaded.dtype_name,
        time.perf_counter() - started,
        threads.workers,
        threads.threads,
        "packed" if packed is not None else "padded",
    )
    return loaded


def _load_tokenizer(config: ServerConfig, path: Path) -> Any:
    """A BERT tokenizer straight from tokenizer.json when it encodes as transformers would
    (tokenizer.py: no transformers import, about a second of CPU less per start), else
    transformers' AutoTokenizer."""
    from .tokenizer import BertTokenizer

    try:
        return BertTokenizer.from_folder(path)
    except Exception as exc:  # not a BERT tokenizer, or one `tokenizers` cannot read
        log.info("tokenizer through transformers (%s: %s)", type(exc).__name__, exc)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"--model {config.model}: cannot load its tokenizer from {path}: {exc}"
        ) from exc


def _load_packed(
    config: ServerConfig, path: Path, device: torch.device, dtype: torch.dtype
) -> tuple[Any, str]:
    """(the padding-free forward pass, "") or (None, why not)."""
    if config.packing == "off":
        return None, "--packing off"
    if device.type != "cpu":
        return None, f"the device is {device}, and packing runs on the CPU only"
    from .packed import PackedBert

    try:
        return PackedBert.from_folder(path, dtype), ""
    except ValueError as exc:
        return None, str(exc).removeprefix("cannot run this model packed: ")


def _load_transformers_model(
    config: ServerConfig, path: Path, device: torch.device, dtype: torch.dtype
) -> Any:
    from transformers import AutoModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        try:
            model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=dtype)
        except TypeError:  # transformers 4.x names it torch_dtype
            model = AutoModel.from_pretrained(str(path), local_files_only=True, torch_dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"--model {config.model}: cannot load it from {path}: {exc}") from exc
    model.to(device)
    model.eval()
    return model


@dataclass(frozen=True)
class BatchResult:
    vectors: np.ndarray
    """(real inputs, hidden) pooled, float32, not normalised."""
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
        self, loaded: LoadedModel, pooling: str, max_input_length: int, packed: bool = True
    ) -> None:
        self.loaded = loaded
        self.pooling = pooling
        self.max_input_length = max_input_length
        self.packed = loaded.packed if packed else None
        """The padding-free forward pass in use, or None (the model's own, padded)."""
        if self.packed is None and loaded.model is None:
            raise ValueError("the padded forward pass needs a model loaded with --packing off")
        self._executed: set[tuple[int, Shape]] = set()

    def tokenize(
        self,
        texts: Sequence[str],
        truncate: bool = False,
        truncate_left: bool = False,
        max_length: int | None = None,
    ) -> list[list[int]]:
        """Token ids with special tokens, unpadded. Raises InputTooLong unless truncating.

        Truncation keeps the model's special tokens and cuts the text between them, on the
        right (end of the text) or the left (start of the text).
        """
        limit = max_length or self.max_input_length
        encoded = self.loaded.tokenizer(list(texts), return_special_tokens_mask=True, verbose=False)
        result = []
        for index, (ids, special) in enumerate(
            zip(encoded["input_ids"], encoded["special_tokens_mask"], strict=True)
        ):
            if len(ids) > limit:
                if not truncate:
                    raise InputTooLong(index, len(ids), limit)
                head = _leading_ones(special)
                tail = _leading_ones(special[::-1])
                room = max(limit - head - tail, 0)
                content = ids[head : len(ids) - tail]
                content = content[len(content) - room :] if truncate_left else content[:room]
                ids = ids[:head] + content + ids[len(ids) - tail :]
            result.append(ids)
        return result

    def warmup_inputs(self, shape: Shape) -> list[list[int]]:
        """`shape.batch_size` inputs of exactly `shape.seq_len` tokens, via the tokenizer."""
        words_needed = shape.seq_len // 8 + 1
        text = _WARMUP_TEXT * words_needed
        ids = self.tokenize([text], truncate=True, max_length=shape.seq_len)[0]
        return [ids] * shape.batch_size

    def execute(self, batch: Sequence[Sequence[int]], shape: Shape, worker: int = 0) -> BatchResult:
        """Run one padded batch of `shape` in model worker `worker`'s thread; the first
        `len(batch)` rows are real inputs. A shape is warm per worker: each thread has its own
        allocator arena, BLAS buffers and thread team."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        first_time = (worker, shape) not in self._executed
        vectors = self._forward(batch, shape)
        self._executed.add((worker, shape))
        return BatchResult(
            vectors,
            time.perf_counter() - started,
            first_time,
            cpu_seconds=time.thread_time() - cpu_started,
        )

    def _forward(self, batch: Sequence[Sequence[int]], shape: Shape) -> np.ndarray:
        import torch

        loaded = self.loaded
        if self.packed is not None:
            with torch.inference_mode():
                pooled = self.packed(batch, shape.seq_len, shape.batch_size, self.pooling)
                return pooled.numpy()
        count = len(batch)
        ids = np.full(shape, loaded.pad_token_id, dtype=np.int64)
        mask = np.zeros(shape, dtype=np.int64)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        # Padding rows get one real token: an all-masked row can turn attention into NaN.
        ids[count:, 0] = loaded.cls_token_id
        mask[count:, 0] = 1
        device = loaded.device
        inputs = {
            "input_ids": torch.from_numpy(ids).to(device),
            "attention_mask": torch.from_numpy(mask).to(device),
        }
        if loaded.uses_token_type_ids:
            inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
        with torch.inference_mode():
            output = loaded.model(**inputs)
            hidden = output[0][:count].float()
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                weights = inputs["attention_mask"][:count].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
            # .cpu() waits for the device, so the timing covers the whole forward pass.
            return pooled.cpu().numpy()
