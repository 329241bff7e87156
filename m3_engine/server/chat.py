"""What agents send and get back through ``m3-serve``: tools, ``tool_choice``, ``response_format``,
vLLM's ``structured_outputs``, and the reasoning split (vLLM's rules and names).

The request side
----------------
* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (the
  output is JSON that ``schema`` accepts; ``strict`` is accepted and changes nothing: the schema
  is always enforced). Chat and completions alike.
* ``structured_outputs`` (vLLM's extra field): ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": ...}``, exactly one (:class:`m3_engine.structured_outputs.StructuredOutputsParams`).
  A request sets at most one of ``response_format`` (other than text) and ``structured_outputs``.
  A schema, regex or grammar that does not compile is a 400 with the compiler's message.
* ``tools`` (OpenAI function tools) are rendered by the chat template whatever ``tool_choice``
  is. ``tool_choice``:

  - left out: ``"auto"`` when there are tools (vLLM's default), else ``"none"``;
  - ``"none"``: the output is plain content (tool-call markup is not parsed);
  - ``"auto"``: the output is parsed for M3's tool-call markup (``--tool-call-parser
    minimax_m3``); it needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``, else 400;
  - ``"required"`` and ``{"type": "function", "function": {"name": ...}}`` are enforced with
    structured outputs, as vLLM enforces them. The constraint is JSON, not M3's markup: for
    ``"required"`` a JSON array (at least one element) of ``{"name": <a tool's name>,
    "parameters": <that tool's parameters>}`` (``parameters`` schema-checked per tool), for a
    named function that function's ``parameters`` object. The tool calls are then built from that
    JSON, not parsed from markup. (The model was trained to write markup, so these answers are
    well-formed but may be less apt than an ``"auto"`` answer.) Neither combines with
    ``response_format`` / ``structured_outputs``, and the constrained output has no reasoning span.

The response side (one :class:`ChoiceOutput` per choice)
--------------------------------------------------------
* ``message.tool_calls``: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
  (``arguments`` a JSON object's text); ``content`` is None when the output is only calls.
  ``finish_reason``: ``"tool_calls"`` when the engine stopped (``"stop"``) and the answer has
  calls (``"auto"``), or the engine stopped under ``"required"``; a named function keeps the
  engine's (vLLM's rule, as OpenAI's).
* streamed: ``delta.tool_calls`` (``{"index", "id", "type", "function": {"name", "arguments"}}``,
  then argument pieces ``{"index", "function": {"arguments"}}``), concatenating to the
  non-streamed answer. ``"auto"`` hands a call out when M3's parser has read all of it;
  ``"required"`` when its array element is complete; a named function streams its arguments
  text as it comes.
* ``--reasoning-parser minimax_m3``: the ``<mm:think>...</mm:think>`` span becomes
  ``message.reasoning_content`` / ``delta.reasoning_content`` (None / absent when empty); a
  prompt that ends with ``<mm:think>`` starts the answer inside the span.
* While a parser reads the text it is decoded with ``skip_special_tokens=False`` (M3's markup may
  be made of special tokens); the text of the stop token that ended the answer (eos or a
  ``stop_token_ids`` id) is not in it (``m3_engine.output_processor``, vLLM's rule).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Optional

from ..reasoning_parser import THINK_START, ChatOutputParser, MiniMaxM3ReasoningParser
from ..structured_outputs import StructuredOutputsParams
from ..tool_parser import MiniMaxM3ToolParser, merge_tool_call_deltas, tool_schemas
from .protocol import bad

__all__ = ["TOOL_CALL_PARSERS", "REASONING_PARSERS", "ChatFeatures", "ToolChoice", "tool_choice",
           "structured_outputs", "ChoiceOutput", "merge_deltas"]

TOOL_CALL_PARSERS = ("minimax_m3",)    # --tool-call-parser
REASONING_PARSERS = ("minimax_m3",)    # --reasoning-parser
_SO_KINDS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams))


@dataclasses.dataclass(frozen=True)
class ChatFeatures:
    """The server's flags for chat's parsers: ``--enable-auto-tool-choice``,
    ``--tool-call-parser``, ``--reasoning-parser``."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None

    def __post_init__(self):
        for name, known in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            value = getattr(self, name)
            if value is not None and value not in known:
                raise ValueError(f"{name}: expected one of {', '.join(known)}, got {value!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs a tool_call_parser")


