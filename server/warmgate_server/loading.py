"""Loading the model: its folder (`source.locate`: a local one, or a Hugging Face id from the
cache or downloaded), the device and dtype, the tokenizer and the weights (straight into
warmgate's own padding-free encoders for the families models/ runs, else transformers'
AutoModel). Which forward path then runs them is the backends' registry's choice."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import checkpoint, model_folder
from .config import ServerConfig
from .cpus import plan_threads
from .errors import ModelLoadError, weight_names
from .source import ModelSource, locate

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from .head import Head
    from .models import PackedEncoder
    from .models.classify import SequenceClassifier
    from .tokenizer import Tokenizer
    from .warm_state import WarmState

log = logging.getLogger(__name__)


def _model_max_length(
    folder: model_folder.FolderSettings, positions: Any, tokenizer: Any
) -> tuple[int, str]:
    """The model's own input limit and where it comes from: sentence-transformers'
    max_seq_length when present, else the smaller of its positions (less the RoBERTa family's
    offset) and its tokenizer's limit."""
    value = folder.max_seq_length
    if isinstance(value, int) and value > 0:
        return value, "sentence_bert_config.json"
    limits = {
        "config.json's max_position_embeddings (less the position offset)": positions,
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
    model: PreTrainedModel | None
    """The transformers model (None when the padding-free pass was loaded without it, and once
    the ONNX Runtime backend holds the weights: release_model)."""
    tokenizer: Tokenizer
    """warmgate's own (tokenizer.py: BertTokenizer and its subclasses) or transformers'."""
    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    model_max_length: int
    model_max_length_source: str
    pad_token_id: int
    cls_token_id: int
    uses_token_type_ids: bool
    packed: PackedEncoder | None = None
    """warmgate's padding-free encoder of this model (models/: PackedBert, PackedDecoder), or
    None (the model's own forward)."""
    max_positions: int | None = None
    """Tokens per input the model's position embeddings hold: the hard limit."""
    folder: model_folder.FolderSettings = field(default_factory=model_folder.FolderSettings)
    """What the folder's sentence-transformers files say (read once, in the model thread)."""
    head: Head | None = None
    """The Head (head.py) the load's flags resolved: pooling, Dense and Normalize modules."""
    task: str = "embed"
    """model_folder.TASKS: an embedder's passes end in its head; a re-ranker's or classifier's
    in its classification head's logits."""
    classifier: SequenceClassifier | None = None
    """A re-ranker's or classifier's head on the padding-free pass (models/classify.py), or
    None: transformers' model carries it (the padded pass), or an embedder."""

    def release_model(self) -> None:
        """Let the transformers model go (the ONNX Runtime backend, once its export holds the
        weights, so that they are in memory once), and hand the heap memory freed with it back
        to the system."""
        self.model = None
        release_freed_memory()

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


# Model types whose activations overflow float16 (Gemma 2's and 3's: EmbeddingGemma's model
# card says to run it in bfloat16 or float32): `auto` takes bfloat16 on a GPU for them, and
# float16 is refused rather than served as vectors of infinities and NaNs.
NO_FLOAT16 = ("gemma2", "gemma3", "gemma3_text")


def _pick_dtype(requested: str, device: torch.device, model_type: str | None = None) -> torch.dtype:
    import torch

    if requested == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if model_type in NO_FLOAT16 else torch.float16
    if requested == "float16" and model_type in NO_FLOAT16:
        raise ModelLoadError(
            f"--dtype float16: a {model_type} model's activations overflow float16 (Gemma's "
            "model cards say to run it in bfloat16 or float32); use --dtype bfloat16 or float32"
        )
    return getattr(torch, requested)


def load_model(
    config: ServerConfig, source: ModelSource | None = None, state: WarmState | None = None
) -> LoadedModel:
    """Load and place the model from `source` (located from the flags when not given, never
    downloading then). Slow: call it in the model thread. `state`: what an earlier start
    measured (warm_state.py; the linear kernels).

    With --packing auto or on, a BERT-family, Qwen3 or EmbeddingGemma model is loaded straight
    from its folder into warmgate's own encoders (models/bert.py, models/decoder.py)
    (transformers' modeling stack is never imported: seconds of CPU less per start); anything
    else goes through transformers' AutoModel.
    """
    if source is None:
        source = locate(config.model, config.model_revision, download=False)
    path = source.folder
    import torch

    device = _pick_device("cpu" if config.backend == "onnxruntime" else config.device)
    threads = plan_threads(config, device.type)
    torch.set_num_threads(threads.threads)  # the intra-op pool size every model thread uses
    started = time.perf_counter()
    try:
        folder = model_folder.read_folder(path, config.trust_remote_code)
        settings = model_folder.resolve(config, path, folder)
    except model_folder.ModelConfigError as error:
        raise ModelLoadError(str(error)) from None
    dtype = _pick_dtype(config.dtype, device, folder.model_type)
    # Code the folder points at is always a decision: unset, the folder is refused, naming
    # both choices; --no-trust-remote-code serves transformers' own class for its model type
    # (the padded pass: the packed one refuses a folder with auto_map), and only if it loads
    # the checkpoint exactly.
    custom = [] if config.trust_remote_code else _custom_code(path)
    if custom and config.trust_remote_code is None:
        raise _custom_code_asked(config, custom, folder.model_type)
    if any(item.startswith("tokenizer_config.json") for item in custom):
        raise _custom_code_refused(config, custom, "the tokenizer is the folder's own code")
    scores = settings.task != model_folder.EMBED
    tokenizer = _load_tokenizer(config, path, pairs=scores)
    packed, why_not = _load_packed(config, path, device, dtype, folder.model_type, state)
    classifier = None
    if scores and packed is not None:  # the classification head on the padding-free pass
        from .models.classify import SequenceClassifier

        rows = None if folder.logit_score is None else _logit_rows(path, packed, folder)
        try:
            classifier = SequenceClassifier(packed, folder.model_type, rows)  # type: ignore[arg-type]
        except ValueError as exc:
            packed, why_not = None, str(exc).removeprefix("cannot run this model packed: ")
    model = None
    if packed is None and folder.logit_score is not None:
        # transformers' padded pass would compute every token's logits over the vocabulary
        # (151,669 of them for Qwen3-Reranker) to read two at one position.
        raise ModelLoadError(
            f"--model {config.model}: a causal-LM re-ranker ({folder.decoder}) runs on the "
            f"padding-free pass only, and it cannot here ({why_not})"
        )
    if packed is None:
        if config.packing == "on":
            raise ModelLoadError(f"--packing on: {why_not}; use --packing auto or off")
        if config.packing == "auto":
            log.info("padded forward pass: %s", why_not)
        try:
            model = _load_transformers_model(config, path, device, dtype, classifier=scores)
        except ModelLoadError as error:
            if custom:
                raise _custom_code_refused(config, custom, str(error)) from None
            raise
        if custom:
            log.warning(
                "%s names custom code (%s); --no-trust-remote-code: serving it with "
                "transformers' own %s, which loads its checkpoint exactly (its vectors may "
                "differ from the author's code's%s)",
                path,
                "; ".join(custom),
                type(model).__name__,
                ": it attends causally, and a decoder's own code often attends both ways, as "
                "gte-Qwen2's does"
                if _attends_causally(model)
                else "",
            )
        positions = _usable_positions(model)
        hidden_size = int(model.config.hidden_size)
    else:
        positions, hidden_size = packed.max_positions, packed.hidden
    from .head import Head

    try:
        head = Head(settings.pooling_modes, settings.steps, hidden_size, device)
    except model_folder.ModelConfigError as error:
        raise ModelLoadError(str(error)) from None
    max_length, max_length_source = _model_max_length(folder, positions, tokenizer)
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
        folder=folder,
        head=head,
        task=settings.task,
        classifier=classifier,
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


def _logit_rows(path: Path, packed: Any, folder: model_folder.FolderSettings) -> Any:
    """A causal-LM re-ranker's score as one row of weights: LogitScore's true token's row of
    the LM head less its false token's (their logits' difference is the product with it), in
    float32; the head is the input embeddings where the checkpoint ties them (it has no
    lm_head.weight). The rest of the head is never kept."""
    import torch

    score = folder.logit_score
    assert score is not None
    found = checkpoint.load_some(path, {"lm_head.weight"}).get("lm_head.weight")
    if found is None:
        config = json.loads((path / "config.json").read_text())
        if not config.get("tie_word_embeddings", False):
            raise ModelLoadError(
                f"{path}: the checkpoint has no lm_head.weight and config.json does not tie it "
                "to the input embeddings (tie_word_embeddings): the re-ranker's scoring rows "
                "are not in the folder"
            )
    head = found if found is not None else packed.embed
    ids = [score.true_token_id, *([] if score.false_token_id is None else [score.false_token_id])]
    vocabulary = int(head.shape[0])
    if max(ids) >= vocabulary or min(ids) < 0:
        raise ModelLoadError(
            f"{folder.task_source}: token ids {ids} are not all below the LM head's "
            f"{vocabulary} rows"
        )
    rows = head[ids].to(device=packed.device, dtype=torch.float32)
    return (rows[:1] - rows[1:] if len(ids) == 2 else rows).contiguous()


def _load_tokenizer(config: ServerConfig, path: Path, pairs: bool = False) -> Tokenizer:
    """A BERT or XLM-R tokenizer straight from tokenizer.json when it encodes as transformers
    would (tokenizer.py: no transformers import, a second or more of CPU less per start), else
    transformers' AutoTokenizer; always transformers' for `pairs` (a re-ranker's (query,
    document) inputs, with their token types, as CrossEncoder encodes them)."""
    from .tokenizer import load_fast

    if not pairs:
        try:
            return load_fast(path)
        except Exception as exc:  # not a BERT tokenizer, or one `tokenizers` cannot read
            log.info("tokenizer through transformers (%s: %s)", type(exc).__name__, exc)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(path),
            local_files_only=True,
            use_fast=True,
            trust_remote_code=config.trust_remote_code,
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"--model {config.model}: cannot load its tokenizer from {path}: {exc}"
        ) from exc


