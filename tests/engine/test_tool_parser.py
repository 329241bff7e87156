"""MiniMax-M3's tool-call markup -> OpenAI tool calls (``m3_engine.tool_parser``): values typed by
the tools' schemas, several calls, text around them, malformed or unfinished markup kept as content,
and streaming that gives the whole-text result whatever the deltas' borders."""

from __future__ import annotations

import json

import pytest

from m3_engine.tool_parser import NS, MiniMaxM3ToolParser, merge_tool_call_deltas, to_xml, tool_schemas

TOOLS = [
    {"type": "function", "function": {"name": "create_order", "parameters": {"type": "object", "properties": {
        "user_id": {"type": "integer"}, "urgent": {"type": "boolean"}, "note": {"type": "string"},
        "price": {"type": "number"}, "coupon": {"type": ["string", "null"]},
        "shipping": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}}}},
        "tags": {"type": "array", "items": {"type": "string"}},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "level": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "mode": {"enum": ["fast", "slow"]},
        "options": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}},
]


def invoke(name: str, body: str) -> str:
    return f'{NS}<invoke name="{name}">{body}{NS}</invoke>'


def arg(key: str, body: str) -> str:
    return f"{NS}<{key}>{body}{NS}</{key}>"


def block(*invokes: str) -> str:
    return f"{NS}<tool_call>\n" + "".join(i + "\n" for i in invokes) + f"{NS}</tool_call>"


ORDER = invoke("create_order", "".join([
    arg("user_id", "42"), arg("urgent", "true"), arg("note", " leave it at the front desk, 3 < 4 > 2 "),
    arg("price", "-1.5e2"), arg("coupon", "null"),
    arg("shipping", arg("city", "Singapore") + arg("zip", "018956")),
    arg("items", arg("item", arg("sku", "book-001") + arg("qty", "2"))
        + arg("item", arg("sku", "pen") + arg("qty", "5"))),
    arg("tags", arg("item", "a") + arg("item", "007")),
    arg("metadata", arg("source", "mobile") + arg("campaign", "may")),
    arg("level", "3"), arg("mode", "fast"), arg("options", arg("x", "1") + arg("x", "2"))]))
ORDER_ARGS = {"user_id": 42, "urgent": True, "note": " leave it at the front desk, 3 < 4 > 2 ", "price": -150.0,
              "coupon": None, "shipping": {"city": "Singapore", "zip": 18956},
              "items": [{"sku": "book-001", "qty": 2}, {"sku": "pen", "qty": 5}], "tags": ["a", "007"],
              "metadata": {"source": "mobile", "campaign": "may"}, "level": 3, "mode": "fast",
              "options": {"x": [1, 2]}}
WEATHER = invoke("get_weather", arg("city", "Paris") + arg("days", "3"))


def calls_of(text: str, tools=TOOLS) -> tuple:
    content, calls = MiniMaxM3ToolParser.extract(text, tools)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def stream(text: str, cuts, tools=TOOLS) -> tuple:
    """Feed ``text`` cut at ``cuts`` -> (content, tool-call deltas)."""
    parser = MiniMaxM3ToolParser(tools)
    content, deltas = "", []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        d = parser.feed(text[a:b])
        content, deltas = content + d.content, deltas + d.tool_calls
    d = parser.finish()
    return content + d.content, deltas + d.tool_calls


def test_nested_and_typed_arguments():
    content, calls = calls_of("I will create it.\n" + block(ORDER))
    assert content == "I will create it.\n"
    assert calls == [("create_order", ORDER_ARGS)]


