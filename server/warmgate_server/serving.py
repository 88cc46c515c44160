"""What an engine serves a loaded model with, resolved once when it is built (in the model
thread): the folder's sentence-transformers settings under the flags (model_folder.resolve), the
input limit, the module chain they name (head.py), and the limits requests are checked against."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import model_folder
from .config import ServerConfig
from .errors import ModelLoadError
from .loading import LoadedModel
from .openai_ids import OpenAITokenIds
from .schemas import Limits, Vocabulary

if TYPE_CHECKING:
    from .head import Head
    from .multi import MultiHead
    from .splade import SpladeHead


def input_limit(
    config: ServerConfig, model_limit: int, model_limit_source: str, positions: int | None
) -> tuple[int, str]:
    """Tokens per input the server takes, and what set it: --max-input-length, else the model's
    own limit; never above the largest bucket. ModelLoadError when it is above the model's
    `positions` (a longer input would index past its position embeddings)."""
    if config.max_input_length:
        limit, source = config.max_input_length, "--max-input-length"
    else:
        limit, source = model_limit, model_limit_source
    if limit > config.largest_bucket:
        limit, source = config.largest_bucket, "the largest of --sequence-buckets"
    if positions is not None and limit > positions:
        if source == "--max-input-length":
            fix = "lower --max-input-length (and the buckets above it)"
        else:  # the folder's own limit, or the largest bucket
            fix = f"set --max-input-length {positions} (spec.model.maxInputLength) or less"
        raise ModelLoadError(
            f"the input limit {limit} ({source}) is above this model's {positions} positions: {fix}"
        )
    return limit, source


def resolve_settings(config: ServerConfig, loaded: LoadedModel) -> model_folder.ModelSettings:
    """The folder's settings under the flags, with the input limit and where it came from."""
    limit, source = input_limit(
        config, loaded.model_max_length, loaded.model_max_length_source, loaded.max_positions
    )
    try:
        settings = model_folder.resolve(config, loaded.path, loaded.folder)
    except model_folder.ModelConfigError as error:
        raise ModelLoadError(str(error)) from None
    chosen_by = {**settings.chosen_by, "max_input_length": source}
    return replace(settings, max_input_length=limit, chosen_by=chosen_by)


def module_chain(settings: model_folder.ModelSettings, loaded: LoadedModel) -> Head:
    """The load's Head when these settings name the same module chain (the server's own case);
    else one for these settings (tests that share a loaded model under other flags)."""
    head = loaded.head
    if head is not None and (head.modes, head.steps) == (settings.pooling_modes, settings.steps):
        return head
    from .head import Head

    try:
        return Head(settings.pooling_modes, settings.steps, loaded.hidden_size, loaded.device)
    except model_folder.ModelConfigError as error:
        raise ModelLoadError(str(error)) from None


def multi_head(
    settings: model_folder.ModelSettings, loaded: LoadedModel, dense: Head
) -> MultiHead | SpladeHead | None:
    """bge-m3's sparse and ColBERT heads (multi.py), or a SparseEncoder's MLM head and
    SpladePooling (splade.py), where the settings serve them, else None; ModelLoadError for
    heads that cannot be loaded exactly."""
    if settings.splade is not None:
        import json

        from .splade import SpladeHead, read_head

        try:
            config = json.loads((loaded.path / "config.json").read_text())
            head = read_head(loaded.path, config, loaded.device, _word_embeddings(loaded))
        except (OSError, ValueError) as error:  # ModelConfigError is a ValueError
            raise ModelLoadError(str(error)) from None
        return SpladeHead(head, settings.splade, loaded.device)
    if settings.multi is None:
        return None
    from .multi import MultiHead, unused_ids

    try:
        return MultiHead(
            settings.multi, dense, loaded.hidden_size, loaded.device, unused_ids(loaded.tokenizer)
        )
    except model_folder.ModelConfigError as error:
        raise ModelLoadError(str(error)) from None


def _word_embeddings(loaded: LoadedModel) -> Any:
    """The encoder's word embeddings as loaded (the packed pass's, or transformers' model's
    input embeddings), or None."""
    word = getattr(loaded.packed, "word", None)
    if word is None and loaded.model is not None:
        word = loaded.model.get_input_embeddings().weight.detach()
    return word


def request_limits(
    config: ServerConfig,
    settings: model_folder.ModelSettings,
    hidden_size: int,
    vocab_size: int,
    openai_ids: OpenAITokenIds | None,
) -> Limits:
    """What every request is checked against, built once rather than per request."""
    openai_vocab = None
    if openai_ids is not None:  # --openai-token-ids: the OpenAI route takes that encoding's
        openai_vocab = Vocabulary(openai_ids.name, openai_ids.vocab_size)
    return Limits(
        max_inputs=config.max_client_batch_size,
        hidden_size=hidden_size,
        model_names=frozenset({config.effective_served_name, config.model}),
        default_normalize=settings.normalize,
        vocab=Vocabulary("model", vocab_size),
        openai_vocab=openai_vocab,
        auto_truncate=config.auto_truncate,
        prompts=settings.prompts,
        outputs=settings.outputs,
        max_input_length=settings.max_input_length,
    )
