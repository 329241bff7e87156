"""MiniMax-M3's tool calls: the markup the model writes, parsed into OpenAI ``tool_calls``.

The format
----------
Every structural tag of a tool call is prefixed by the namespace token
``]<]minimax[>[`` (written ``NS`` below). One block wraps all the calls of a
turn, one ``<invoke>`` per call; each argument is a tag named after the
parameter itself; nested objects are tags per key, arrays are ``<item>`` tags::

    NS<tool_call>
    NS<invoke name="get_weather">NS<city>Paris NS</city>NS<days>3NS</days>NS</invoke>
    NS<invoke name="book">NS<rooms>NS<item>NS<beds>2NS</beds>NS</item>NS</rooms>NS</invoke>
    NS</tool_call>

Scalar values are raw text (the chat template writes strings as they are,
booleans as ``true``/``false``, numbers as Python prints them, and leaves
``None`` arguments out). This is NOT MiniMax-M2's format
(``<minimax:tool_call><invoke name=".."><parameter name="x">..</parameter>``):
M3 adds the namespace token and names argument tags after the parameter.

Verified against (format only, no code taken):

* vLLM ``vllm/tool_parsers/_llm_nom/m3_text.py`` (``M3TextParser``: namespace
  token, one ``<tool_call>`` wrapper with several ``<invoke>``, nested XML,
  ``<item>`` arrays) and ``tests/tool_parsers/test_minimax_m3_tool_parser.py``;
  ``vllm/frontend/processing/tool_parsers/minimax_m3_tool_parser.py``
  (``tool_call_start_token = "]<]minimax[>[<tool_call>"``);
* ms-swift ``swift/agent_template/minimax_m3.py`` (``MinimaxM3AgentTemplate``,
  which mirrors the ``to_xml`` macro of M3's ``chat_template.jinja``);
* a tinker-cookbook-based MiniMax-M3 renderer (``MiniMaxM3Renderer``: each
  ``NS</invoke>`` followed by a newline) and llama.cpp's MiniMax-M3 PEG parser
  (``common_chat_params_init_minimax_m3``: whitespace allowed between invokes).

Values by the tool's JSON schema
--------------------------------
An argument whose body holds tags is an object (one key per child tag; a key
given twice collects its values in a list) or, when the schema says
``"array"`` or (the schema not saying ``"object"``) every child is an
``<item>``, an array. A text body is converted by the schema's type(s)
(``"type"``, a list of types, ``anyOf``/``oneOf`` members, or the types of
``enum``/``const`` values), trying the non-string types first in the schema's
order, ``"string"`` last:

* integer: an integer literal; number: a JSON number (finite);
* boolean: ``true``/``false`` (any case); null: ``null``;
* object / array: the text as JSON, if it parses to that kind;
* string: the text exactly as written.

Text no type accepts stays a string. A parameter the schema does not type
(unknown tool, unknown parameter, schema without a type) is parsed as JSON when
the text is valid JSON, else kept as a string. An empty body is ``{}`` / ``[]``
for an object / array schema, ``None`` for a null-only schema, else ``""``.

Streaming
---------
:class:`MiniMaxM3ToolParser` takes text deltas and hands out content deltas
and OpenAI tool-call deltas. A call is handed out when its ``NS</invoke>``
has arrived and its body parsed: first ``{"index", "id": "call_...",
"type": "function", "function": {"name", "arguments": ""}}``, then
``{"index", "function": {"arguments": <the arguments JSON>}}``. Nothing is
handed out for a call that may still turn out malformed, so a truncated or
broken call never becomes half a tool call: markup that is malformed, or still
unfinished at :meth:`~MiniMaxM3ToolParser.finish`, is handed out as content,
character for character (the calls completed before it in the block stay
calls). Decisions depend on the text only, never on where the deltas split it:
the deltas of any split concatenate to :meth:`MiniMaxM3ToolParser.extract`'s
result for the whole text.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["NS", "TOOL_CALL_START", "TOOL_CALL_END", "MiniMaxM3ToolParser", "ToolParserDelta", "tool_schemas",
           "merge_tool_call_deltas", "to_xml", "partial_tag_length"]

NS = "]<]minimax[>["
TOOL_CALL_START = NS + "<tool_call>"
TOOL_CALL_END = NS + "</tool_call>"
INVOKE_START = NS + '<invoke name="'
INVOKE_END = NS + "</invoke>"
# the tags that open or close a block or a call; an argument tag is any other NS<name> / NS</name>
_STRUCTURE = (INVOKE_END, INVOKE_START, TOOL_CALL_START, TOOL_CALL_END)
_INVOKE_NAME = re.compile(r'([^"<>\n]+)">')
_OPEN_TAG = re.compile(r"<([^<>/\s]+)>")
_CLOSE_TAG = re.compile(r"</([^<>/\s]+)>")
_INTEGER = re.compile(r"[+-]?\d+")


@dataclass
class ToolParserDelta:
    """What one :meth:`MiniMaxM3ToolParser.feed` (or ``finish``) hands out."""
    content: str = ""
    tool_calls: list = field(default_factory=list)   # OpenAI streaming tool-call deltas


def tool_schemas(tools) -> dict:
    """``{function name: its parameters JSON schema}`` of OpenAI ``tools``
    (``[{"type": "function", "function": {"name", "parameters"}}]``; a bare
    ``{"name", "parameters"}`` is accepted too). ``None`` -> ``{}``."""
    if tools is None:
        return {}
    if not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools: expected a list of {{'type': 'function', 'function': {{...}}}}, got {tools!r:.80}")
    schemas = {}
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TypeError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': str, ...}}}}, "
                            f"got {tool!r:.80}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise TypeError(f"tools[{i}]['function']['parameters']: expected a JSON schema dict, "
                            f"got {type(parameters).__name__}")
        schemas[function["name"]] = parameters or {}
    return schemas


def to_xml(value: Any) -> str:
    """A value as M3 writes an argument body (the chat template's ``to_xml``): objects as
    ``NS<key>..NS</key>`` (``None`` values left out), arrays as ``NS<item>..NS</item>``,
    booleans as ``true``/``false``, other scalars as ``str``."""
    if value is None:
        return ""
    if isinstance(value, dict):
        return "".join(f"{NS}<{k}>{to_xml(v)}{NS}</{k}>" for k, v in value.items() if v is not None)
    if isinstance(value, (list, tuple)):
        return "".join(f"{NS}<item>{to_xml(v)}{NS}</item>" for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def merge_tool_call_deltas(deltas) -> list:
    """OpenAI streaming tool-call deltas -> the message's ``tool_calls``
    (``[{"id", "type": "function", "function": {"name", "arguments"}}]``, by index)."""
    calls: dict = {}
    for d in deltas:
        if "id" in d:
            calls[d["index"]] = {"id": d["id"], "type": "function",
                                 "function": {"name": d["function"]["name"], "arguments": ""}}
        calls[d["index"]]["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


class MiniMaxM3ToolParser:
    """Tool calls out of M3's generated text, for one response (one choice).

    ``tools``: the request's OpenAI ``tools`` (their schemas type the arguments).

    Streaming: :meth:`feed` each text delta, then :meth:`finish` once; each
    returns a :class:`ToolParserDelta`. Whole text: :meth:`extract`.
    """

    _CONTENT, _BLOCK, _INVOKE = "content", "block", "invoke"

    def __init__(self, tools=None):
        self.schemas = tool_schemas(tools)
        self._mode = self._CONTENT
        self._buf = ""          # text not decided yet
        self._pending = ""      # markup of the open block since its last call: content if it turns out malformed
        self._calls_in_block = 0
        self._num_calls = 0
        self._finished = False

    @classmethod
    def extract(cls, text: str, tools=None) -> tuple:
        """The whole generated text -> ``(content, tool_calls)``: the text outside the calls'
        markup, and ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
        (``arguments`` a JSON object text)."""
        parser = cls(tools)
        first, last = parser.feed(text), parser.finish()
        return first.content + last.content, merge_tool_call_deltas(first.tool_calls + last.tool_calls)

    def feed(self, text: str) -> ToolParserDelta:
        """One more piece of generated text -> the content and tool-call deltas it completes."""
        if self._finished:
            raise ValueError("feed: this parser has finished; make a new one per response")
        if not isinstance(text, str):
            raise TypeError(f"text: expected a string, got {type(text).__name__}")
        self._buf += text
        out = ToolParserDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ToolParserDelta:
        """The end of the text: what is still undecided (an unfinished block or call) is content."""
        if self._finished:
            raise ValueError("finish: called twice")
        self._finished = True
        out = ToolParserDelta(content=self._pending + self._buf)
        self._pending = self._buf = ""
        return out

    # -- the state machine -------------------------------------------------------------------------

    def _step(self, out: ToolParserDelta) -> bool:
        """Decide what the buffer's start is, as far as the text allows; -> whether it moved on."""
        buf = self._buf
        if self._mode == self._CONTENT:
            at = buf.find(TOOL_CALL_START)
            if at < 0:   # hand out all but a tail that may start the block's tag
                keep = partial_tag_length(buf, TOOL_CALL_START)
                out.content += buf[:len(buf) - keep]
                self._buf = buf[len(buf) - keep:]
                return False
            out.content += buf[:at]
            self._pending, self._buf = TOOL_CALL_START, buf[at + len(TOOL_CALL_START):]
            self._mode, self._calls_in_block = self._BLOCK, 0
            return True

        if self._mode == self._BLOCK:   # between calls: whitespace, then a call or the block's end
            body = buf.lstrip()
            if not body:
                return False
            self._pending += buf[:len(buf) - len(body)]
            if body.startswith(INVOKE_START):
                self._pending += INVOKE_START
                self._buf, self._mode = body[len(INVOKE_START):], self._INVOKE
                return True
            if body.startswith(TOOL_CALL_END):
                if not self._calls_in_block:   # a block without a call is not a tool call
                    out.content += self._pending + TOOL_CALL_END
                self._pending, self._buf, self._mode = "", body[len(TOOL_CALL_END):], self._CONTENT
                return True
            if INVOKE_START.startswith(body) or TOOL_CALL_END.startswith(body):
                self._buf = body
                return False
            self._buf = body
            self._malformed(out)
            return True

        # in a call: up to the first structural tag, which must be NS</invoke>
        at, tag = _first_structure_tag(buf)
        if tag is None:
            return False
        call = self._parse_call(buf[:at]) if tag == INVOKE_END else None
        if call is None:
            self._malformed(out)
            return True
        name, arguments = call
        index, self._num_calls = self._num_calls, self._num_calls + 1
        out.tool_calls.append({"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": name, "arguments": ""}})
        out.tool_calls.append({"index": index, "function": {"arguments": json.dumps(arguments, ensure_ascii=False)}})
        self._calls_in_block += 1
        self._pending, self._buf, self._mode = "", buf[at + len(INVOKE_END):], self._BLOCK
        return True

    def _malformed(self, out: ToolParserDelta) -> None:
        """The open block's markup since its last call is content; reading goes on from there as
        content (so a later block still opens)."""
        out.content += self._pending
        self._pending, self._mode = "", self._CONTENT

    def _parse_call(self, body: str) -> Optional[tuple]:
        """``name">`` + argument tags -> ``(name, arguments dict)``; None when malformed."""
        m = _INVOKE_NAME.match(body)
        if m is None:
            return None
        name = m.group(1)
        elements = _parse_elements(body[m.end():])
        if elements is None:
            return None
        properties = self.schemas.get(name, {}).get("properties")
        properties = properties if isinstance(properties, dict) else {}
        return name, _object((tag, _convert(node, properties.get(tag))) for tag, node in elements)