@pytest.mark.parametrize("schema, text, expected", [
    ({"type": "integer"}, " 7 ", 7), ({"type": "integer"}, "7.5", "7.5"), ({"type": "integer"}, "abc", "abc"),
    ({"type": "number"}, "7", 7), ({"type": "number"}, "0.25", 0.25), ({"type": "number"}, "NaN", "NaN"),
    ({"type": "boolean"}, "False", False), ({"type": "boolean"}, "yes", "yes"),
    ({"type": "null"}, "null", None), ({"type": "null"}, "", None),
    ({"type": ["null", "string"]}, "null", None), ({"type": ["string", "integer"]}, "12", 12),
    ({"type": "string"}, "12", "12"), ({"type": "string"}, "", ""), ({"type": "string"}, "true", "true"),
    ({"type": "object"}, '{"a": [1, null]}', {"a": [1, None]}), ({"type": "object"}, "", {}),
    ({"type": "array"}, "[1, 2]", [1, 2]), ({"type": "array"}, "", []), ({"type": "array"}, "{}", "{}"),
    ({"enum": [1, 2]}, "2", 2), ({"const": True}, "true", True), ({"oneOf": [{"type": "boolean"}]}, "true", True),
    # a schema without a type: JSON when the text is JSON, else the text
    ({}, "12", 12), ({}, "[1, {\"b\": false}]", [1, {"b": False}]), ({}, "null", None), ({}, "hi there", "hi there"),
    ({"description": "no type"}, "Infinity", "Infinity"),
])
def test_value_by_schema(schema, text, expected):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"p": schema}}}}]
    _, calls = calls_of(block(invoke("f", arg("p", text))), tools)
    assert calls == [("f", {"p": expected})]
    assert type(calls[0][1]["p"]) is type(expected)


def test_unknown_tool_and_parameter():
    """Not in the schemas: JSON if the text is JSON, else the text; nested tags as objects, <item>s as arrays."""
    text = block(invoke("nope", arg("n", "5") + arg("s", "five") + arg("l", arg("item", "1") + arg("item", "x"))
                        + arg("o", arg("k", "true"))), invoke("get_weather", arg("extra", "false")))
    _, calls = calls_of(text)
    assert calls == [("nope", {"n": 5, "s": "five", "l": [1, "x"], "o": {"k": True}}),
                     ("get_weather", {"extra": False})]
    assert calls_of(text, None)[1] == calls


def test_several_calls_and_text_around():
    text = "Checking both.\n" + block(WEATHER, ORDER) + "\nDone?" + block(invoke("get_weather", "")) + " end"
    content, calls = calls_of(text)
    assert content == "Checking both.\n\nDone? end"
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("create_order", ORDER_ARGS),
                     ("get_weather", {})]


def test_no_markup_is_all_content():
    for text in ["", "plain text", "a ]<]minimax[>[ b", "<tool_call>x</tool_call>", "]<]minimax[>[<tool_ca"]:
        assert MiniMaxM3ToolParser.extract(text, TOOLS) == (text, [])


MALFORMED = [
    block()[:-1],                                                        # unterminated block
    f"{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">{arg('city', 'Pa')}",   # unterminated call
    block(invoke("get_weather", f"{NS}<city>Paris{NS}</town>")),         # closed by another name
    block(invoke("get_weather", f"{NS}<city>Paris")),                   # argument never closed
    block(invoke("get_weather", "text outside tags" + arg("city", "x"))),
    block(invoke("get_weather", arg("o", "text" + arg("k", "v")))),     # text beside child tags
    block(invoke("get_weather", f"{NS}city>x{NS}</city>")),            # NS not followed by a tag
    block(invoke("", arg("city", "x"))),                                # no name
    f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{arg("city", "x")}{NS}</tool_call>',   # call not closed
    f"{NS}<tool_call>\nsome text\n{NS}</tool_call>",                      # text in the block
    block(),                                                             # a block without a call
    f"{NS}<tool_call>{NS}<tool_call>",
]


@pytest.mark.parametrize("bad", range(len(MALFORMED)))
def test_malformed_markup_is_content(bad):
    text = "before " + MALFORMED[bad] + " after"
    assert MiniMaxM3ToolParser.extract(text, TOOLS) == (text, [])


