"""One row's conversation, rewritten turn by turn: each assistant turn is asked of the target with the
conversation so far, in which the earlier answers are already the target's own, so every later turn is
written in the context the target itself made (the context dflash-produce later trains it in).

The source's assistant turns mark where the target answers; their text is never sent. A row that ends on
a user (or tool) turn gets one more answer. Tool results cannot be made again: they stay the source's,
which is right only while the target calls tools where the source did. Where it does not (it answers where
the source called a tool, or calls one where the source answered), the row ends after that turn
(``truncated``): no tool result exists for the new call, and the old result answers a call never made.
Where the source has nothing after the target's call (the row ended asking and the target called a tool),
the row ends on a call without its result: ``truncated`` too, so the record says so of every row that
stops short of a whole exchange.
"""

from __future__ import annotations

from typing import Any

from dflash.tools.regenerate.reply import Request


class Dialogue:
    """The walk over one row: ``next_request`` (None when the row is done), then ``accept`` its answer."""

    def __init__(self, messages: list[dict[str, Any]], tools: list[dict] | None):
        self.source = messages
        self.tools = tools
        self.out: list[dict[str, Any]] = []
        self.pos = 0  # next source message to take
        self.finish: list[str] = []  # how each written turn ended: "stop" or "length"
        self.tokens = 0
        self.truncated = False

    def _answered(self) -> bool:
        return any(m["role"] == "user" for m in self.out)

    def next_request(self) -> Request | None:
        """The next turn to write, copying the source's other turns up to it; None when the row is done."""
        while self.pos < len(self.source):
            msg = self.source[self.pos]
            if msg["role"] == "assistant" and self._answered():
                return Request(messages=list(self.out), tools=self.tools)
            self.out.append(msg)  # system, user, tool, or an assistant turn before any user (context)
            self.pos += 1
        if self.out and self.out[-1]["role"] in ("user", "tool"):
            return Request(messages=list(self.out), tools=self.tools)  # the row ends asking: answer it
        return None

    def accept(self, message: dict[str, Any], finish: str, tokens: int = 0) -> None:
        """The target's answer to the last request; ends the row where the source's tool results no longer
        fit (module docstring)."""
        slot = self.source[self.pos] if self.pos < len(self.source) else None
        if slot is not None and slot["role"] == "assistant":
            self.pos += 1
            _keep_call_ids(slot, message)
        self.out.append(message)
        self.finish.append(finish)
        self.tokens += tokens
        following = self.source[self.pos] if self.pos < len(self.source) else None
        called = bool(message.get("tool_calls"))
        if following is None and called:  # the source ends here: nothing answers the call
            self.truncated = True
        elif following is not None and (following["role"] == "tool") != called:
            self.truncated = True
            self.pos = len(self.source)

    def record(self) -> dict[str, Any]:
        """How the row's turns ended, for the output row."""
        return {"turns": len(self.finish), "finish": self.finish, "truncated": self.truncated}


def _keep_call_ids(slot: dict[str, Any], message: dict[str, Any]) -> None:
    """The source's call ids on the target's calls (same count): the tool results name them."""
    old, new = slot.get("tool_calls") or [], message.get("tool_calls") or []
    if old and len(old) == len(new):
        for o, n in zip(old, new, strict=True):
            if "id" in o:
                n["id"] = o["id"]
