"""MiniMax-M3's thinking: the ``<mm:think>...</mm:think>`` span split from the answer.

The format
----------
M3 thinks inside ``<mm:think>`` ... ``</mm:think>`` at the start of its turn,
then answers. Its chat template's ``thinking_mode`` decides how the turn starts
(what follows ``]~b]ai\\n`` in the prompt):

* ``"adaptive"`` (the default): nothing; the model opens ``<mm:think>`` itself,
  or answers at once, often after a bare ``</mm:think>`` (the template writes
  earlier turns without thinking as ``</mm:think>answer``);
* ``"enabled"``: the prompt ends with ``<mm:think>``: the text generated starts
  INSIDE the thinking span (``starts_in_thinking=True`` here);
* ``"disabled"``: the prompt ends with ``</mm:think>``: all of it is answer.

MiniMax-M2 used ``<think>``/``</think>`` with the prompt ending in
``<think>\\n``; M3 does not.

Verified against (format only, no code taken): vLLM
``vllm/frontend/processing/reasoning/minimax_m3_reasoning_parser.py``
(``<mm:think>``/``</mm:think>``, the start prefilled when
``thinking_mode="enabled"``, a stray leading ``</mm:think>`` dropped); SGLang
``python/sglang/srt/parser/reasoning_parser.py`` (``MiniMaxM3Detector``);
ms-swift ``swift/template/templates/minimax.py`` (``MinimaxM3VLTemplateMeta``:
``thinking_prefix='<mm:think>'``, ``non_thinking_prefix='</mm:think>'``).

The rule here
-------------
Only the start of the generated text is looked at: a text starting with
``<mm:think>`` (or any text, when ``starts_in_thinking``) is reasoning up to
the first ``</mm:think>``, the rest is content; a text starting with a bare
``</mm:think>`` drops it and is content; any other text is content, tags
written later included. Thinking never closed (the budget ran out) is all
reasoning. Streaming hands out the same split whatever the deltas' borders.

:class:`ChatOutputParser` chains this parser and the tool-call parser: the
reasoning is taken out first, the content left goes through
:class:`~m3_engine.tool_parser.MiniMaxM3ToolParser`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .tool_parser import MiniMaxM3ToolParser, merge_tool_call_deltas, partial_tag_length

__all__ = ["THINK_START", "THINK_END", "MiniMaxM3ReasoningParser", "ReasoningDelta", "ChatOutputParser",
           "ChatDelta"]

THINK_START = "<mm:think>"
THINK_END = "</mm:think>"


@dataclass
class ReasoningDelta:
    """What one :meth:`MiniMaxM3ReasoningParser.feed` (or ``finish``) hands out."""
    reasoning: str = ""
    content: str = ""


class MiniMaxM3ReasoningParser:
    """Reasoning and content out of M3's generated text, for one response (one choice).

    ``starts_in_thinking``: the prompt ends inside an open thinking span (it
    ends with :data:`THINK_START`: ``thinking_mode="enabled"``).

    Streaming: :meth:`feed` each text delta, then :meth:`finish` once. Whole
    text: :meth:`extract`.
    """

    _START, _THINKING, _CONTENT = "start", "thinking", "content"

    def __init__(self, *, starts_in_thinking: bool = False):
        if not isinstance(starts_in_thinking, bool):
            raise TypeError(f"starts_in_thinking: expected a bool, got {starts_in_thinking!r}")
        self._mode = self._THINKING if starts_in_thinking else self._START
        self._buf = ""   # text not decided yet: a possible start of a tag
        self._finished = False

    @classmethod
    def extract(cls, text: str, *, starts_in_thinking: bool = False) -> tuple:
        """The whole generated text -> ``(reasoning, content)``."""
        parser = cls(starts_in_thinking=starts_in_thinking)
        first, last = parser.feed(text), parser.finish()
        return first.reasoning + last.reasoning, first.content + last.content

    def feed(self, text: str) -> ReasoningDelta:
        """One more piece of generated text -> the reasoning and content it completes."""
        if self._finished:
            raise ValueError("feed: this parser has finished; make a new one per response")
        if not isinstance(text, str):
            raise TypeError(f"text: expected a string, got {type(text).__name__}")
        out = ReasoningDelta()
        buf = self._buf + text
        if self._mode == self._START and not buf:
            return out
        if self._mode == self._START:
            for tag, mode in ((THINK_START, self._THINKING), (THINK_END, self._CONTENT)):
                if buf.startswith(tag):
                    buf, self._mode = buf[len(tag):], mode
                    break
            else:
                if THINK_START.startswith(buf) or THINK_END.startswith(buf):
                    self._buf = buf
                    return out
                self._mode = self._CONTENT
        if self._mode == self._THINKING:
            at = buf.find(THINK_END)
            if at < 0:
                keep = partial_tag_length(buf, THINK_END)
                out.reasoning, self._buf = buf[:len(buf) - keep], buf[len(buf) - keep:]
                return out
            out.reasoning, buf, self._mode = buf[:at], buf[at + len(THINK_END):], self._CONTENT
        out.content, self._buf = buf, ""
        return out

    def finish(self) -> ReasoningDelta:
        """The end of the text: a held-back partial tag is reasoning inside thinking, else content."""
        if self._finished:
            raise ValueError("finish: called twice")
        self._finished = True
        rest, self._buf = self._buf, ""
        return ReasoningDelta(reasoning=rest) if self._mode == self._THINKING else ReasoningDelta(content=rest)


@dataclass
class ChatDelta:
    """What one :meth:`ChatOutputParser.feed` (or ``finish``) hands out for a chat completion chunk."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list = field(default_factory=list)   # OpenAI streaming tool-call deltas