# -- argument bodies -----------------------------------------------------------------------------------

@dataclass
class _Node:
    text: str = ""
    children: list = field(default_factory=list)   # [(tag, _Node)]


def _parse_elements(body: str) -> Optional[list]:
    """``NS<a>..NS</a>NS<b>..NS</b>`` (whitespace between tags allowed) -> ``[(tag, _Node)]``;
    None when not well formed (text outside a tag, text beside child tags, a tag left open or
    closed by another name)."""
    pieces = body.split(NS)
    if pieces[0].strip():
        return None
    root = _Node()
    stack = [("", root)]
    for piece in pieces[1:]:
        m = _CLOSE_TAG.match(piece)
        if m is not None:
            tag, node = stack[-1]
            if len(stack) == 1 or tag != m.group(1):
                return None
            stack.pop()
            if node.children and node.text.strip():
                return None
            after = piece[m.end():]
        else:
            m = _OPEN_TAG.match(piece)
            if m is None:
                return None
            node = _Node()
            stack[-1][1].children.append((m.group(1), node))
            stack.append((m.group(1), node))
            after = piece[m.end():]
        stack[-1][1].text += after
    if len(stack) != 1 or root.text.strip():
        return None
    return root.children


def _schema_types(schema) -> list:
    """The JSON types a schema allows, in its order (``[]``: it does not say)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [t for member in schema[key] for t in _schema_types(member)]
    if isinstance(schema.get("properties"), dict):
        return ["object"]
    if "items" in schema:
        return ["array"]
    examples = schema["enum"] if isinstance(schema.get("enum"), list) else \
        [schema["const"]] if "const" in schema else []
    return [_json_type(v) for v in examples]


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "string")


def _member_schema(schema, key: str, *, item: bool):
    """The schema of an object's property ``key`` (or an array's items), looking into anyOf/oneOf."""
    if not isinstance(schema, dict):
        return None
    if item:
        found = schema.get("items")
    else:
        properties = schema.get("properties")
        found = properties.get(key) if isinstance(properties, dict) else None
        if found is None and isinstance(schema.get("additionalProperties"), dict):
            found = schema["additionalProperties"]
    if found is not None:
        return found
    for choice in ("anyOf", "oneOf"):
        for member in schema.get(choice) or []:
            found = _member_schema(member, key, item=item)
            if found is not None:
                return found
    return None


def _convert(node: _Node, schema) -> Any:
    types = _schema_types(schema)
    if node.children:
        all_items = all(tag == "item" for tag, _ in node.children)
        if "array" in types or (all_items and "object" not in types):
            return [_convert(child, _member_schema(schema, tag, item=True)) for tag, child in node.children]
        return _object((tag, _convert(child, _member_schema(schema, tag, item=False))) for tag, child in node.children)
    return _convert_text(node.text, types)


def _convert_text(text: str, types: list) -> Any:
    if not types:
        try:
            return _json(text)
        except ValueError:
            return text
    if text == "":
        for kind, empty in (("object", {}), ("array", []), ("string", "")):
            if kind in types:
                return empty
        return None if "null" in types else ""
    for kind in sorted(types, key=lambda k: k == "string"):   # stable: the schema's order, string last
        ok, value = _as_type(text, kind)
        if ok:
            return value
    return text


def _as_type(text: str, kind: str) -> tuple:
    s = text.strip()
    if kind == "string":
        return True, text
    if kind == "integer":
        return (True, int(s)) if _INTEGER.fullmatch(s) else (False, None)
    if kind == "boolean":
        return (True, s.lower() == "true") if s.lower() in ("true", "false") else (False, None)
    if kind == "null":
        return (True, None) if s == "null" else (False, None)
    if kind in ("number", "object", "array"):
        try:
            value = _json(s)
        except ValueError:
            return False, None
        if kind == "number":
            good = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else:
            good = isinstance(value, dict if kind == "object" else list)
        return (True, value) if good else (False, None)
    return False, None   # a type name JSON schema does not have


def _object(pairs) -> dict:
    """``[(key, value)]`` -> a dict; a key given more than once gets the list of its values."""
    grouped: dict = {}
    for key, value in pairs:
        grouped.setdefault(key, []).append(value)
    return {key: values[0] if len(values) == 1 else values for key, values in grouped.items()}


def _json(text: str):
    """``json.loads`` without Python's extensions (``NaN``, ``Infinity``): those raise ValueError."""
    def reject(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=reject)


# -- text helpers ----------------------------------------------------------------------------------

def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _first_structure_tag(buf: str) -> tuple:
    """``(position, tag)`` of the first structural tag in ``buf``, or ``(None, None)``. (A tag
    still arriving at the end hides no later one: a tag holds one namespace token.)"""
    at = buf.find(NS)
    while at >= 0:
        for tag in _STRUCTURE:
            if buf.startswith(tag, at):
                return at, tag
        at = buf.find(NS, at + len(NS))
    return None, None