def _load_packed(
    config: ServerConfig,
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    model_type: str | None,
    state: WarmState | None = None,
) -> tuple[PackedEncoder | None, str]:
    """(the padding-free encoder, "") or (None, why not)."""
    if config.packing == "off":
        return None, "--packing off"
    if config.backend == "onnxruntime":
        return None, "--backend onnxruntime"
    from .models import packed_pass
    from .models.packing import CheckpointMismatch

    try:
        largest = min(config.max_batch_tokens, config.max_batch_size * config.largest_bucket)
        return packed_pass(path, dtype, device, model_type, config.linear, state, largest), ""
    except CheckpointMismatch as exc:
        raise ModelLoadError(
            f"--model {config.model}: {exc} (the padding-free pass of {model_type}); "
            f"{_if_served(random=exc.missing)}"
        ) from None
    except ValueError as exc:
        return None, str(exc).removeprefix("cannot run this model packed: ")


def _load_transformers_model(
    config: ServerConfig,
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    classifier: bool = False,
) -> Any:
    """transformers' AutoModel, loaded strictly: a weight missing from the checkpoint (it
    would be random) or a weight of the model's own layers left unused (the checkpoint is of
    another architecture) fails the load with the keys' names. A task head the base model
    has no place for (an MLM or LM head of a *For* checkpoint) is left out, as
    sentence-transformers leaves it, and logged."""
    from transformers import AutoModel, AutoModelForSequenceClassification
    from transformers.utils import logging as transformers_logging

    # A classifier's pooler is read (its head classifies the pooled first token).
    auto, unread = (AutoModelForSequenceClassification, ()) if classifier else (AutoModel, None)

    transformers_logging.disable_progress_bar()
    options = {
        "local_files_only": True,
        "output_loading_info": True,
        "trust_remote_code": config.trust_remote_code,
    }
    try:
        try:
            model, info = auto.from_pretrained(str(path), dtype=dtype, **options)
        except TypeError:  # transformers 4.x names it torch_dtype
            model, info = auto.from_pretrained(str(path), torch_dtype=dtype, **options)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"--model {config.model}: cannot load it from {path}: {exc}") from None
    problems, random = _loading_problems(model, info, checkpoint.keys(path), unread)
    if problems:
        raise ModelLoadError(
            f"--model {config.model}: the weights do not fit {type(model).__name__}: "
            f"{problems}; {_if_served(random)}"
        )
    model.to(device)
    model.eval()
    return model