class ChatOutputParser:
    """The reasoning parser, then the tool parser on the content it leaves; either may be None
    (that step is skipped: no reasoning split, or no tool calls parsed)."""

    def __init__(self, reasoning_parser: Optional[MiniMaxM3ReasoningParser] = None,
                 tool_parser: Optional[MiniMaxM3ToolParser] = None):
        if reasoning_parser is not None and not isinstance(reasoning_parser, MiniMaxM3ReasoningParser):
            raise TypeError(f"reasoning_parser: expected a MiniMaxM3ReasoningParser or None, "
                            f"got {type(reasoning_parser).__name__}")
        if tool_parser is not None and not isinstance(tool_parser, MiniMaxM3ToolParser):
            raise TypeError(f"tool_parser: expected a MiniMaxM3ToolParser or None, got {type(tool_parser).__name__}")
        self.reasoning_parser, self.tool_parser = reasoning_parser, tool_parser

    def parse(self, text: str) -> tuple:
        """The whole generated text -> ``(reasoning, content, tool_calls)`` (as the tool parser's
        :meth:`~m3_engine.tool_parser.MiniMaxM3ToolParser.extract` gives them)."""
        first, last = self.feed(text), self.finish()
        return (first.reasoning + last.reasoning, first.content + last.content,
                merge_tool_call_deltas(first.tool_calls + last.tool_calls))

    def feed(self, text: str) -> ChatDelta:
        if self.reasoning_parser is None:
            return self._tools(ChatDelta(), text, finish=False)
        step = self.reasoning_parser.feed(text)
        return self._tools(ChatDelta(reasoning=step.reasoning), step.content, finish=False)

    def finish(self) -> ChatDelta:
        if self.reasoning_parser is None:
            return self._tools(ChatDelta(), "", finish=True)
        step = self.reasoning_parser.finish()
        return self._tools(ChatDelta(reasoning=step.reasoning), step.content, finish=True)

    def _tools(self, out: ChatDelta, content: str, *, finish: bool) -> ChatDelta:
        if self.tool_parser is None:
            out.content = content
            return out
        steps = [self.tool_parser.feed(content)] if content else []
        if finish:
            steps.append(self.tool_parser.finish())
        for step in steps:
            out.content += step.content
            out.tool_calls += step.tool_calls
        return out

