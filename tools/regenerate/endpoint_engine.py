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
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transformers import AutoTokenizer

from dflash.common.cli.exits import error_line, one_line
from dflash.tools.regenerate.config import RegenerateConfig
from dflash.tools.regenerate.local_engine import EngineError
from dflash.tools.regenerate.reply import Reply, Request, TemplateError, opens_think, render_prompt

log = logging.getLogger(__name__)

_RETRIED_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class _Retry(Exception):
    """A failure worth another try (the reason is its message)."""


def base_url(endpoint: str) -> str:
    """``http://host:8000``, ``…/v1`` or ``…/v1/`` -> ``http://host:8000/v1``."""
    url = endpoint.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class EndpointEngine:
    """``complete(requests) -> replies`` through the server at ``--endpoint`` (module docstring)."""

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
        self.window = cfg.concurrency * 4
        """Rows worked on at once: enough turns in flight to keep every request slot busy."""
        self._stop = threading.Event()
        log.info(
            "endpoint %s, model %s, /v1/%s",
            self.url,
            self.model,
            "completions" if self.tokenizer else "chat/completions",
        )

    def _call(self, method: str, path: str, body: dict | None, *, timeout: float) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            detail = one_line(err.read().decode("utf-8", "replace")[:300]) or err.reason
            if err.code in _RETRIED_STATUS:
                raise _Retry(f"HTTP {err.code}: {detail}") from None
            raise ValueError(f"HTTP {err.code}: {detail}") from None
        except TimeoutError:
            raise _Retry(f"no answer within {timeout:g} s (--timeout-s)") from None
        except urllib.error.URLError as err:
            reason = err.reason
            if isinstance(reason, TimeoutError):
                raise _Retry(f"no answer within {timeout:g} s (--timeout-s)") from None
            raise _Retry(f"cannot connect: {one_line(reason)}") from None
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
            # a connection dropped, reset or cut mid-body (IncompleteRead), a TLS error: the next try may pass
            raise _Retry(error_line(err)) from None

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

    def _one(self, req: Request) -> Reply:
        try:
            path, body, opened = self._body(req)
        except TemplateError as err:
            return Reply(skip=str(err))
        tries = self.cfg.retries + 1
        for attempt in range(tries):
            if self._stop.is_set():
                return Reply(error="stopped")
            try:
                answer = self._call("POST", path, body, timeout=self.cfg.timeout_s)
                return _reply(answer, opened, chat=self.tokenizer is None, tools=bool(req.tools))
            except _Retry as err:
                last = str(err)
            except (ValueError, KeyError, IndexError, TypeError) as err:
                return Reply(error=one_line(err))
            if attempt + 1 < tries:
                self._stop.wait(self.cfg.retry_wait_s * 2**attempt)
        return Reply(error=f"{last} ({tries} tries)")

    def complete(self, requests: list[Request]) -> list[Reply]:
        pool = ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix="request")
        try:
            return list(pool.map(self._one, requests))
        # Ctrl-C: no new request, no retry wait; requests in flight end by their timeout
        except BaseException:
            self._stop.set()
            raise
        finally:
            pool.shutdown(wait=not self._stop.is_set(), cancel_futures=True)


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