def test_calls_before_the_malformed_part_stay_calls():
    rest = f'\n{NS}<invoke name="get_weather">{NS}<city>Par'
    text = f"plain {NS}<tool_call>\n{WEATHER}{rest}"
    content, calls = calls_of(text)
    assert content == "plain " + rest
    assert calls == [("get_weather", {"city": "Paris", "days": 3})]
    # a malformed block does not hide a later good one
    text = f"{NS}<tool_call>oops" + block(WEATHER) + "!"
    content, calls = calls_of(text)
    assert content == f"{NS}<tool_call>oops!" and calls == [("get_weather", {"city": "Paris", "days": 3})]


def test_openai_delta_shape():
    content, deltas = stream("x" + block(WEATHER, ORDER), [])
    assert content == "x"
    assert [d["index"] for d in deltas] == [0, 0, 1, 1]
    for head, body in (deltas[0:2], deltas[2:4]):
        assert head["id"].startswith("call_") and len(head["id"]) > 10 and head["type"] == "function"
        assert head["function"]["arguments"] == "" and set(body) == {"index", "function"}
        assert set(body["function"]) == {"arguments"}
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[2]["function"]["name"] == "create_order"
    assert deltas[0]["id"] != deltas[2]["id"]
    assert json.loads(deltas[3]["function"]["arguments"]) == ORDER_ARGS


STREAMED = [
    "Let me check.\n" + block(WEATHER, ORDER) + "\nanything after",
    "<mm:think> not ours " + block(WEATHER) + block(invoke("get_weather", arg("city", "Rome"))),
    "plain " + MALFORMED[1],
    f"plain {NS}<tool_call>\n{WEATHER}\n{NS}<invoke name=\"get_weather\">{NS}<city>Pa",
    "a" + MALFORMED[8] + block(WEATHER),
    "x ]<]minimax[>]<]minimax[>[<tool_call>\n \n" + invoke("get_weather", "\n" + arg("days", "1") + "\n") + "  \n"
    + f"{NS}</tool_call>" + "]<]minimax[",
]


@pytest.mark.parametrize("case", range(len(STREAMED)))
def test_streaming_every_split_position(case):
    """One cut at every position, and one character at a time: the deltas concatenate to the whole
    text's result, and no content is handed out before it is certain."""
    text = STREAMED[case]
    whole_content, whole_calls = MiniMaxM3ToolParser.extract(text, TOOLS)
    assert whole_calls or case in (2,)

    def same(content, deltas):
        assert content == whole_content
        calls = merge_tool_call_deltas(deltas)
        assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
        assert [d["index"] for d in deltas if "id" in d] == list(range(len(whole_calls)))

    for cut in range(len(text) + 1):
        same(*stream(text, [cut]))
    same(*stream(text, range(1, len(text))))


def test_to_xml_round_trip():
    """What the chat template writes (``to_xml``) parses back to the same arguments."""
    arguments = {"user_id": 7, "urgent": False, "price": 2.5, "note": "a < b", "coupon": None,
                 "items": [{"sku": "x", "qty": 1}], "tags": [], "shipping": {"city": "Oslo", "zip": 1234},
                 "options": {"deep": {"deeper": [[1, 2], {"k": "v"}]}}}
    body = "".join(f"{NS}<{k}>{to_xml(v)}{NS}</{k}>" for k, v in arguments.items() if v is not None)
    _, calls = calls_of(block(invoke("create_order", body)))
    expected = {k: v for k, v in arguments.items() if v is not None}
    assert calls == [("create_order", expected)]


def test_bad_arguments():
    with pytest.raises(TypeError, match="tools"):
        MiniMaxM3ToolParser({"name": "f"})
    with pytest.raises(TypeError, match=r"tools\[0\]"):
        tool_schemas([{"type": "function", "function": {"description": "no name"}}])
    with pytest.raises(TypeError, match="parameters"):
        tool_schemas([{"name": "f", "parameters": "object"}])
    assert tool_schemas([{"name": "f"}]) == {"f": {}}
    parser = MiniMaxM3ToolParser(TOOLS)
    with pytest.raises(TypeError, match="text"):
        parser.feed(None)
    parser.finish()
    with pytest.raises(ValueError, match="finished"):
        parser.feed("x")
    with pytest.raises(ValueError, match="twice"):
        parser.finish()