# Weights of an architecture that no embedding reads: a missing pooler is never used.
_UNREAD_MISSING = ("pooler.",)


def _if_served(random: bool) -> str:
    """What serving a checkpoint refused for its weights would have done."""
    if random:
        return (
            "served, the weights missing (or of another shape) would be random, and so would "
            "its vectors"
        )
    return (
        "served, the pass would run without the weights left over, and its vectors would not "
        "be the model's (the checkpoint is of another architecture, or has weights its "
        "config.json does not count)"
    )


def _loading_problems(
    model: Any, info: dict[str, Any], keys: set[str], unread: tuple[str, ...] | None = None
) -> tuple[str, bool]:
    """What is wrong with a load (transformers' loading info), or "", and whether serving it
    would run random weights (some missing or of another shape) rather than only leave some
    out."""
    unread = _UNREAD_MISSING if unread is None else unread
    missing = sorted(k for k in info.get("missing_keys") or () if not k.startswith(unread))
    mismatched = sorted(str(item[0]) for item in info.get("mismatched_keys") or ())
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    headed = prefix != "." and any(key.startswith(prefix) for key in keys)
    unused, heads = [], []
    for key in sorted(info.get("unexpected_keys") or ()):
        # In a checkpoint of a model with a task head, the base model's weights carry its
        # prefix (bert., model.) and the head's do not.
        (heads if headed and not key.startswith(prefix) else unused).append(key)
    if heads:
        log.info("left out the checkpoint's task head: %s", weight_names(heads))
    parts = []
    if missing:
        parts.append(f"missing {weight_names(missing)}")
    if unused:
        parts.append(f"unused {weight_names(unused)}")
    if mismatched:
        parts.append(f"of another shape {weight_names(mismatched)}")
    return "; ".join(parts), bool(missing or mismatched)


