"""The endpoint engine: an OpenAI-compatible server (vLLM, SGLang, ``transformers serve``) writes the
answers, ``--concurrency`` requests in flight, each retried with doubling waits after a connection error
(refused, reset, a reply cut short, TLS), a timeout, HTTP 429 or 5xx; another 4xx fails the row at once
(the same request would fail again). A request still failing after its retries fails its row, not the
run.

Two routes (``--api``). ``completions`` (default): the prompt is rendered here by the target's own chat
template (tools and the thinking switch included) and sent as text to /v1/completions; the answer's
reasoning and tool calls are split here (reply.py). The context is then exactly the one dflash-produce
renders for training, token for token, and the text equals the local engine's. ``chat``: the messages go
to /v1/chat/completions and the server renders them and splits the answer with its reasoning and tool
parsers (its ``reasoning_content`` or ``reasoning`` field becomes ``reasoning_content``); for a server
whose tokenizer is not at hand, at the cost of trusting its rendering (transformers serve, for one, drops
earlier turns' reasoning from the context).

A server that is gone stops the run, not row after row: every try is either answered (any HTTP status
but 502/504, which a gateway gives for a server behind it that is gone) or not (refused, reset, cut
short, no answer within ``--timeout-s``, 502, 504), and after ``--max-connection-failures`` tries in a
row without an answer (counted over all requests in flight) the engine is down: ``next_results`` raises
EngineDown, which names the endpoint, and no try starts after it. A dead server trips it within its
first few retry waits; a hanging one (it takes requests and never answers) once that many tries have timed
out, ``ceil(N / --concurrency)`` timeouts of each request slot, instead of ``--timeout-s`` x tries for
every row. Rows finished by then are in the output; the same command asks for the rest.

The base URL is ``--endpoint`` as given, the API paths under it (the OpenAI clients' ``base_url``), so a
server or gateway at ``…/v2`` or ``…/openai/v1`` works; only a bare server address (no path) gets ``/v1``,
where every OpenAI-compatible server serves it.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from transformers import AutoTokenizer

from dflash.common.cli.exits import error_line, one_line
from dflash.tools.regenerate.config import RegenerateConfig
from dflash.tools.regenerate.engine import EngineDown, EngineError, Item, Result
from dflash.tools.regenerate.reply import Reply, Request, TemplateError, opens_think, render_prompt

log = logging.getLogger(__name__)

_RETRIED_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
_GATEWAY_STATUS = frozenset({502, 504})
"""A gateway's answer that the server behind it is gone (bad gateway, gateway timeout): not an answer."""


class _Retry(Exception):
    """A failure worth another try (the reason is its message)."""


class _NoAnswer(_Retry):
    """A try the server did not answer: counted towards --max-connection-failures."""


def base_url(endpoint: str) -> str:
    """The URL the API paths go under: ``endpoint`` as given (``…/v1``, ``…/v2``, ``…/openai/v1``), but a
    bare server address (``http://host:8000``, ``http://host:8000/``) gets ``/v1`` (module docstring)."""
    url = endpoint.rstrip("/")
    return url + "/v1" if urllib.parse.urlsplit(url).path == "" else url


class _Streak:
    """Tries in a row without an answer, over every request in flight; ``down`` once it reaches the
    limit (thread-safe: the request threads report to it)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0
        self.down = False
        self._lock = threading.Lock()

    def answered(self) -> None:
        with self._lock:
            self.count = 0

    def missed(self) -> bool:
        """One more try without an answer; True for the one that reaches the limit."""
        with self._lock:
            self.count += 1
            if self.down or self.count < self.limit:
                return False
            self.down = True
            return True


_WAKE = object()
"""Put on the results when the engine goes down: the caller's wait ends at once."""


