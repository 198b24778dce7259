"""A scripted OpenAI-compatible server for dflash-regenerate's tests: a real HTTP server on 127.0.0.1 (the
standard library's, in a thread of the test process) whose answer to each prompt a test chooses, and which
can fail chosen rows (HTTP 500, no answer within the client's timeout, or a body cut short) or die mid-run
(``die``: connections refused from then on), counting every request and the paths asked. Its API lives
under ``prefix`` (``/v1``; any other path is a 404, as on a real server).

Why not a mock of the client: the retries, timeouts and error lines under test are the client's handling
of real sockets and real HTTP statuses."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class CutShort:
    """A script's answer: the reply's headers promise the whole body, half of it comes, then the connection
    closes (a proxy or server dying mid-reply; the client's read raises http.client.IncompleteRead)."""


CUT_SHORT = CutShort()

Script = Callable[[str], "str | int | float | CutShort"]
"""prompt -> the answer's text, an HTTP status to fail with, seconds to stay silent (a timeout), or
CUT_SHORT."""


class ScriptedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, script: Script, prefix: str = "/v1"):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script = script
        self.prefix = prefix
        self.requests: Counter = Counter()  # prompt -> requests seen
        self.paths: Counter = Counter()  # path -> requests seen (any method)
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{self.prefix}"

    def die(self) -> None:
        """The server is gone: its listening socket closes, so every later connection is refused (the
        requests being answered still get their answers). From a request's thread (the accept loop runs in
        another); it returns once nothing listens."""
        self.shutdown()  # the accept loop ends ...
        self.socket.close()  # ... and nothing listens on the port: connections queued on it are reset


class _Handler(BaseHTTPRequestHandler):
    server: ScriptedServer

    def log_message(self, *_args) -> None:  # quiet
        pass

    def _send(self, status: int, body: dict, *, cut_short: bool = False) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2] if cut_short else data)  # HTTP/1.0: then it closes
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
            pass

    def _found(self, api_path: str) -> bool:
        with self.server.lock:
            self.server.paths[self.path] += 1
        if self.path == self.server.prefix + api_path:
            return True
        self._send(404, {"error": {"message": f"no route {self.path}"}})
        return False

    def do_GET(self) -> None:
        if self._found("/models"):
            self._send(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self._found("/completions"):
            return
        prompt = body["prompt"]
        with self.server.lock:
            self.server.requests[prompt] += 1
        answer = self.server.script(prompt)
        if isinstance(answer, float):
            time.sleep(answer)
            answer = 500
        if isinstance(answer, int):
            self._send(answer, {"error": {"message": f"scripted failure {answer}"}})
            return
        cut_short = isinstance(answer, CutShort)
        choice = {"index": 0, "text": "cut" if cut_short else answer, "finish_reason": "stop"}
        self._send(
            200,
            {"object": "text_completion", "choices": [choice], "usage": {"completion_tokens": 3}},
            cut_short=cut_short,
        )


@contextmanager
def scripted_server(script: Script, prefix: str = "/v1") -> Iterator[ScriptedServer]:
    server = ScriptedServer(script, prefix)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
