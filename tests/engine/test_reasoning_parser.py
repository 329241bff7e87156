"""MiniMax-M3's ``<mm:think>`` span split from the answer (``m3_engine.reasoning_parser``), whole and
streamed at every split position, and chained with the tool-call parser."""

from __future__ import annotations

import json

import pytest

from m3_engine.reasoning_parser import ChatOutputParser, MiniMaxM3ReasoningParser
from m3_engine.tool_parser import NS, MiniMaxM3ToolParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = (f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>2{NS}</days>'
        f'{NS}</invoke>\n{NS}</tool_call>')

# (generated text, starts_in_thinking, reasoning, content)
CASES = [
    ("<mm:think>Let me think.\nOK.</mm:think>The answer is 4.", False, "Let me think.\nOK.", "The answer is 4."),
    ("The answer is 4.", False, "", "The answer is 4."),
    ("</mm:think>The answer is 4.", False, "", "The answer is 4."),       # thinking disabled: a bare closer
    ("</mm:think></mm:think>x", False, "", "</mm:think>x"),               # only the leading one is dropped
    ("Text <mm:think>not thinking</mm:think> end", False, "", "Text <mm:think>not thinking</mm:think> end"),
    (" <mm:think>x</mm:think>", False, "", " <mm:think>x</mm:think>"),
    ("<mm:think>never closed <mm:th", False, "never closed <mm:th", ""),
    ("<mm:thin", False, "", "<mm:thin"),                                 # a partial tag at the end is text
    ("</mm:th", False, "", "</mm:th"),
    ("<mm:think></mm:think>", False, "", ""),
    ("", False, "", ""),
    ("thought <mm:think> more</mm:think>answer</mm:think>", True, "thought <mm:think> more",
     "answer</mm:think>"),
    ("still thinking </mm:thi", True, "still thinking </mm:thi", ""),
    ("</mm:think>answer", True, "", "answer"),
    ("", True, "", ""),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reasoning_whole_and_every_split(case):
    text, starts_in_thinking, reasoning, content = CASES[case]
    assert MiniMaxM3ReasoningParser.extract(text, starts_in_thinking=starts_in_thinking) == (reasoning, content)
    cut_lists = [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text))), [0, 0, len(text)]]
    for cuts in cut_lists:
        parser = MiniMaxM3ReasoningParser(starts_in_thinking=starts_in_thinking)
        got_r = got_c = ""
        bounds = [0, *cuts, len(text)]
        for a, b in zip(bounds, bounds[1:]):
            d = parser.feed(text[a:b])
            assert reasoning.startswith(got_r + d.reasoning) and content.startswith(got_c + d.content)
            got_r, got_c = got_r + d.reasoning, got_c + d.content
        d = parser.finish()
        assert (got_r + d.reasoning, got_c + d.content) == (reasoning, content), cuts


def test_reasoning_streams_before_the_end():
    """Reasoning and content are handed out as they arrive, not held to the end."""
    parser = MiniMaxM3ReasoningParser()
    assert parser.feed("<mm:").reasoning == ""
    assert parser.feed("think>abc").reasoning == "abc"
    d = parser.feed("de</mm:")
    assert d.reasoning == "de" and d.content == ""
    d = parser.feed("think>Hi")
    assert d.reasoning == "" and d.content == "Hi"


def test_reasoning_bad_arguments():
    with pytest.raises(TypeError, match="starts_in_thinking"):
        MiniMaxM3ReasoningParser(starts_in_thinking=1)
    parser = MiniMaxM3ReasoningParser()
    with pytest.raises(TypeError, match="text"):
        parser.feed(b"x")
    parser.finish()
    with pytest.raises(ValueError, match="finished"):
        parser.feed("x")
    with pytest.raises(TypeError, match="tool_parser"):
        ChatOutputParser(None, MiniMaxM3ReasoningParser())


# (generated text, starts_in_thinking, reasoning, content, calls)
CHAT_CASES = [
    ("<mm:think>Weather? Call the tool.</mm:think>Checking.\n" + CALL, False, "Weather? Call the tool.",
     "Checking.\n", [("get_weather", {"city": "Paris", "days": 2})]),
    ("I should call " + CALL + "</mm:think>" + CALL, True, "I should call " + CALL, "",
     [("get_weather", {"city": "Paris", "days": 2})]),                  # markup inside thinking is reasoning
    ("</mm:think>" + CALL + CALL[:60], False, "", CALL[:60], [("get_weather", {"city": "Paris", "days": 2})]),
    ("<mm:think>cut short " + CALL[:30], False, "cut short " + CALL[:30], "", []),
]


@pytest.mark.parametrize("case", range(len(CHAT_CASES)))
def test_reasoning_then_tool_calls(case):
    text, starts_in_thinking, reasoning, content, calls = CHAT_CASES[case]

    def parser():
        return ChatOutputParser(MiniMaxM3ReasoningParser(starts_in_thinking=starts_in_thinking),
                                MiniMaxM3ToolParser(TOOLS))

    got_r, got_c, got_calls = parser().parse(text)
    assert (got_r, got_c) == (reasoning, content)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    for cut_list in [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]:
        p = parser()
        bounds = [0, *cut_list, len(text)]
        deltas = [p.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [p.finish()]
        assert "".join(d.reasoning for d in deltas) == reasoning
        assert "".join(d.content for d in deltas) == content
        streamed = [d for step in deltas for d in step.tool_calls]
        assert [json.loads(d["function"]["arguments"]) for d in streamed if "id" not in d] == [a for _, a in calls]


def test_chat_output_parser_steps_left_out():
    text = "<mm:think>r</mm:think>" + CALL
    assert ChatOutputParser().parse(text) == ("", text, [])
    assert ChatOutputParser(MiniMaxM3ReasoningParser()).parse(text) == ("r", CALL, [])
    reasoning, content, calls = ChatOutputParser(tool_parser=MiniMaxM3ToolParser(TOOLS)).parse("hi " + CALL)
    assert (reasoning, content, len(calls)) == ("", "hi ", 1)
