"""An OpenAI-compatible server on 127.0.0.1 for the `regenerate --server` tests, speaking the part of vLLM's
API the client uses: GET /v1/models (id, root, max_model_len), POST /v1/completions with a token-id prompt
and POST /v1/chat/completions with messages rendered by the tokenizer's chat template and
`chat_template_kwargs` (then tokenized without special tokens, as vLLM does), each answering with the
generated `token_ids` and the `prompt_token_ids` it used (vLLM's `return_token_ids`).

`generate(prompt_ids, body) -> (token_ids, finish_reason)` makes the answer: the real target's JAX greedy
decoding, or canned tokens where the point is the transport. `fault(body, number)` may make request
`number` (0-based, counted over completion and chat requests) fail: ("status", code) answers that HTTP
error, "reset" closes the connection without an answer. Every request body, how many requests are in
flight at most, and who sent what is recorded for the tests to check.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class OpenAIServer:
    def __init__(self, tokenizer, generate: Callable[[list[int], dict], tuple[list[int], str]], *,
                 model: str = "toy", root: str | None = None, max_model_len: int | None = 2048,
                 fault: Callable[[dict, int], Any] | None = None, delay_s: float = 0.0):
        self.tokenizer, self.generate, self.fault, self.delay_s = tokenizer, generate, fault, delay_s
        self.card = {"id": model, "object": "model", "root": root or model, "max_model_len": max_model_len}
        self.bodies: list[dict] = []  # every generation request, in arrival order
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> OpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def prompt_ids(self, path: str, body: dict) -> list[int]:
        if path == "/v1/completions":
            return list(body["prompt"])
        text = self.tokenizer.apply_chat_template(body["messages"], tools=body.get("tools"), tokenize=False,
                                                  add_generation_prompt=True, **(body.get("chat_template_kwargs") or {}))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _answer(self, path: str, body: dict) -> tuple[int, dict | None]:
        with self._lock:
            number = len(self.bodies)
            self.bodies.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(self.delay_s)
            failure = self.fault(body, number) if self.fault else None
            if failure == "reset":
                return 0, None
            if failure is not None:
                return failure[1], {"error": {"message": f"injected failure {failure[1]} of request {number}",
                                              "type": "BadRequestError", "code": failure[1]}}
            prompt = self.prompt_ids(path, body)
            tokens, finish = self.generate(prompt, body)
            choice = {"index": 0, "finish_reason": finish, "token_ids": tokens}
            if path == "/v1/completions":  # vLLM: the completion choice holds the prompt ids, a chat the response
                return 200, {"object": "text_completion", "choices": [{**choice, "prompt_token_ids": prompt}]}
            return 200, {"object": "chat.completion", "choices": [choice], "prompt_token_ids": prompt}
        finally:
            with self._lock:
                self.in_flight -= 1

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [server.card]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path not in ("/v1/completions", "/v1/chat/completions"):
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                status, payload = server._answer(self.path, body)
                if payload is None:  # "reset": no answer at all
                    self.close_connection = True
                    return
                self._send(status, payload)

        return Handler