# -- the request ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """A chat request's tools and what it asks of them: ``kind`` "none", "auto", "required" or
    "named" (``name``: the function)."""
    tools: Optional[list]
    kind: str
    name: Optional[str] = None

    @property
    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The structured outputs that enforce "required" / "named" (None for the others); the
        tools' ``$defs`` are moved to the schema's top level, where their ``$ref`` point (vLLM's rule)."""
        if self.kind not in ("required", "named"):
            return None
        defs: dict = {}
        schemas = {}
        for name, parameters in tool_schemas(self.tools).items():
            parameters = dict(parameters or {"type": "object", "properties": {}})
            for key, schema in parameters.pop("$defs", {}).items():
                if defs.setdefault(key, schema) != schema:
                    raise bad(f"tools: the definition {key!r} ($defs) has different schemas in different tools",
                              "tools")
            schemas[name] = parameters
        if self.kind == "named":
            schema = schemas[self.name]
        else:
            calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"]} for name, parameters in schemas.items()]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutputsParams(json={**schema, "$defs": defs} if defs else schema)


def tool_choice(tools, choice, features: ChatFeatures) -> ToolChoice:
    """A chat request's ``tools`` and ``tool_choice``, checked (vLLM's rules; a 400 otherwise)."""
    if tools is not None:
        try:
            tool_schemas(tools)
        except TypeError as e:
            raise bad(str(e), "tools") from None
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolChoice(tools, "none")
    if tools is None:
        raise bad("tool_choice: needs tools (when using `tool_choice`, `tools` must be set)", "tool_choice")
    if choice == "required" and not tools:   # OpenAI: no tool to require is no tool call
        return ToolChoice(None, "none")
    if choice == "auto":
        if not features.enable_auto_tool_choice:
            raise bad('tool_choice: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                      'to be set', "tool_choice")
        return ToolChoice(tools, "auto")
    if choice == "required":
        return ToolChoice(tools, "required")
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise bad(f'tool_choice: expected "none", "auto", "required" or {{"type": "function", "function": '
                  f'{{"name": ...}}}}, got {choice!r:.80}', "tool_choice")
    if function["name"] not in tool_schemas(tools):
        raise bad(f"tool_choice: the function {function['name']!r} is not one of the tools "
                  f"({', '.join(tool_schemas(tools))})", "tool_choice")
    return ToolChoice(tools, "named", function["name"])


def structured_outputs(response_format: Optional[dict], fields: Optional[dict],
                       tools: Optional[ToolChoice] = None) -> Optional[StructuredOutputsParams]:
    """The request's constraint: from ``response_format``, vLLM's ``structured_outputs`` or a
    required / named ``tool_choice`` (at most one of them; a 400 otherwise)."""
    given = []
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            given.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise bad('response_format: "json_schema" needs {"json_schema": {"name": ..., "schema": '
                          '{...}}}', "response_format")
            given.append(("response_format", StructuredOutputsParams(json=spec["schema"])))
        elif kind != "text":
            raise bad(f'response_format.type: expected "text", "json_object" or "json_schema", got {kind!r}',
                      "response_format")
    if fields is not None:
        unknown = sorted(set(fields) - set(_SO_KINDS))
        if unknown:
            raise bad(f"structured_outputs: unknown field {unknown[0]!r} (expected one of {', '.join(_SO_KINDS)})",
                      "structured_outputs")
        try:
            given.append(("structured_outputs", StructuredOutputsParams(**fields)))
        except (ValueError, TypeError) as e:
            raise bad(str(e), "structured_outputs") from None
    constraint = tools.constraint if tools is not None else None
    if constraint is not None:
        given.append(("tool_choice", constraint))
    if len(given) > 1:
        raise bad(f"{given[1][0]}: cannot be combined with {given[0][0]} (a request has one output constraint)",
                  given[1][0])
    return given[0][1] if given else None


# -- the response -----------------------------------------------------------------------------------

class ChoiceOutput:
    """One chat choice's answer out of its generated text: content, ``reasoning_content``,
    ``tool_calls``, ``finish_reason``. Whole (:meth:`message`) or streamed (:meth:`feed` each
    text delta, then :meth:`finish`); a fresh one per choice.
    """

    def __init__(self, tools: ToolChoice, features: ChatFeatures, prompt: str):
        self.kind = tools.kind
        self.reports_reasoning = features.reasoning_parser is not None
        self.parser = None
        if self.parses_text(tools, features):
            reasoning = None
            if features.reasoning_parser is not None:
                reasoning = MiniMaxM3ReasoningParser(starts_in_thinking=prompt.endswith(THINK_START))
            self.parser = ChatOutputParser(reasoning, MiniMaxM3ToolParser(tools.tools) if self.kind == "auto"
                                           else None)
        self.array = _ToolCallArray() if self.kind == "required" else None
        self.name = tools.name
        self.num_calls = 0
        self.seen = ""   # the text so far (required: content when no call came out of it)

    @staticmethod
    def parses_text(tools: ToolChoice, features: ChatFeatures) -> bool:
        """Whether a parser reads the choices' text: M3's tool-call markup ("auto") or its thinking
        span (``--reasoning-parser``; not under "required" / named, whose output is JSON)."""
        return tools.kind == "auto" or (features.reasoning_parser is not None
                                        and tools.kind not in ("required", "named"))

    def message(self, text: str, finish_reason: Optional[str]) -> tuple:
        """The whole text -> ``(message dict, finish_reason)``."""
        first, last = self.feed(text), self.finish(finish_reason)
        delta = merge_deltas(first, last[0])
        calls = merge_tool_call_deltas(delta.get("tool_calls", []))
        message = {"role": "assistant", "content": delta.get("content") or (None if calls else "")}
        if self.reports_reasoning:
            message["reasoning_content"] = delta.get("reasoning_content") or None
        if calls:
            message["tool_calls"] = calls
        return message, last[1]

    def feed(self, text: str) -> dict:
        """A text delta -> the chunk's delta: ``content`` / ``reasoning_content`` / ``tool_calls``
        (keys only when not empty)."""
        self.seen += text
        if self.kind == "named":
            if not text and self.num_calls:
                return {}
            head = [] if self.num_calls else [_call_start(0, self.name)]
            self.num_calls = 1
            return {"tool_calls": head + ([{"index": 0, "function": {"arguments": text}}] if text else [])}
        if self.array is not None:
            return self._calls_delta(self.array.feed(text))
        if self.parser is None:
            return {"content": text} if text else {}
        step = self.parser.feed(text)
        return self._delta(step.reasoning, step.content, step.tool_calls)

    def finish(self, finish_reason: Optional[str]) -> tuple:
        """The end of the text -> ``(the last delta, finish_reason)``."""
        delta = {}
        if self.kind == "named":
            delta = self.feed("") if not self.num_calls else {}
        elif self.array is not None and not self.num_calls and self.seen:   # no complete call: the text stays
            delta = {"content": self.seen}
        elif self.parser is not None:
            step = self.parser.finish()
            delta = self._delta(step.reasoning, step.content, step.tool_calls)
        if finish_reason == "stop" and ((self.kind == "auto" and self.num_calls) or self.kind == "required"):
            finish_reason = "tool_calls"
        return delta, finish_reason

    def _delta(self, reasoning: str, content: str, tool_calls: list) -> dict:
        delta = self._calls_delta(tool_calls)
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return delta

    def _calls_delta(self, tool_calls: list) -> dict:
        if not tool_calls:
            return {}
        self.num_calls = max(self.num_calls, 1 + max(d["index"] for d in tool_calls))
        return {"tool_calls": tool_calls}


def _call_start(index: int, name: str) -> dict:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": ""}}


def merge_deltas(a: dict, b: dict) -> dict:
    """Two chunk deltas as one (text fields joined, tool-call deltas in order)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = out[key] + value if key in out else value
    return out


class _ToolCallArray:
    """``tool_choice="required"``'s output, a JSON array of ``{"name", "parameters"}``, read as it
    streams: each element becomes a tool call once it is complete JSON."""

    def __init__(self):
        self.text = ""
        self.at: Optional[int] = None   # where the next element may start (after "[")
        self.count = 0
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> list:
        """More text -> the tool-call deltas of the elements it completes."""
        self.text += text
        out = []
        if self.at is None:
            start = self.text.lstrip()
            if not start.startswith("["):
                return out
            self.at = len(self.text) - len(start) + 1
        while True:
            at = self.at
            while at < len(self.text) and self.text[at] in " \t\r\n,":
                at += 1
            if at == len(self.text) or self.text[at] == "]":
                return out
            try:
                element, end = self.decoder.raw_decode(self.text, at)
            except ValueError:   # not complete yet
                return out
            self.at = end
            if isinstance(element, dict) and isinstance(element.get("name"), str):
                out.append(_call_start(self.count, element["name"]))
                out.append({"index": self.count, "function": {
                    "arguments": json.dumps(element.get("parameters", {}), ensure_ascii=False)}})
                self.count += 1
