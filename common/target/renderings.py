"""Which renderings of a conversation train its assistant turns, and which characters of each are trained:
as the target generated every turn.

Why apart from tokenizing (chat.py): this is text only, the chat template applied to prefixes of the
conversation and compared; what the renderings are decides how many samples a row gives and what the
drafter learns, so the rule lives in one place, testable without a dataset.
"""

from __future__ import annotations

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
    tokenizer, msgs: list[dict[str, Any]], tools: list[dict] | None = None
) -> list[Rendering]:
    """The conversation as the target sees it while generating each assistant turn, in as few renderings
    as are exact: the fewest training samples whose tokens are the target's own context.

    Assistant turn i at generation time is G_i = render(msgs[:i], generation prompt) followed by its turn
    T_i, where render(msgs[:i+1]) = G_i + T_i (+ trailing whitespace). A rendering of msgs[:j+1] trains
    turn i <= j exactly when it starts with G_i + T_i. Templates that render history as it was generated
    (prefix-stable) need one rendering for the whole row; the Qwen3 family strips the reasoning of
    assistant turns before the last user query, so such a row needs one rendering per user query whose
    turns carry reasoning (each with the history the target saw), never one per turn: consecutive turns
    that one rendering holds exactly share it."""
    groups: list[Rendering] = []
    text, spans = "", []  # the open group: the rendering of its last turn, its turns' spans
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i == 0:  # a leading assistant turn: context (no prompt renders alone)
            continue
        head = render(tokenizer, msgs[:i], tools, generation=True)
        upto = render(tokenizer, msgs[: i + 1], tools)
        if not upto.startswith(head):
            raise BadRow("template renders an assistant turn unlike its generation prompt")
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


def assistant_spans_by_prefix(tokenizer, msgs: list[dict[str, Any]]) -> Rendering:
    """One rendering of the whole row with its assistant spans; ValueError when the template renders some
    turn differently as history (generation_renderings splits such a row)."""
    groups = generation_renderings(tokenizer, msgs)
    if len(groups) > 1:
        raise ValueError("chat template renders differently as history (not prefix-stable)")
    return groups[0]
