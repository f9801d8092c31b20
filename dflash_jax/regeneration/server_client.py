"""One OpenAI-compatible server (vLLM's `vllm serve`, SGLang's `sglang.launch_server`) as `regenerate
--server` talks to it (design §14): JSON requests over HTTP with retries.

Transient failures are retried with exponential backoff and jitter, so that many clients that lost the same
server do not come back in step: a refused or reset connection (a server starting up or restarting), a
timeout, HTTP 408/429 (overloaded) and 5xx. Any other HTTP error is the request's own fault (a bad
parameter, a prompt longer than the model takes) and is raised at once as `RequestRefused`, with the
server's message. An API key for servers started with one (`vllm serve --api-key`) is read from
OPENAI_API_KEY, as OpenAI's own clients do. Standard library only: one connection per request, which costs
nothing beside a generation of many tokens.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import os
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

log = logging.getLogger(__name__)
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
REQUEST_TIMEOUT_S = 3600.0  # one response of many thousand tokens from a busy server can take minutes


class RequestRefused(Exception):
    """The server answered with a non-transient HTTP error: retrying the same request cannot help."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class ServerUnreachable(Exception):
    """Every attempt failed transiently (the last failure is the message)."""


@dataclasses.dataclass(frozen=True)
class Retry:
    attempts: int = 14  # with the delays below, 4 to 8 minutes of retrying: a large model's server restart
    first_delay_s: float = 1.0
    max_delay_s: float = 60.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (0-based): between half and all of
        first * 2^attempt, capped at max ("equal jitter": spread out, yet never much shorter than planned)."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** attempt) * random.uniform(0.5, 1.0)


class Server:
    """`get(path)` / `post(path, body)` -> the JSON response of the server at `url` (`http://host:port`,
    with or without a trailing `/v1`)."""

    def __init__(self, url: str, retry: Retry = Retry(), timeout_s: float = REQUEST_TIMEOUT_S):
        parts = urllib.parse.urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{url!r} is not an http(s)://host:port URL")
        self.url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix('/v1')}"
        self.retry, self.timeout_s = retry, timeout_s
        self.headers = {"Content-Type": "application/json"}
        if os.environ.get("OPENAI_API_KEY"):
            self.headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"

    def __str__(self) -> str:
        return self.url

    def get(self, path: str) -> dict[str, Any]:
        return self._with_retries("GET", path, None)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._with_retries("POST", path, json.dumps(body).encode())

    def _with_retries(self, method: str, path: str, data: bytes | None) -> dict[str, Any]:
        for attempt in range(self.retry.attempts):
            try:
                return self._once(method, path, data)
            except _Transient as failure:
                last = failure
                if attempt + 1 < self.retry.attempts:
                    delay = self.retry.delay(attempt)
                    log.warning("%s%s: %s; retrying in %.1f s (%d/%d)", self.url, path, failure, delay, attempt + 1,
                                self.retry.attempts - 1)
                    time.sleep(delay)
        raise ServerUnreachable(f"{self.url}{path}: {last} (after {self.retry.attempts} attempts)")

    def _once(self, method: str, path: str, data: bytes | None) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:
            message = _error_message(error.read())
            if error.code in TRANSIENT_STATUS:
                raise _Transient(f"HTTP {error.code}: {message}") from None
            raise RequestRefused(error.code, message) from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as error:
            raise _Transient(f"{type(error).__name__}: {getattr(error, 'reason', error)}") from None
        try:
            return json.loads(payload)
        except json.JSONDecodeError:  # e.g. a proxy's error page with status 200
            raise _Transient(f"not a JSON response: {payload[:200]!r}") from None


class _Transient(Exception):
    pass


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}} or {"message": ...}), on one line."""
    try:
        parsed = json.loads(body)
        error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        message = error.get("message", error) if isinstance(error, dict) else error
    except (json.JSONDecodeError, UnicodeDecodeError):
        message = body[:500].decode(errors="replace")
    return " ".join(str(message).split())
