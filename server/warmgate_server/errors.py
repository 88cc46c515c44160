"""Errors a client caused or can act on, with both APIs' error shapes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from warmgate_contract.names import REASON_MEMORY_EXCEEDED


class ModelLoadError(RuntimeError):
    """The model cannot be found, downloaded, loaded or warmed; the message says what to
    change."""

    reason: str | None = None
    """A CamelCase reason the operator tells apart (the /ready report's failure_reason)."""
    restartable = True
    """Whether a restart may do better (then the process exits and its container restarts)."""


class MemoryExceeded(ModelLoadError):
    """The model, or a planned shape, would not fit in the memory the process may use; the
    message has the numbers and the fields to change. A restart would not change it: the
    server stays up, failed (Lifecycle.fail), so its pod is not restarted into it again."""

    reason = REASON_MEMORY_EXCEEDED
    restartable = False


def weight_names(keys: Sequence[str], shown: int = 8) -> str:
    """Checkpoint keys for a load error: the first `shown`, and how many more."""
    listed = ", ".join(keys[:shown])
    return listed + (f" and {len(keys) - shown} more" if len(keys) > shown else "")


class InputTooLong(ValueError):
    """An input of more tokens than the limit, with truncation off (the runner raises it)."""

    def __init__(self, index: int, length: int, limit: int) -> None:
        super().__init__(f"input {index} has {length} tokens, above the limit of {limit}")
        self.index, self.length, self.limit = index, length, limit


class InvalidTokenIds(ValueError):
    """Input `index`'s token ids are not ids of the encoding they were sent as."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class NotAPair(ValueError):
    """Input `index` is a text alone where the model scores (query, document) pairs only (a
    re-ranker whose chat template renders the two)."""

    def __init__(self, index: int) -> None:
        super().__init__(
            f"input {index} is one text: this re-ranker scores (query, document) pairs only, "
            "rendered by its chat template"
        )
        self.index = index


class ModelFault(RuntimeError):
    """A batch's forward pass failed (`hung`: it ran past --forward-timeout); the scheduler
    fails the batch's requests with it."""

    def __init__(self, message: str, hung: bool = False) -> None:
        super().__init__(message)
        self.hung = hung


class QueueFull(RuntimeError):
    """The batcher's queue holds as many inputs as it may (the scheduler raises it)."""


_OPENAI_TYPES = {
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


@dataclass
class Refused(Exception):
    """A request the server answers with an error itself, in either API's format (the router's
    refusals.Refused is the same idea; warmgate_kube's ApiError is a Kubernetes API failure)."""

    status: int
    message: str
    error_type: str
    """text-embeddings-inference's error_type: validation, empty, tokenizer, overloaded,
    unhealthy, backend."""
    code: str
    """A short machine-readable reason (OpenAI's `code`)."""
    param: str | None = None

    def __str__(self) -> str:
        return self.message

    def tei_body(self) -> dict[str, object]:
        # TEI's ErrorType names: Validation, Empty, Tokenizer, Overloaded, Unhealthy, Backend.
        return {"error": self.message, "error_type": self.error_type.capitalize()}

    @property
    def openai_status(self) -> int:
        """OpenAI answers a request it cannot take with 400 (TEI: 422 for validation)."""
        return 400 if self.status == 422 else self.status

    def openai_body(self) -> dict[str, object]:
        if self.status >= 500 and self.status != 503:
            kind = "server_error"
        else:
            kind = _OPENAI_TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def validation(message: str, code: str, param: str | None = None) -> Refused:
    return Refused(422, message, "validation", code, param)


def empty(message: str, param: str | None = None) -> Refused:
    return Refused(400, message, "empty", "empty_input", param)
