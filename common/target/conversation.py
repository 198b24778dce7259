"""One chat row as the messages a chat template takes: OpenAI (``messages``) and ShareGPT
(``conversations``) rows, their roles, reasoning, tool calls and tool lists normalized, or the reason the
row cannot be trained (:class:`BadRow`).

Why apart from tokenizing (chat.py): this is the row's shape alone, pure Python over JSON values, and
every way a row of a million-row dataset can be malformed is decided here, in one place.
"""

from __future__ import annotations

import json
import re
from typing import Any

_ROLE = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
    "observation": "tool",  # ShareGPT tool result
    "function_call": "assistant",  # ShareGPT tool call: the value is {"name", "arguments"} JSON
}


FORMAT_NAME = {"messages": "an OpenAI", "conversations": "a ShareGPT"}


class BadRow(ValueError):
    """A row that cannot be trained; the message is the drop reason."""


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep text parts only
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        if parts and all(isinstance(p, str) for p in parts):
            return "".join(parts)
    return None


def prune_nulls(value: Any) -> Any:
    """Drop None-valued keys: arrow gives every struct the union of the fields of all rows, None where a
    row had none, and a template would render those as ``null`` keys the row never had."""
    if isinstance(value, dict):
        return {k: prune_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [prune_nulls(v) for v in value]
    return value


def _json_value(value: Any, what: str) -> Any:
    if isinstance(value, str):  # tools and arguments are often stored as JSON text
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise BadRow(f"{what} not JSON") from None
    return value


def normalize_tools(raw: Any) -> list[dict] | None:
    """A row's tool definitions (a list of objects, or its JSON text) for the template's ``tools=``."""
    if raw is None:
        return None
    tools = _json_value(raw, "tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRow("tools not a list of objects")
    return tools


def _tool_calls(raw: Any) -> list[dict] | None:
    """HF's shape: [{"type": "function", "function": {"name", "arguments": object}}] (a flat {name,
    arguments} is wrapped, arguments given as JSON text are parsed; an OpenAI "id" is kept)."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise BadRow("tool_calls not a list")
    calls = []
    for call in raw:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRow("tool call without a function name")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # JSON text (OpenAI's wire form): HF templates expect the object
            try:
                args = json.loads(args) if isinstance(json.loads(args), dict) else args
            except json.JSONDecodeError:
                pass  # not JSON: the template gets the text as it is
        out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            out["id"] = call["id"]
        calls.append(out)
    return calls


_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


def without_inline_reasoning(content: str) -> str:
    """Assistant content without the reasoning written into it: every ``<think>…</think>`` block, the text
    up to a ``</think>`` with no opening (a template that opens the block in its generation prompt, as
    Qwen3.5/3.6 do, leaves only the end in the answer) and an unclosed ``<think>`` to the end (reasoning cut
    off). Content without a ``<think>`` tag is returned as it is."""
    if "</think>" in content:
        content = _THINK_BLOCK.sub("", content).rpartition("</think>")[2].lstrip()
    if "<think>" in content:
        content = content.partition("<think>")[0].rstrip()
    return content


def _turn(turn: Any, train_reasoning: bool) -> dict[str, Any] | None:
    """One turn in HF chat-template form, None for an assistant turn with nothing in it (dropped)."""
    if not isinstance(turn, dict):
        raise BadRow("turn not an object")
    role = turn.get("role", turn.get("from"))
    if not isinstance(role, str) or role not in _ROLE:  # a list/dict role is unhashable: not a crash
        raise BadRow("unknown role")
    raw = turn.get("content", turn.get("value"))
    msg: dict[str, Any] = {"role": _ROLE[role]}
    if role == "function_call":
        msg["content"], msg["tool_calls"] = None, _tool_calls([_json_value(raw, "function_call value")])
        return msg
    content = _text(raw)
    if raw is not None and content is None:
        raise BadRow("content not text")
    if msg["role"] != "assistant":
        msg["content"] = content or ""
        for key in ("name", "tool_call_id"):  # a tool result's function name / the call it answers
            if isinstance(turn.get(key), str):
                msg[key] = turn[key]
        return msg
    reasoning = turn.get("reasoning_content", turn.get("reasoning"))
    reasoning = reasoning if isinstance(reasoning, str) and reasoning.strip() and train_reasoning else None
    if content is not None and not train_reasoning:
        content = without_inline_reasoning(content)
    calls = _tool_calls(turn.get("tool_calls"))
    if not (content and content.strip()) and reasoning is None and calls is None:
        return None
    msg["content"] = content or ""
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls is not None:
        msg["tool_calls"] = calls
    return msg


def normalize_conversation(
    raw: Any, *, train_reasoning: bool = True, null_fields: bool = False
) -> tuple[list[dict[str, Any]] | None, str]:
    """HF chat-template messages from an OpenAI or ShareGPT turn list, or (None, reason) for a bad row.

    Roles system/user/assistant/tool (and their ShareGPT names); an assistant turn keeps its
    ``reasoning_content`` (or ``reasoning``) and ``tool_calls`` (content may be null); with
    ``train_reasoning`` off it keeps neither field nor the ``<think>`` blocks written into its content
    (``without_inline_reasoning``). An assistant turn with no content, reasoning or call is dropped, not the
    row. ``null_fields``: the turns came from arrow (None keys are its padding, not the row's)."""
    if isinstance(raw, dict):  # raw-JSON rows: the whole row
        raw = raw.get("messages", raw.get("conversations"))
    if not isinstance(raw, list) or not raw:
        return None, "not a list" if not isinstance(raw, list) else "empty"
    try:
        turns = [_turn(prune_nulls(t) if null_fields else t, train_reasoning) for t in raw]
    except BadRow as err:
        return None, str(err)
    msgs = [t for t in turns if t is not None]
    if not any(m["role"] == "assistant" for m in msgs):
        return None, "only empty assistant turns" if len(msgs) < len(turns) else "no assistant turn"
    return msgs, "ok"
