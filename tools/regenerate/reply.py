"""What an engine is asked and what it answers (``Request``, ``Reply``), and an answer's text as the
assistant message the chat template renders back: reasoning in ``reasoning_content``, tool calls as tool
calls.

Why parse here rather than take a server's parsers: the answer must render back, through the target's own
template, as the tokens the target wrote, and that holds only when the split follows the template's own
shape (Qwen3-family: ``<think>\\n…\\n</think>\\n\\n`` before the content, ``<tool_call>`` blocks after it,
as JSON (Qwen3, Hermes) or as ``<function=NAME><parameter=P>`` (Qwen3.5/3.6, Qwen3-Coder)). Text that does
not parse as a tool call stays content, verbatim: the target's words are never rewritten.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass
class Request:
    """One assistant turn to write: the conversation so far (HF chat-template form) and the row's tools."""

    messages: list[dict[str, Any]]
    tools: list[dict] | None


@dataclass
class Reply:
    """An engine's answer to one Request: the raw text (the local engine and /v1/completions, parsed by
    ``assistant_message``) or the message a server already split (/v1/chat/completions); or why there is
    none: ``error`` (the request failed: the row is retried on a re-run) or ``skip`` (the row cannot be
    rendered: the same on every run)."""

    text: str | None = None
    opened_think: bool = False
    """The prompt ends inside an open ``<think>`` (templates that start the reasoning block themselves)."""
    message: dict[str, Any] | None = None
    finish: str = "stop"
    """"stop" (the target ended its turn) or "length" (cut at --max-new-tokens)."""
    tokens: int = 0
    ids: list[int] | None = None
    """The answer's token ids where the engine has them (the local engine): a caller that must train on
    exactly these tokens can check that the text tokenizes back to them."""
    error: str | None = None
    skip: str | None = None


class TemplateError(ValueError):
    """The chat template raised for this conversation: the row is skipped (the same on every run)."""


def render_prompt(tokenizer: Any, request: Request, template_kwargs: dict[str, Any]) -> str:
    """The conversation so far with the generation prompt, as the target's template renders it: the
    context dflash-produce trains the answer in (``G_i``, docs/producer.md)."""
    try:
        return tokenizer.apply_chat_template(
            request.messages,
            tools=request.tools,
            tokenize=False,
            add_generation_prompt=True,
            **template_kwargs,
        )
    except Exception as err:  # noqa: BLE001 - a template may raise for one conversation: that row's problem
        raise TemplateError(f"template error: {err}") from None


def opens_think(prompt: str) -> bool:
    """The rendered generation prompt leaves a ``<think>`` block open (e.g. Qwen3.5 with thinking on)."""
    return prompt.rfind("<think>") > prompt.rfind("</think>")


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _one_call(block: str) -> dict[str, Any] | None:
    """One ``<tool_call>`` body in HF's shape, None when it is neither form."""
    block = block.strip()
    if block.startswith("{"):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", call.get("parameters", {}))
        return {
            "type": "function",
            "function": {
                "name": call["name"],
                "arguments": _json_or_text(args) if isinstance(args, str) else args,
            },
        }
    fn = _FUNCTION.fullmatch(block)
    if fn is None:
        return None
    args = {name.strip(): _json_or_text(value) for name, value in _PARAMETER.findall(fn.group(2))}
    return {"type": "function", "function": {"name": fn.group(1).strip(), "arguments": args}}


def split_tool_calls(body: str) -> tuple[str, list[dict[str, Any]] | None]:
    """(content, tool calls) of an answer's text after its reasoning; (body, None) when it has no tool call
    or any part of it does not parse (then the whole text stays content)."""
    first = body.find("<tool_call>")
    if first < 0:
        return body, None
    blocks = list(_TOOL_CALL.finditer(body, first))
    rest = _TOOL_CALL.sub("", body[first:])
    calls = [_one_call(m.group(1)) for m in blocks]
    if not blocks or rest.strip() or any(c is None for c in calls):
        return body, None
    return body[:first].removesuffix("\n"), calls


def assistant_message(text: str, *, opened_think: bool, tools: bool) -> dict[str, Any]:
    """The target's answer as an assistant message: ``reasoning_content`` (a ``<think>`` block, or the
    text up to ``</think>`` when the prompt opened it; all of it when the answer was cut inside), content,
    and with ``tools`` its ``<tool_call>`` blocks as ``tool_calls``. Newlines around the parts are
    removed the way Qwen3-family templates strip them, so the message renders back as written."""
    msg: dict[str, Any] = {"role": "assistant"}
    body = text
    if opened_think or text.lstrip().startswith("<think>"):
        thought, closed, rest = text.partition("</think>")
        thought = thought.lstrip().removeprefix("<think>") if not opened_think else thought
        body = rest if closed else ""
        if thought.strip():
            msg["reasoning_content"] = thought.strip("\n")
        body = body.lstrip("\n")
    content, calls = split_tool_calls(body) if tools else (body, None)
    msg["content"] = content
    if calls:
        msg["tool_calls"] = calls
    return msg
