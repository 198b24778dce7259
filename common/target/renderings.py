"""Which renderings of a conversation train its assistant turns, and which characters of each are trained:
as the target generated every turn, or, for rows without reasoning, with no ``<think>`` token trained.

Why apart from tokenizing (chat.py): this is text only, the chat template applied to prefixes of the
conversation and compared; what the renderings are decides how many samples a row gives and what the
drafter learns, so the rule lives in one place, testable without a dataset.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from dflash.common.target.conversation import BadRow

Rendering = tuple[str, list[tuple[int, int]]]  # text, char spans of the trained assistant turns


def render(tokenizer, msgs: list[dict[str, Any]], tools: list[dict] | None, generation: bool = False) -> str:
    """The template's text of ``msgs`` (with the generation prompt when ``generation``); BadRow when the
    template raises for this conversation (that row's problem, not the run's)."""
    try:
        return tokenizer.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=generation
        )
    except Exception:  # noqa: BLE001 - a template may raise for one conversation: that row's problem
        raise BadRow("template error") from None


def generation_renderings(
    tokenizer, msgs: list[dict[str, Any]], tools: list[dict] | None = None, *, train_reasoning: bool = True
) -> list[Rendering]:
    """The conversation as the target sees it while generating each assistant turn, in as few renderings
    as are exact: the fewest training samples whose tokens are the target's own context.

    Assistant turn i at generation time is G_i = render(msgs[:i], generation prompt) followed by its turn
    T_i, where render(msgs[:i+1]) = G_i + T_i (+ trailing whitespace). A rendering of msgs[:j+1] trains
    turn i <= j exactly when it starts with G_i + T_i. Templates that render history as it was generated
    (prefix-stable) need one rendering for the whole row; the Qwen3 family strips the reasoning of
    assistant turns before the last user query, so such a row needs one rendering per user query whose
    turns carry reasoning (each with the history the target saw), never one per turn: consecutive turns
    that one rendering holds exactly share it.

    ``train_reasoning`` off (the rows carry no reasoning): see ``_renderings_without_reasoning``."""
    if not train_reasoning:
        return _renderings_without_reasoning(tokenizer, msgs, tools)
    groups: list[Rendering] = []
    text, spans = "", []  # the open group: the rendering of its last turn, its turns' spans
    for head, upto in _turn_renderings(tokenizer, msgs, tools):
        end = len(upto.rstrip())
        if spans and not upto.startswith(text[: spans[-1][1]]):
            groups.append((text, spans))  # the open group's turns render differently from here on
            spans = []
        text = upto
        spans.append((len(head), end))
    if not spans:
        raise BadRow("only a leading assistant turn")
    groups.append((text, spans))
    return groups


def _turn_renderings(
    tokenizer, msgs: list[dict[str, Any]], tools: list[dict] | None
) -> Iterator[tuple[str, str]]:
    """(G_i, render(msgs[:i+1])) of each assistant turn i but a leading one (context: no generation prompt
    renders before the first message)."""
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i == 0:
            continue
        head = render(tokenizer, msgs[:i], tools, generation=True)
        upto = render(tokenizer, msgs[: i + 1], tools)
        if not upto.startswith(head):
            raise BadRow("template renders an assistant turn unlike its generation prompt")
        yield head, upto


_EMPTY_THINK = re.compile(r"<think>\s*</think>\s*")


def empty_think_blocks(text: str) -> list[tuple[int, int]]:
    """Character spans of the empty ``<think>`` blocks in ``text``, each with the whitespace after it."""
    return [m.span() for m in _EMPTY_THINK.finditer(text)]


def _without_blocks(pos: int, blocks: list[tuple[int, int]]) -> int:
    """Position ``pos`` of a text in the same text with ``blocks`` cut out."""
    return pos - sum(min(end, pos) - start for start, end in blocks if start < pos)


def _with_blocks(pos: int, blocks: list[tuple[int, int]], *, past_a_block_here: bool) -> int:
    """The inverse of ``_without_blocks``; a block that starts right at the position is stepped over when
    ``past_a_block_here`` (a span's start: the block is not trained), not otherwise (a span's end)."""
    for start, end in blocks:
        if start < pos or (past_a_block_here and start == pos):
            pos += end - start
        else:
            break
    return pos


def _renderings_without_reasoning(
    tokenizer, msgs: list[dict[str, Any]], tools: list[dict] | None
) -> list[Rendering]:
    """generation_renderings of a row without reasoning: the fewest renderings that train every turn with
    no reasoning token, never more than the row gives with its reasoning.

    A Qwen3-family template gives the last assistant turn after the user's query an empty ``<think>``
    block and renders the same turn without it once it is history; rendered exactly, a tool-call loop
    whose turns carry no reasoning is one sample per turn (each with the history re-rendered), more
    samples and tokens than with its reasoning. Without reasoning the block is no reasoning at all: in
    the template's non-thinking mode it is part of the generation prompt. So here it is context, never
    trained, and two renderings that differ only by empty blocks count as one: a turn trained inside a
    later turn's rendering lacks, before it, the empty block it was generated after, nothing else."""
    groups: list[Rendering] = []
    flat, text, spans = "", "", []  # the open group: its last rendering with and without empty blocks
    for head, upto in _turn_renderings(tokenizer, msgs, tools):
        blocks = empty_think_blocks(upto)
        cut = upto
        for start, end in reversed(blocks):
            cut = cut[:start] + cut[end:]
        span = (_without_blocks(len(head), blocks), _without_blocks(len(upto.rstrip()), blocks))
        if spans and not cut.startswith(flat[: spans[-1][1]]):
            groups.append(_spans_in(text, spans))
            spans = []
        flat, text = cut, upto
        spans.append(span)
    if not spans:
        raise BadRow("only a leading assistant turn")
    groups.append(_spans_in(text, spans))
    return groups


def _spans_in(text: str, flat_spans: list[tuple[int, int]]) -> Rendering:
    """The rendering ``text`` with the spans given in its coordinates without empty think blocks, minus
    every such block (none is trained)."""
    blocks = empty_think_blocks(text)
    spans: list[tuple[int, int]] = []
    for s, e in flat_spans:
        a = _with_blocks(s, blocks, past_a_block_here=True)
        b = _with_blocks(e, blocks, past_a_block_here=False)
        for start, end in blocks:
            if a <= start < b:
                spans.append((a, start))
                a = end
        spans.append((a, b))
    return text, [(a, b) for a, b in spans if a < b]