class EndpointEngine:
    """``submit`` / ``next_results`` (engine.py) through the server at ``--endpoint``: ``--concurrency``
    request threads take the turns as they are due (module docstring)."""

    def __init__(self, cfg: RegenerateConfig):
        self.cfg = cfg
        self.url = base_url(cfg.endpoint or "")
        key = os.environ.get("OPENAI_API_KEY")
        self.headers = {
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {key}"} if key else {}),
        }
        try:
            models = self._call("GET", "/models", None, timeout=min(cfg.timeout_s, 30.0))
        except (_Retry, OSError, ValueError) as err:
            raise EngineError(f"endpoint {self.url} unreachable: {one_line(err)}") from None
        names = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
        self.model = cfg.served_model or (names[0] if names else None)
        if self.model is None:
            raise EngineError(f"endpoint {self.url} lists no model: give --served-model NAME")
        self.tokenizer = None
        if cfg.api == "completions":
            source = cfg.tokenizer or self.model
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(source)
            except Exception as err:  # noqa: BLE001 - hub and file errors come in many types
                raise EngineError(
                    f"no tokenizer at {source!r} to render prompts ({error_line(err)}): give --tokenizer PATH, "
                    "or --api chat to let the server render them"
                ) from None
            if not getattr(self.tokenizer, "chat_template", None):
                raise EngineError(f"tokenizer {source}: no chat template")
        self.window = cfg.concurrency * 2
        """Rows worked on at once: a turn is waiting for every request slot that frees up, while few rows
        are half done (a kill loses those)."""
        self._stop = threading.Event()
        self._streak = _Streak(cfg.max_connection_failures)
        self._down: str | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        log.info(  # the URL asked, however --endpoint was written
            "endpoint %s%s, model %s",
            self.url,
            "/completions" if self.tokenizer else "/chat/completions",
            self.model,
        )

    def _call(self, method: str, path: str, body: dict | None, *, timeout: float) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            detail = one_line(err.read().decode("utf-8", "replace")[:300]) or err.reason
            if err.code in _GATEWAY_STATUS:
                raise _NoAnswer(f"HTTP {err.code}: {detail}") from None
            if err.code in _RETRIED_STATUS:
                raise _Retry(f"HTTP {err.code}: {detail}") from None
            raise ValueError(f"HTTP {err.code}: {detail}") from None
        except TimeoutError:
            raise _NoAnswer(f"no answer within {timeout:g} s (--timeout-s)") from None
        except urllib.error.URLError as err:
            reason = err.reason
            if isinstance(reason, TimeoutError):
                raise _NoAnswer(f"no answer within {timeout:g} s (--timeout-s)") from None
            raise _NoAnswer(f"cannot connect: {one_line(reason)}") from None
        except json.JSONDecodeError as err:  # an answer, not JSON: the next try may pass
            raise _Retry(error_line(err)) from None
        except (OSError, http.client.HTTPException) as err:
            # a connection dropped, reset or cut mid-body (IncompleteRead), a TLS error: the next try may pass
            raise _NoAnswer(error_line(err)) from None

    def _body(self, req: Request) -> tuple[str, dict, bool]:
        """(path, body, the prompt opened a <think> block) of one request."""
        cfg = self.cfg
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "seed": cfg.seed,
        }
        if cfg.sampled:
            body["top_p"] = cfg.top_p
        if self.tokenizer is not None:
            prompt = render_prompt(self.tokenizer, req, cfg.template_kwargs())
            return "/completions", {**body, "prompt": prompt}, opens_think(prompt)
        body["messages"] = [_wire_message(m) for m in req.messages]
        if req.tools:
            body["tools"] = req.tools
        if cfg.template_kwargs():
            body["chat_template_kwargs"] = cfg.template_kwargs()
        return "/chat/completions", body, False

    def _one(self, req: Request) -> Reply | None:
        """The reply to one turn, after its retries; None when the engine stopped first (the row is
        unfinished, not failed: the same command asks for it again)."""
        try:
            path, body, opened = self._body(req)
        except TemplateError as err:
            return Reply(skip=str(err))
        tries = self.cfg.retries + 1
        for attempt in range(tries):
            if self._stop.is_set():
                return None
            try:
                answer = self._call("POST", path, body, timeout=self.cfg.timeout_s)
            except _NoAnswer as err:
                last = str(err)
                if self._streak.missed():
                    self._went_down(last)
                    return Reply(error=f"{last} (the endpoint stopped answering)")
            except _Retry as err:
                self._streak.answered()
                last = str(err)
            except ValueError as err:  # a 4xx: the same request would fail again
                self._streak.answered()
                return Reply(error=one_line(err))
            else:
                self._streak.answered()
                try:
                    return _reply(answer, opened, chat=self.tokenizer is None, tools=bool(req.tools))
                except (ValueError, KeyError, IndexError, TypeError) as err:
                    return Reply(error=one_line(err))
            if attempt + 1 < tries:
                self._stop.wait(self.cfg.retry_wait_s * 2**attempt)
        return Reply(error=f"{last} ({tries} tries)")

    def _went_down(self, last: str) -> None:
        n = self.cfg.max_connection_failures
        self._down = (
            f"endpoint {self.url} stopped answering: {n} tries in a row got no answer (the last: {last}; "
            "--max-connection-failures)"
        )
        self._stop.set()  # no try starts after this one, no retry waits
        self._results.put(_WAKE)

    def _work(self) -> None:
        while not self._stop.is_set():
            key, request = self._jobs.get()
            reply = None if self._stop.is_set() else self._one(request)
            if reply is not None:
                self._results.put((key, reply))

    def submit(self, items: list[Item]) -> None:
        for item in items:
            self._jobs.put(item)
        while len(self._threads) < self.cfg.concurrency:
            # daemons: a stopped run does not wait for requests in flight (they would end by --timeout-s)
            thread = threading.Thread(target=self._work, name=f"request-{len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def next_results(self, timeout: float) -> list[Result]:
        """The answers in by now, waiting up to ``timeout`` s for the first; [] if none came. Raises
        EngineDown once the endpoint stopped answering (the answers that came before it are returned
        first)."""
        out: list[Result] = []
        try:
            got = self._results.get(block=self._down is None, timeout=max(timeout, 0.0))
            while True:
                if got is not _WAKE:
                    out.append(got)
                got = self._results.get_nowait()
        except queue.Empty:
            pass
        if not out and self._down is not None:
            raise EngineDown(self._down)
        return out

    def close(self) -> None:
        """No new try, no retry wait; tries in flight end by --timeout-s in their daemon threads."""
        self._stop.set()


def _wire_message(msg: dict[str, Any]) -> dict[str, Any]:
    """A message as the OpenAI wire format has it: tool call arguments as JSON text."""
    if not msg.get("tool_calls"):
        return msg
    calls = []
    for call in msg["tool_calls"]:
        fn = dict(call["function"])
        if not isinstance(fn.get("arguments"), str):
            fn["arguments"] = json.dumps(fn.get("arguments", {}))
        calls.append({**call, "function": fn})
    return {**msg, "tool_calls": calls}


def _reply(answer: dict, opened: bool, *, chat: bool, tools: bool) -> Reply:
    """A server's JSON answer as a Reply (a malformed one raises: the row fails, with the reason)."""
    choice = answer["choices"][0]
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
    if not chat:
        if not isinstance(choice.get("text"), str):
            raise ValueError("answer without text")
        return Reply(text=choice["text"], opened_think=opened, finish=finish, tokens=tokens)
    got = choice["message"]
    msg: dict[str, Any] = {"role": "assistant", "content": got.get("content") or ""}
    reasoning = got.get("reasoning_content") or got.get("reasoning")
    if isinstance(reasoning, str) and reasoning.strip():
        msg["reasoning_content"] = reasoning.strip("\n")
    calls = [
        {
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "arguments": _arguments(c["function"].get("arguments")),
            },
        }
        for c in got.get("tool_calls") or []
    ]
    if calls and tools:
        msg["tool_calls"] = calls
    return Reply(message=msg, finish=finish, tokens=tokens)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw if raw is not None else {}
