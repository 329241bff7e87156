"""Text in and out without a framework: ``m3_engine.tokenizer`` (incremental detokenizer, chat
templates, BOS) and the ``generation_config.json`` defaults (``m3_engine.llm.generation_defaults``
+ ``SamplingParams.with_defaults``). Chat templates are compared with transformers' own rendering.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from m3_engine import SamplingParams
from m3_engine.llm import generation_defaults
from m3_engine.tiny_model import BOS_ID, CHAT_TEMPLATE, EOS_ID, write_tiny_checkpoint
from m3_engine.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

TEXTS = ["plain ascii, the quick brown fox",
         "café naïve résumé Zürich",
         "你好，世界 東京タワー",
         "emoji 🙂 and 👩‍👩‍👧 family, flag 🇫🇷",
         "mixed: é你🙂a\u0301 — «quotes» ½ ∑",
         " leading space and  double  spaces\nnew line\ttab",
         "🙂🙂🙂"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return Tokenizer(tiny_dir)


def _tokenizer_only(tiny_dir, dst, **config_changes):
    """A folder with the tiny model's tokenizer files (tokenizer_config.json updated)."""
    dst.mkdir()
    shutil.copy(tiny_dir / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def byte_fallback_dir(tmp_path_factory):
    """A SentencePiece-like BPE (Llama's layout): "▁" for spaces, byte-fallback tokens <0xNN> for
    characters outside the vocabulary, a decoder that strips the leading space."""
    from tokenizers import Tokenizer as _Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzTHEé,:":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("q", "u")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = _Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    path = tmp_path_factory.mktemp("byte_fallback")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "add_bos_token": True}))
    return path


def _stream(tokenizer, ids, skip_special_tokens=True) -> tuple:
    """Feed ``ids`` one by one -> (deltas, finish())."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add([t]) for t in ids]
    return deltas, detok.finish()


def _assert_exact(tokenizer, ids, skip_special_tokens=True) -> int:
    """The deltas + finish() concatenate to the full decode, every partial concatenation is a prefix of
    it (so a U+FFFD is handed out only where the full decode has one); -> characters checked."""
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    deltas, rest = _stream(tokenizer, ids, skip_special_tokens)
    text = ""
    for i, delta in enumerate(deltas):
        assert full.startswith(text + delta), (f"after token {i} of {ids}: {text + delta!r} is not a prefix of "
                                               f"{full!r}")
        if "\ufffd" in delta:
            at = len(text) + delta.index("\ufffd")
            assert full[at] == "\ufffd"
        text += delta
    assert text + rest == full, (ids, deltas, rest, full)
    return len(full)


# -- the incremental detokenizer ---------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_multibyte_byte_level(tiny, text):
    ids = tiny.encode(text, add_special_tokens=False)
    assert tiny.decode(ids) == text
    assert len(ids) > 0 and _assert_exact(tiny, ids) == len(text)
    if any(ord(c) > 127 for c in text):   # some token leaves a character incomplete: held back, not U+FFFD
        deltas, _ = _stream(tiny, ids)
        assert "" in deltas
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_multibyte_byte_fallback(byte_fallback_dir, text):
    tok = Tokenizer(byte_fallback_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert _assert_exact(tok, ids) == len(text)
    deltas, _ = _stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_leading_space_is_kept(byte_fallback_dir):
    """A decoder that strips the first space of a decode (Strip): the text of later tokens keeps theirs."""
    tok = Tokenizer(byte_fallback_dir)
    ids = tok.encode("the the a", add_special_tokens=False)
    deltas, rest = _stream(tok, ids)
    assert "".join(deltas) + rest == tok.decode(ids) == "the the a"


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_detokenizer_random_ids_byte_level(tiny, skip):
    """Random ids (invalid UTF-8 more often than not, special tokens among them)."""
    rng = random.Random(1234)
    checked = 0
    for _ in range(300):
        ids = [rng.randrange(tiny.vocab_size) if rng.random() < 0.1 else rng.randrange(3, 300)
               for _ in range(rng.randrange(1, 16))]
        checked += _assert_exact(tiny, ids, skip)
    assert checked > 1000


def test_detokenizer_random_byte_tokens_byte_fallback(byte_fallback_dir):
    """Random byte-fallback tokens between letters: a run of byte tokens that is not valid UTF-8 decodes
    to one U+FFFD per byte token, also for bytes of a run that looked valid so far (``<0x48>`` alone is
    "H", then "\ufffd" once an invalid byte follows it): nothing of a run may be handed out before the
    run ends."""
    tok = Tokenizer(byte_fallback_dir)
    rng = random.Random(99)
    letters = [tok._tok.token_to_id(c) for c in "abc"]
    checked = 0
    for _ in range(200):
        ids = [rng.choice(letters) if rng.random() < 0.3 else 3 + rng.randrange(256)
               for _ in range(rng.randrange(1, 10))]
        checked += _assert_exact(tok, ids)
    assert checked > 300


def test_detokenizer_special_tokens(tiny):
    ids = tiny.encode("the fox", add_special_tokens=False)
    seq = [BOS_ID] + ids + [EOS_ID] + ids
    assert _assert_exact(tiny, seq, True) == len("the foxthe fox")
    assert _assert_exact(tiny, seq, False) == len("<s>the fox</s>the fox")
    deltas, rest = _stream(tiny, [EOS_ID])
    assert deltas == [""] and rest == ""


def test_detokenizer_add_several_ids(tiny):
    ids = tiny.encode("你好 🙂 ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny)
    pieces = [detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(pieces) + detok.finish() == "你好 🙂 ok"
    assert detok.text == "你好 🙂 ok"


# -- BOS ---------------------------------------------------------------------------------------------

def test_bos_from_post_processor(tiny):
    ids = tiny.encode("the fox")
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert tiny.encode("the fox", add_special_tokens=False) == ids[1:]
    assert tiny.bos_token_id == BOS_ID and tiny.bos_token == "<s>" and tiny.eos_token == "</s>"


@pytest.mark.parametrize("add_bos_token", [True, False, None])
def test_add_bos_token_rule(tiny_dir, tmp_path, add_bos_token):
    """``"add_bos_token": true`` in tokenizer_config.json and a post-processor that does not add BOS:
    BOS is prepended (once); false / absent: the post-processor alone decides."""
    from tokenizers import Tokenizer as _Tokenizer, processors

    folder = _tokenizer_only(tiny_dir, tmp_path / "tok", add_bos_token=add_bos_token)
    plain = _Tokenizer.from_file(str(folder / "tokenizer.json"))
    plain.post_processor = processors.ByteLevel(trim_offsets=False)
    plain.save(str(folder / "tokenizer.json"))
    tok = Tokenizer(folder)
    body = tok.encode("the fox", add_special_tokens=False)
    assert body and body[0] != BOS_ID
    assert tok.encode("the fox") == ([BOS_ID] + body if add_bos_token else body)
    # with the BOS post-processor too: never two BOS
    both = _tokenizer_only(tiny_dir, tmp_path / "both", add_bos_token=add_bos_token)
    assert Tokenizer(both).encode("the fox") == [BOS_ID] + body


def test_load_tokenizer_without_tokenizer_json(tmp_path):
    assert load_tokenizer(tmp_path) is None


def test_unreadable_tokenizer_json(tiny_dir, tmp_path):
    folder = _tokenizer_only(tiny_dir, tmp_path / "tok")
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer(folder)


# -- chat templates ----------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! 🙂"}, {"role": "user", "content": "你好?"}],
]


def _hf(folder):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(folder)


def _hf_ids(hf, messages, **kw):
    ids = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(tiny_dir, tiny, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    hf = _hf(tiny_dir)
    text = tiny.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text.endswith("assistant:") == add_generation_prompt
    assert tiny.encode(text, add_special_tokens=False) == _hf_ids(hf, messages,
                                                                  add_generation_prompt=add_generation_prompt)


def test_chat_template_unknown_role_raises(tiny_dir, tiny):
    messages = [{"role": "robot", "content": "beep"}]
    with pytest.raises(Exception, match="unknown role: robot"):
        _hf(tiny_dir).apply_chat_template(messages, tokenize=False)
    with pytest.raises(Exception, match="unknown role: robot"):
        tiny.apply_chat_template(messages)


def test_chat_template_argument_wins(tiny):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    assert tiny.apply_chat_template(CONVERSATIONS[0], chat_template=template) == "<user>Hi"
    assert tiny.chat_template == CHAT_TEMPLATE


def test_chat_template_jinja_file_wins(tiny_dir, tmp_path):
    folder = _tokenizer_only(tiny_dir, tmp_path / "tok")
    template = "{% for m in messages %}{{ m['role'] | upper }}={{ m['content'] }};{% endfor %}"
    (folder / "chat_template.jinja").write_text(template)
    tok = Tokenizer(folder)
    assert tok.chat_template == template
    messages = CONVERSATIONS[1]
    assert tok.apply_chat_template(messages) == _hf(folder).apply_chat_template(messages, tokenize=False,
                                                                                add_generation_prompt=True)
    assert tok.apply_chat_template(messages).startswith("SYSTEM=Be brief.;")


def test_named_chat_templates_use_default(tiny_dir, tmp_path):
    folder = _tokenizer_only(tiny_dir, tmp_path / "tok", chat_template=[
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ messages[0]['content'] }}!"}])
    tok = Tokenizer(folder)
    assert tok.apply_chat_template(CONVERSATIONS[0]) == "Hi!"
    assert tok.apply_chat_template(CONVERSATIONS[0]) == _hf(folder).apply_chat_template(CONVERSATIONS[0],
                                                                                        tokenize=False)


def test_no_chat_template(tiny_dir, tmp_path):
    folder = _tokenizer_only(tiny_dir, tmp_path / "tok", chat_template=None)
    tok = Tokenizer(folder)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])
    assert tok.apply_chat_template(CONVERSATIONS[0], chat_template="{{ messages | length }}") == "1"


@pytest.mark.parametrize("template", [
    # transformers' environment: loop controls, strftime_now, tojson's keyword arguments
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}{{ m['content'] }}|{% endfor %}",
    "{{ strftime_now('%Y') }}:{{ messages[0]['content'] }}",
    "{{ messages | tojson(indent=2, sort_keys=True) }}",
    "{{ messages[0] | tojson(separators=(',', ':')) }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "{{ messages[-1]['content'] | trim }}{{ eos_token }}{{ bos_token }}",
], ids=["break", "continue", "strftime_now", "tojson-sort_keys", "tojson-separators", "namespace", "tokens"])
def test_chat_template_features_match_transformers(tiny_dir, tiny, template):
    messages = CONVERSATIONS[1]
    expected = _hf(tiny_dir).apply_chat_template(messages, chat_template=template, tokenize=False)
    assert tiny.apply_chat_template(messages, chat_template=template, add_generation_prompt=False) == expected


def test_bad_messages(tiny):
    for bad in ([], [{"content": "no role"}], ["text"], [{"role": "user", "content": 3}]):
        with pytest.raises(TypeError):
            tiny.apply_chat_template(bad)
    with pytest.raises(ValueError, match="chat_template"):
        tiny.apply_chat_template(CONVERSATIONS[0], chat_template="{% for %}")


# -- generation_config.json defaults ----------------------------------------------------------------

def _with_generation_config(tiny_dir, tmp_path, config):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_generation_defaults_tiny(tiny_dir):
    assert generation_defaults(tiny_dir) == {}   # bos / eos / pad ids only


def test_generation_defaults_applied_to_fields_left_at_defaults(tiny_dir, tmp_path):
    folder = _with_generation_config(tiny_dir, tmp_path, {
        "bos_token_id": 1, "eos_token_id": [2], "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 64, "do_sample": True})
    defaults = generation_defaults(folder)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                        "max_tokens": 64}
    p = SamplingParams().with_defaults(defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (0.6, 0.95, 20, 0.05, 1.1, 64)
    # fields the request sets keep its values
    q = SamplingParams(temperature=0.2, top_k=5, max_tokens=3, seed=4).with_defaults(defaults)
    assert (q.temperature, q.top_p, q.top_k, q.max_tokens, q.seed) == (0.2, 0.95, 5, 3, 4)
    # the request itself is not changed
    r = SamplingParams()
    r.with_defaults(defaults)
    assert r.temperature == 1.0 and r.max_tokens == 16


def test_generation_defaults_do_sample_false_is_greedy(tiny_dir, tmp_path):
    folder = _with_generation_config(tiny_dir, tmp_path, {"temperature": 0.7, "top_p": 0.8, "do_sample": False})
    defaults = generation_defaults(folder)
    assert defaults["temperature"] == 0.0
    assert SamplingParams().with_defaults(defaults).greedy
    assert SamplingParams(temperature=0.5).with_defaults(defaults).temperature == 0.5


def test_generation_defaults_absent_or_null(tiny_dir, tmp_path):
    assert generation_defaults(tmp_path) == {}
    folder = _with_generation_config(tiny_dir, tmp_path, {"temperature": None, "top_k": None, "do_sample": None})
    assert generation_defaults(folder) == {}
    assert SamplingParams().with_defaults({}) == SamplingParams()


def test_generation_defaults_bad_values(tiny_dir, tmp_path):
    folder = _with_generation_config(tiny_dir, tmp_path, {"top_p": 0})
    with pytest.raises(ValueError, match="top_p"):
        generation_defaults(folder)
    (folder / "generation_config.json").write_text('{"top_p": 0.5,\n "top_k": }')
    with pytest.raises(ValueError, match="generation_config.json.*line 2"):
        generation_defaults(folder)


# -- tools in the chat template (MiniMax-M3's format) ------------------------------------------------

WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "detailed": {"type": "boolean"},
        "units": {"type": "object", "properties": {"temp": {"type": "string"},
                                                   "wind": {"type": "array", "items": {"type": "string"}}}}},
        "required": ["city"]}}}]
PARIS = {"city": "Paris", "days": 2, "detailed": True, "units": {"temp": "C", "wind": ["kmh", "knots"]}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities: two calls.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain, 9"},
    {"role": "assistant", "content": "Paris: sunny. Oslo: rain."},
    {"role": "user", "content": "Thanks"},
]


def _json_arguments(messages):
    """The conversation with OpenAI's JSON-text tool-call arguments."""
    def as_text(call):
        return {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}
    return [{**m, "tool_calls": [as_text(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("start", [0, 1], ids=["system", "no_system"])
def test_chat_template_tools_match_transformers(tiny_dir, tiny, start, add_generation_prompt):
    messages = TOOL_CONVERSATION[start:]
    hf = _hf(tiny_dir)
    expected = hf.apply_chat_template(messages, tools=WEATHER_TOOLS, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    text = tiny.apply_chat_template(messages, tools=WEATHER_TOOLS, add_generation_prompt=add_generation_prompt)
    assert text == expected
    # OpenAI's JSON-text arguments render as the dicts do; the caller's messages are left as they are
    as_json = _json_arguments(messages)
    assert tiny.apply_chat_template(as_json, tools=WEATHER_TOOLS, add_generation_prompt=add_generation_prompt) == text
    assert isinstance(as_json[2 - start]["tool_calls"][0]["function"]["arguments"], str)
    assert tiny.encode(text, add_special_tokens=False) == _hf_ids(hf, messages, tools=WEATHER_TOOLS,
                                                                  add_generation_prompt=add_generation_prompt)


def test_chat_template_tools_in_m3_format(tiny):
    from m3_engine.tool_parser import NS

    text = tiny.apply_chat_template(TOOL_CONVERSATION, tools=WEATHER_TOOLS)
    tool = json.dumps(WEATHER_TOOLS[0]["function"], ensure_ascii=False)
    assert text.startswith("<s>system: Be brief.\n\n# Tools\nYou may call one or more tools to assist with the user "
                           f"query.\nHere are the tools available in JSONSchema format:\n\n<tools>\n<tool>{tool}</tool>"
                           f"\n</tools>\n\nTo call tools, wrap all invocations in a single {NS}<tool_call>{NS}"
                           "</tool_call> block.")
    assert (f"assistant:<mm:think>Two cities: two calls.</mm:think>Checking.{NS}<tool_call>\n"
            f'{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>2{NS}</days>'
            f"{NS}<detailed>true{NS}</detailed>{NS}<units>{NS}<temp>C{NS}</temp>{NS}<wind>{NS}<item>kmh{NS}</item>"
            f"{NS}<item>knots{NS}</item>{NS}</wind>{NS}</units>{NS}</invoke>\n"
            f'{NS}<invoke name="get_weather">{NS}<city>Oslo{NS}</city>{NS}</invoke>\n{NS}</tool_call></s>\n'
            "tool:\n<response>sunny, 21</response>\n<response>rain, 9</response></s>\n"
            "assistant:</mm:think>Paris: sunny. Oslo: rain.</s>\nuser: Thanks</s>\nassistant:") in text
    no_system = tiny.apply_chat_template(TOOL_CONVERSATION[1:], tools=WEATHER_TOOLS)
    assert no_system.startswith("<s>system: You are a helpful assistant.\n\n# Tools\n")
    assert "# Tools" not in tiny.apply_chat_template(TOOL_CONVERSATION)


@pytest.mark.parametrize("thinking_mode, end", [(None, "assistant:"), ("adaptive", "assistant:"),
                                                ("enabled", "assistant:<mm:think>"),
                                                ("disabled", "assistant:</mm:think>")])
def test_chat_template_thinking_mode(tiny_dir, thinking_mode, end):
    kwargs = {} if thinking_mode is None else {"thinking_mode": thinking_mode}
    text = _hf(tiny_dir).apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True, **kwargs)
    assert text.endswith(end)


def test_rendered_tool_calls_parse_back(tiny):
    """An assistant turn as the template writes it, read by the reasoning and tool parsers (as if the
    model had generated it after the prompt's "assistant:"), gives back the message."""
    from m3_engine.reasoning_parser import ChatOutputParser, MiniMaxM3ReasoningParser
    from m3_engine.tool_parser import MiniMaxM3ToolParser

    prompt = tiny.apply_chat_template(TOOL_CONVERSATION[:2], tools=WEATHER_TOOLS)
    full = tiny.apply_chat_template(TOOL_CONVERSATION[:3], tools=WEATHER_TOOLS, add_generation_prompt=False)
    assert full.startswith(prompt) and full.endswith("</s>\n")
    generated = full[len(prompt):-len("</s>\n")]
    parser = ChatOutputParser(MiniMaxM3ReasoningParser(), MiniMaxM3ToolParser(WEATHER_TOOLS))
    reasoning, content, calls = parser.parse(generated)
    message = TOOL_CONVERSATION[2]
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_bad_tool_messages(tiny):
    from m3_engine.tokenizer import check_messages

    check_messages(TOOL_CONVERSATION)
    check_messages(_json_arguments(TOOL_CONVERSATION))
    user = {"role": "user", "content": "hi"}

    def with_calls(calls, role="assistant"):
        return [user, {"role": role, "content": None, "tool_calls": calls}]

    good = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for bad, error, match in [
        (with_calls({"name": "f"}), TypeError, r"messages\[1\]\['tool_calls'\]: expected a list"),
        (with_calls([{"function": {"arguments": "{}"}}]), TypeError, r"\['tool_calls'\]\[0\]"),
        (with_calls([good, {"function": {"name": "f", "arguments": "{not json"}}]), ValueError,
         r"\['tool_calls'\]\[1\]\['function'\]\['arguments'\]: not valid JSON"),
        (with_calls([{"function": {"name": "f", "arguments": "[1]"}}]), TypeError, "expected a JSON object"),
        (with_calls([{"function": {"name": "f"}}]), TypeError, "expected a JSON object"),
        (with_calls([good], role="user"), ValueError, "only an assistant message has tool_calls"),
        ([{"role": "assistant", "content": "x", "reasoning_content": 3}], TypeError, "reasoning_content"),
    ]:
        with pytest.raises(error, match=match):
            tiny.apply_chat_template(bad)
    with pytest.raises(TypeError, match="tools"):
        tiny.apply_chat_template([user], tools={"name": "f"})
