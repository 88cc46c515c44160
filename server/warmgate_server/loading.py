"""Loading the model: its folder (`source.locate`: a local one, or a Hugging Face id from the
cache or downloaded), the device and dtype, the tokenizer and the weights (straight into
warmgate's own forward passes for BERT-family models, else transformers' AutoModel)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ServerConfig
from .cpus import plan_threads
from .errors import ModelLoadError
from .source import ModelSource, locate

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _model_max_length(path: Path, positions: Any, tokenizer: Any) -> tuple[int, str]:
    """The model's own input limit and where it comes from: sentence-transformers'
    max_seq_length when present, else the smaller of its positions and its tokenizer's limit."""
    st_config = path / "sentence_bert_config.json"
    if st_config.is_file():
        value = json.loads(st_config.read_text()).get("max_seq_length")
        if isinstance(value, int) and value > 0:
            return value, "sentence_bert_config.json"
    limits = {
        "config.json's max_position_embeddings": positions,
        "the tokenizer's model_max_length": tokenizer.model_max_length,
    }
    usable = {
        source: value
        for source, value in limits.items()
        if isinstance(value, int) and 0 < value < 1_000_000
    }
    if not usable:
        return 512, "default (the model states no limit)"
    source = min(usable, key=lambda key: usable[key])
    return usable[source], source


@dataclass
class LoadedModel:
    """A model and tokenizer in memory, with the facts serving needs about them."""

    path: Path
    source: ModelSource
    """Where the files came from: the resolved commit and the weights' digest."""
    model: Any
    """The transformers model (None when the padding-free pass was loaded without it)."""
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    model_max_length: int
    model_max_length_source: str
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


def load_model(config: ServerConfig, source: ModelSource | None = None) -> LoadedModel:
    """Load and place the model from `source` (located from the flags when not given, never
    downloading then). Slow: call it in the model thread.

    With --packing auto or on, a BERT-family model is loaded straight from its folder into
    warmgate's own forward passes (packed.py) (transformers' modeling stack is never imported:
    seconds of CPU less per start); anything else goes through transformers' AutoModel.
    """
    if source is None:
        source = locate(config.model, config.model_revision, download=False)
    path = source.folder
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
    max_length, max_length_source = _model_max_length(path, positions, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else pad_id
    loaded = LoadedModel(
        path=path,
        source=source,
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        hidden_size=hidden_size,
        model_max_length=max_length,
        model_max_length_source=max_length_source,
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
    from .packed import PackedBert

    try:
        return PackedBert.from_folder(path, dtype, device), ""
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