def _usable_positions(model: Any) -> int | None:
    """Tokens per input a transformers model's position embeddings hold: its
    max_position_embeddings, less the offset of position ids that start at padding_idx + 1
    (RoBERTa, XLM-R, MPNet: 514 positions hold 512 tokens), found as sentence-transformers
    finds it."""
    import torch

    positions = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0:
        return None
    for module in model.modules():
        padding_idx = getattr(module, "padding_idx", None)
        if isinstance(padding_idx, int) and isinstance(
            getattr(module, "position_embeddings", None), torch.nn.Embedding
        ):
            return positions - (padding_idx + 1)
    return positions


def _attends_causally(model: Any) -> bool:
    """Whether transformers' class attends causally (a decoder: Qwen2, Llama, Mistral, Gemma 3
    without bidirectional attention); transformers marks each attention module."""
    return any(getattr(module, "is_causal", False) is True for module in model.modules())


def _custom_code(path: Path) -> list[str]:
    """Where the folder points at code of its own: auto_map entries of config.json and
    tokenizer_config.json."""
    found = []
    for name in ("config.json", "tokenizer_config.json"):
        try:
            data = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map:
            entries = auto_map.items() if isinstance(auto_map, dict) else [("", auto_map)]
            found += [
                f"{name} auto_map {key}: {value}".replace(" : ", " ") for key, value in entries
            ]
    return found


def _custom_code_asked(
    config: ServerConfig, custom: list[str], model_type: str | None
) -> ModelLoadError:
    """The refusal of a folder that points at custom code while nobody has decided."""
    return ModelLoadError(
        f"--model {config.model}: the model's folder points at custom code "
        f"({'; '.join(custom)}), and spec.model.trustRemoteCode (--trust-remote-code) is "
        "unset: decide. true runs the model's own Python code in the pod (only for code you "
        "trust); false serves transformers' own class for its model type "
        f"({model_type or 'unnamed'}) without that code, if it loads the checkpoint exactly: "
        "its vectors may differ from the ones the author's code gives"
    )


def _custom_code_refused(config: ServerConfig, custom: list[str], why: str) -> ModelLoadError:
    """The refusal of a folder that points at custom code with --no-trust-remote-code, where
    transformers' own class cannot serve it (`why`)."""
    return ModelLoadError(
        f"--model {config.model}: the model's folder points at custom code "
        f"({'; '.join(custom)}), and spec.model.trustRemoteCode (--trust-remote-code) is false, "
        f"but transformers' own class for it cannot serve it: "
        f"{why.removeprefix(f'--model {config.model}: ')}. Set spec.model.trustRemoteCode: "
        "true to run the model's own Python code in the pod"
    )


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
