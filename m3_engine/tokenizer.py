"""Text in and out: the model folder's tokenizer, chat template and incremental detokenizer.

Files read from the model folder (as transformers writes them):

* ``tokenizer.json``: the tokenizer itself (the ``tokenizers`` package). Its
  post-processor adds the BOS token where the model wants one; a
  ``tokenizer_config.json`` with ``"add_bos_token": true`` whose post-processor
  does not add it gets it prepended here (transformers' rule).
* ``tokenizer_config.json``: ``chat_template`` (a string, or a list of
  ``{"name", "template"}`` where ``"default"`` is used), ``bos_token``,
  ``eos_token`` (strings or ``{"content": ...}``), ``add_bos_token``.
* ``chat_template.jinja``: the chat template, when it is kept in its own file
  (it wins over ``tokenizer_config.json``'s, as in transformers).

Chat templates render with jinja2's sandboxed environment, as transformers
renders them (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``,
``tojson``), with ``messages`` (assistant ``tool_calls`` with dict
``arguments``, ``"tool"`` messages), ``add_generation_prompt``, ``tools``,
``bos_token`` and ``eos_token``; the rendered text is encoded WITHOUT adding
special tokens (the template writes them).
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Optional, Sequence

from .model_config import read_json

__all__ = ["Tokenizer", "IncrementalDetokenizer", "load_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def load_tokenizer(model_dir) -> Optional["Tokenizer"]:
    """The model folder's tokenizer, or None when it has no ``tokenizer.json`` (token ids only)."""
    return Tokenizer(model_dir) if (Path(model_dir) / TOKENIZER_FILE).is_file() else None


class Tokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``) of a model folder."""

    def __init__(self, model_dir):
        from tokenizers import Tokenizer as _Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:   # the tokenizers package raises a plain Exception for bad files
            raise ValueError(f"{path}: not a readable tokenizer ({e})") from None
        config_path = model_dir / "tokenizer_config.json"
        config = read_json(config_path) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.chat_template = _chat_template(model_dir, config)
        self.vocab_size = self._tok.get_vocab_size()
        # byte-fallback tokens ("<0xE2>"): a run of them decodes only once complete (see IncrementalDetokenizer)
        self.byte_token_ids = frozenset(i for t, i in self._tok.get_vocab(with_added_tokens=False).items()
                                        if _BYTE_TOKEN.fullmatch(t))

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` underneath (its vocabulary and decoder: what structured
        outputs build their token masks from)."""
        return self._tok

    # -- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and \
                (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text (its bytes decoded on their own, as logprobs show it)."""
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    # -- chat ------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[dict], *, chat_template: Optional[str] = None,
                            add_generation_prompt: bool = True, tools=None) -> str:
        """The conversation rendered as the prompt text the model was trained on.

        ``tools``: OpenAI tools (``[{"type": "function", "function": {...}}]``) for the template to
        list. Assistant ``tool_calls`` reach the template with their ``arguments`` as dicts (an
        OpenAI JSON string is parsed), as transformers' templates expect them.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("chat: the model folder has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja); pass chat_template=...")
        check_messages(messages)
        if tools is not None and (not isinstance(tools, (list, tuple)) or
                                  not all(isinstance(t, dict) for t in tools)):
            raise TypeError(f"tools: expected a list of {{'type': 'function', 'function': {{...}}}} dicts, "
                            f"got {tools!r:.80}")
        messages = [_with_argument_dicts(m) for m in messages]
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=list(tools) if tools is not None else None,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def check_messages(messages) -> None:
    """A conversation: a non-empty list of ``{"role": str, "content": str | None, ...}``; an
    assistant message may carry ``tool_calls`` (``[{"id", "type": "function", "function":
    {"name": str, "arguments": dict | JSON object text}}]``) and ``reasoning_content`` (str);
    a ``"tool"`` message carries a tool's result as its content."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"messages: expected a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TypeError(f"messages[{i}]: expected a dict with a string 'role', got {m!r}")
        if not isinstance(m.get("content"), (str, type(None), list)):
            raise TypeError(f"messages[{i}]['content']: expected a string, got {type(m.get('content')).__name__}")
        if not isinstance(m.get("reasoning_content"), (str, type(None))):
            raise TypeError(f"messages[{i}]['reasoning_content']: expected a string, "
                            f"got {type(m['reasoning_content']).__name__}")
        if m.get("tool_calls") is not None:
            _check_tool_calls(m, f"messages[{i}]")


def _check_tool_calls(message: dict, where: str) -> None:
    calls = message["tool_calls"]
    if message["role"] != "assistant":
        raise ValueError(f"{where}: only an assistant message has tool_calls, got role {message['role']!r}")
    if not isinstance(calls, (list, tuple)):
        raise TypeError(f"{where}['tool_calls']: expected a list, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TypeError(f"{where}['tool_calls'][{j}]: expected {{'type': 'function', 'function': "
                            f"{{'name': str, 'arguments': ...}}}}, got {call!r:.80}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise ValueError(f"{where}['tool_calls'][{j}]['function']['arguments']: not valid JSON ({e})") from None
        if not isinstance(arguments, dict):
            raise TypeError(f"{where}['tool_calls'][{j}]['function']['arguments']: expected a JSON object "
                            f"(a dict or its JSON text), got {function.get('arguments')!r:.80}")


def _with_argument_dicts(message: dict) -> dict:
    """The message with its tool calls' JSON-text arguments parsed (a copy; the caller's is left as is)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = call["function"].get("arguments")
        if isinstance(arguments, str):
            call = {**call, "function": {**call["function"], "arguments": json.loads(arguments)}}
        calls.append(call)
    return {**message, "tool_calls": calls}


class IncrementalDetokenizer:
    """The text of a growing list of token ids, handed out in pieces that concatenate to the
    full decode.

    Each new token decodes a short window of the latest ids twice (with and without
    the new ones) and hands out the difference, so a token whose bytes complete a
    multi-byte character only later (byte-level BPE) is held back until the
    character is complete: no U+FFFD is handed out that the full decode does not
    have. A run of byte-fallback tokens (``<0xNN>``) is held back until a normal
    token ends it (an invalid run decodes to U+FFFD as a whole). :meth:`finish`
    compares with the full decode and hands out the rest.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list = []
        self.text = ""
        self._prefix = 0   # ids[_prefix:_read]: handed out already, decoded again as context
        self._read = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ids; -> the text they complete (may be empty)."""
        self.ids.extend(int(t) for t in token_ids)
        if self.ids and self.ids[-1] in self.tokenizer.byte_token_ids:
            return ""   # a byte-fallback run may still turn out invalid: its decode would rewrite its start
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""   # nothing new, or a character still incomplete
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """-> the text the full decode has beyond what was handed out (usually "")."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if not full.startswith(self.text):   # a decoder that rewrites earlier text: trust the full decode
            self.text = full
            return ""
        delta = full[len(self.text):]
        self.text = full
        return delta


# -- helpers -----------------------------------------------------------------------------------

def _token_text(token) -> Optional[str]:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(model_dir: Path, config: dict) -> Optional[str]:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):   # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


_compiled: dict = {}


def _compile(template: str):
    if template not in _compiled:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson
        try:
            _compiled[template] = env.from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat_template: not a valid jinja2 template (line {e.lineno}: {e.message})") from None
    return _compiled[template]
