"""The answers the router gives itself, in the error format of the route asked: OpenAI's
(`{"error": {"message", "type", "param", "code"}}`) or text-embeddings-inference's
(`{"error", "error_type"}`), with Retry-After when a retry should succeed."""

from __future__ import annotations

from typing import Any

from .httpd import Response, json_response


class Refused(Exception):
    """A request the router answers itself: status, message, OpenAI error code."""

    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after


def openai_error(error: Refused) -> Response:
    kind = {404: "not_found_error", 503: "service_unavailable"}.get(
        error.status, "invalid_request_error" if error.status < 500 else "server_error"
    )
    body = {"error": {"message": error.message, "type": kind, "param": None, "code": error.code}}
    return json_answer(error.status, body, error.retry_after)


def tei_error(error: Refused) -> Response:
    kind = "Validation" if error.status < 500 else "Unhealthy"
    if error.status == 503 and error.retry_after:
        kind = "Overloaded"
    return json_answer(
        error.status, {"error": error.message, "error_type": kind}, error.retry_after
    )


def json_answer(status: int, body: Any, retry_after: int | None = None) -> Response:
    return json_response(status, body, {"Retry-After": str(retry_after)} if retry_after else None)
