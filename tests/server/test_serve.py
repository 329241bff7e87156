"""m3-serve (m3_engine.server): the official ``openai`` client against a server subprocess, both frameworks.

One server per framework for the module (``running_server``: ``python -m m3_engine.server`` on a
free port of 127.0.0.1, the tiny model, max_model_len 256, max_num_seqs 8), reused by every test; after
each test the server must be idle (no request running or waiting, no KV page reserved, no HTTP
request open: ``/metrics``), and at the end SIGTERM must stop it with exit status 0 while a stream
is still open. Model steps are slow in Triton's interpreter (about 0.7 s of CPU per row of a
step, plus a fixed cost per step), so the basic requests (completions and chat, streamed and not,
seeded and greedy, logprobs, echo, prompt logprobs, stop strings and stop tokens) go to the server all at once in
``batch`` (one continuous batch) and the tests check their answers; ``reference`` is
``LLM.generate`` of the same framework in this process with the same parameters (computed while the
server starts; every selected framework's server starts at once, see ``Launch``): seeded and
greedy sampling through the server give the same tokens. ``fake_server`` runs the app in this
process (its engine process with a fake model runner, ``engine_helpers.FakeLLM``: no framework,
instantaneous steps) for what the real model cannot be made to do on demand (a step that fails, a
burst of 64 clients, the prefix cache) in a second; ``agent_server`` is the same with chat's
tool-call and reasoning parsers, for the agent tests (a prompt holding ``say(text)`` makes the fake
answer ``text``; under structured outputs the fake walks the grammar's token bitmask).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from benchmarks.serve import parse_metrics                              # noqa: E402
from engine_helpers import FAIL_SEED, FakeLLM, fake_prompt_logprob, say  # noqa: E402
from m3_engine import SamplingParams, engine_class                      # noqa: E402
from m3_engine.tiny_model import write_tiny_checkpoint                 # noqa: E402
from m3_engine.tokenizer import Tokenizer                               # noqa: E402

pytestmark = pytest.mark.xdist_group("serve")   # one worker for the module under --dist loadgroup

REPO = Path(__file__).resolve().parents[2]
KEY = "test-key"
MODEL = "tiny"
ALIAS = "tiny-alias"   # the fake server's second served name
MAX_CONTEXT = 256
MAX_QUEUE = 40
START_TIMEOUT = 600        # a loaded 2-core machine: imports, model, first steps
REQUEST_TIMEOUT = 600
IDLE_TIMEOUT = 180         # an abort waits for the step in flight (JAX, 8 rows: seconds)

PROMPTS = ["Hello world", "The quick brown fox"]
SEEDED = dict(temperature=0.8, top_p=0.95, top_k=50, seed=1234, frequency_penalty=0.3, max_tokens=4)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
CHAT_GREEDY = dict(temperature=0.0, max_tokens=3)
STOP_PROMPT, STOP_TOKENS = "Once upon a time", 6


# -- helpers --------------------------------------------------------------------------------------

def call(port, method, path, body=None, *, key=KEY, raw=None, timeout=REQUEST_TIMEOUT):
    """-> (status, parsed JSON body or text) of one request (``raw``: bytes sent as they are)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


def metrics(port) -> dict:
    """``/metrics`` -> ``{name or name{labels}: value}`` (the model_name label left out)."""
    status, text = call(port, "GET", "/metrics", key=None)
    assert status == 200, text
    return parse_metrics(text)


IDLE = ("m3_num_requests_running", "m3_num_requests_waiting", "m3_num_requests_unfinished",
        "m3_num_requests_in_flight", "m3_kv_cache_used_pages")


def wait_idle(port, timeout=IDLE_TIMEOUT) -> dict:
    """Wait until nothing runs, waits or holds KV pages (aborts are asynchronous); -> the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(port)
        if all(m[k] == 0 for k in IDLE):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the server is not idle after {timeout} s: {({k: m[k] for k in IDLE})}")
        time.sleep(0.1)


def wait_for(port, predicate, what, timeout=REQUEST_TIMEOUT) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(port)
        if predicate(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen in {timeout} s ({({k: m[k] for k in IDLE})})")
        time.sleep(0.05)


def listening_port(log: Path, proc, timeout) -> int:
    """The port of the 'listening on' line of a starting server's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log.read_text())
        if m:
            return int(m.group(1))
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    raise AssertionError(f"the server did not start in {timeout} s:\n{log.read_text()[-4000:]}")


class Server:
    """A ``python -m m3_engine.server`` subprocess (or, with ``port`` only, a server in this process)."""

    def __init__(self, framework=None, model_dir=None, log: Path = None, *extra, port=None):
        self.framework, self.log, self.port, self.proc = framework, log, port, None
        if port is not None:
            return
        cmd = [sys.executable, "-m", "m3_engine.server", str(model_dir), "--framework", framework,
               "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--max-num-seqs", "8",
               "--max-model-len", str(MAX_CONTEXT), "--api-key", KEY, "--served-model-name", MODEL,
               "--max-queue", str(MAX_QUEUE), "--shutdown-timeout", "1", "--no-access-log", *extra]
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log_file, stderr=subprocess.STDOUT)

    def wait_ready(self):
        self.port = listening_port(self.log, self.proc, START_TIMEOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                status, body = call(self.port, "GET", "/health", key=None, timeout=10)
                if status == 200:
                    return body
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server is not healthy ({self.proc.poll()}):\n{self.log.read_text()[-4000:]}")
            time.sleep(0.2)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=REQUEST_TIMEOUT, **kw)

    def async_client(self, **kw):
        return openai.AsyncOpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=REQUEST_TIMEOUT, **kw)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


async def collect(stream_call):
    """All chunks of a streamed call (awaited inside the client's event loop)."""
    return [chunk async for chunk in await stream_call]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_serve"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


# a real server costs minutes of model steps in the CPU interpreter: `make test` runs the in-process
# fake-runner tests below, `pytest -m long` the real servers of both frameworks
@pytest.fixture(scope="module", params=[pytest.param("torch", marks=pytest.mark.long),
                                        pytest.param("jax", marks=pytest.mark.long)])
def framework(request):
    return request.param


class Launch:
    """A server starting in the background: its reference answers (``LLM.generate`` in this process),
    then the server up and warmed up (JAX compiles its first step shapes). The module starts the
    server of every framework it will test at once, so that one starts while another is tested."""
    _reference_lock = threading.Lock()   # Triton's interpreter is not thread-safe: one engine at a time

    def __init__(self, framework, model_dir, tok, log: Path):
        self.server = Server(framework, model_dir, log)
        self.error = None
        self.thread = threading.Thread(target=self._prepare, args=(framework, model_dir, tok), daemon=True)
        self.thread.start()

    def _prepare(self, framework, model_dir, tok):
        try:
            with self._reference_lock:
                self.server.reference = generate_reference(framework, model_dir, tok)
            self.server.wait_ready()
            self.server.client().completions.create(model=MODEL, prompt="warm up", max_tokens=2, temperature=0,
                                                    extra_body={"ignore_eos": True})
            wait_idle(self.server.port)
        except BaseException as e:
            self.error = e

    def ready(self) -> Server:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.server


@pytest.fixture(scope="module")
def launches(request, model_dir, tok, tmp_path_factory):
    """Every framework's server that the selected tests need, started now, in the test order."""
    frameworks = []
    for item in request.session.items:
        fw = getattr(getattr(item, "callspec", None), "params", {}).get("framework")
        if fw and Path(str(item.fspath)) == Path(__file__) and fw not in frameworks:
            frameworks.append(fw)
    started = {fw: Launch(fw, model_dir, tok, tmp_path_factory.mktemp(f"serve_{fw}") / "server.log")
               for fw in frameworks}
    try:
        yield started
    finally:
        for launch in started.values():
            launch.thread.join(START_TIMEOUT)
            launch.server.kill()


@pytest.fixture(scope="module")
def running_server(framework, launches):
    """The module's server of ``framework``, warmed up; at the end SIGTERM stops it."""
    srv = launches[framework].ready()
    yield srv
    # SIGTERM with a stream open: the server lets it run for --shutdown-timeout (1 s), then ends
    # it with an error event, stops the engine process (which closes its LLM) and exits 0.
    stream = srv.client().completions.create(model=MODEL, prompt="long", max_tokens=200, stream=True,
                                             extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    srv.proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError, match="shutting down"):
        for chunk in chunks:
            assert chunk.choices[0].finish_reason is None
    assert srv.proc.wait(timeout=120) == 0, srv.log.read_text()[-4000:]
    assert "Traceback" not in srv.log.read_text(), srv.log.read_text()[-4000:]


@pytest.fixture
def server(running_server):
    """The module's server; idle again (pool empty, nothing running) after the test."""
    yield running_server
    wait_idle(running_server.port)


@pytest.fixture(scope="module")
def reference(running_server):
    return running_server.reference


def generate_reference(framework, model_dir, tok) -> dict:
    """``LLM.generate`` of the same framework in this process: the seeded prompts, the chat prompt
    as ``LLM.chat`` makes it (template, then ids without special tokens) and the stop tests' prompt,
    greedy (with its prompt's top-2 logprobs); with the stop string and stop token chosen from that
    greedy answer."""
    llm = engine_class(framework)(model_dir, max_num_seqs=8, max_model_len=MAX_CONTEXT, device="cpu")
    text = tok.apply_chat_template(MESSAGES)
    chat_prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
    try:
        *seeded, chat, greedy = llm.generate(
            PROMPTS + [chat_prompt, STOP_PROMPT],
            [SamplingParams(**SEEDED)] * 2 + [SamplingParams(**CHAT_GREEDY),
                                              SamplingParams(temperature=0, max_tokens=STOP_TOKENS, ignore_eos=True,
                                                             prompt_logprobs=2)],
            use_tqdm=False)
    finally:
        llm.close()
    text, ids = greedy.outputs[0].text, greedy.outputs[0].token_ids
    # a stop string from the middle of the greedy text (the text must end just before it) and a
    # stop token id (the first id that does not occur earlier in the greedy output)
    starts = [k for k in range(1, len(text) - 1) if text.find(text[k:k + 2]) == k and "\ufffd" not in text[k:k + 2]]
    assert starts, f"no usable stop string in {text!r}"
    k = starts[len(starts) // 2]
    j = next(j for j in range(1, len(ids)) if ids[j] not in ids[:j])
    return {"seeded": seeded, "chat": chat, "greedy": greedy, "stop": (k, text[k:k + 2]), "stop_token": j}


@pytest.fixture(scope="module")
def batch(running_server, reference):
    """The basic requests, sent all at once: -> their answers by name (streams as chunk lists)."""
    (_, stop), j = reference["stop"], reference["stop_token"]
    stop_token = reference["greedy"].outputs[0].token_ids[j]
    seeded = {k: v for k, v in SEEDED.items() if k != "top_k"}
    seeded_extra = {"top_k": SEEDED["top_k"], "return_token_ids": True}
    greedy_chat = dict(model=MODEL, messages=MESSAGES, temperature=0)
    greedy = dict(model=MODEL, prompt=STOP_PROMPT, temperature=0, extra_body={"ignore_eos": True,
                                                                              "return_token_ids": True})

    async def run():
        async with running_server.async_client() as c:
            calls = {
                "seeded": c.completions.create(model=MODEL, prompt=PROMPTS, extra_body=seeded_extra, **seeded),
                "seeded_stream": collect(c.completions.create(
                    model=MODEL, prompt=PROMPTS[1], stream=True, stream_options={"include_usage": True},
                    extra_body=seeded_extra, **seeded)),
                "chat": c.chat.completions.create(**greedy_chat, max_completion_tokens=CHAT_GREEDY["max_tokens"],
                                                  logprobs=True, top_logprobs=2),
                "chat_stream": collect(c.chat.completions.create(
                    **greedy_chat, max_tokens=CHAT_GREEDY["max_tokens"], stream=True,
                    stream_options={"include_usage": True}, extra_body={"return_token_ids": True})),
                "greedy": c.completions.create(**greedy, max_tokens=STOP_TOKENS, logprobs=3),
                "greedy_stream": collect(c.completions.create(**greedy, max_tokens=STOP_TOKENS, logprobs=3,
                                                              stream=True)),
                "echo": c.completions.create(**greedy, max_tokens=2, echo=True),
                "prompt_logprobs": c.completions.create(**{**greedy, "extra_body": {
                    "ignore_eos": True, "prompt_logprobs": 2}}, max_tokens=1, echo=True, logprobs=2),
                "stop": c.completions.create(**greedy, max_tokens=STOP_TOKENS, stop=[stop, "never seen"]),
                "stop_kept": c.completions.create(**{**greedy, "extra_body": {
                    "ignore_eos": True, "include_stop_str_in_output": True}}, max_tokens=STOP_TOKENS, stop=stop),
                "stop_stream": collect(c.completions.create(**greedy, max_tokens=STOP_TOKENS, stop=stop,
                                                            stream=True)),
                "stop_token": c.completions.create(**{**greedy, "extra_body": {
                    "ignore_eos": True, "return_token_ids": True, "stop_token_ids": [stop_token]}},
                    max_tokens=STOP_TOKENS),
            }
            return dict(zip(calls, await asyncio.gather(*calls.values())))

    before = metrics(running_server.port)
    answers = asyncio.run(run())
    answers["metrics"] = (before, wait_idle(running_server.port))
    return answers


def check_error(status, body, expected_status, type_=None, param=None, code=None):
    assert status == expected_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    if type_ is not None:
        assert err["type"] == type_, err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


# -- the real servers -----------------------------------------------------------------------------

def test_models_health_tokenize(server, tok):
    client = server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == MAX_CONTEXT
    status, health = call(server.port, "GET", "/health", key=None)
    assert status == 200 and health["status"] == "ok" and health["kv_pages_total"] == 8 * (MAX_CONTEXT // 128)
    text = "The quick brown fox"
    status, out = call(server.port, "POST", "/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200 and out["tokens"] == tok.encode(text) and out["count"] == len(out["tokens"]) > 1
    status, back = call(server.port, "POST", "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert status == 200 and back["prompt"] == tok.decode(out["tokens"])
    status, chat = call(server.port, "POST", "/tokenize", {"messages": MESSAGES})
    assert status == 200
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    m = metrics(server.port)
    for name in IDLE + ("m3_kv_cache_total_pages", "m3_generation_tokens_total", "m3_kv_cache_usage_perc",
                        "m3_time_to_first_token_seconds_count", "m3_time_per_output_token_seconds_count"):
        assert name in m, name
    assert m["m3_time_to_first_token_seconds_count"] >= 1 and m["m3_generation_tokens_total"] >= 2   # warm-up


def test_seeded_completions_match_generate(server, batch, reference):
    """A list prompt (one choice per prompt) and a stream give ``LLM.generate``'s tokens and text."""
    resp = batch["seeded"]
    assert [c.index for c in resp.choices] == [0, 1] and resp.object == "text_completion"
    assert resp.id.startswith("cmpl-") and resp.model == MODEL
    compared = 0
    for choice, ref in zip(resp.choices, reference["seeded"]):
        assert choice.token_ids == ref.outputs[0].token_ids
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
        assert choice.prompt_token_ids == ref.prompt_token_ids
        compared += len(choice.token_ids)
    assert compared > 0
    assert resp.usage.completion_tokens == compared
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in reference["seeded"])
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    ref = reference["seeded"][1].outputs[0]
    chunks = batch["seeded_stream"]
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == ref.text
    ids = [t for c in choices for t in c.token_ids]
    assert ids == ref.token_ids and len(ids) > 0
    assert choices[-1].finish_reason == ref.finish_reason and all(c.finish_reason is None for c in choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_chat(server, batch, reference, tok):
    """Chat, streamed and not, gives ``LLM.chat``'s greedy answer; usage counts the template's tokens."""
    ref = reference["chat"].outputs[0]
    resp = batch["chat"]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    [choice] = resp.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    prompt_ids = tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(ref.token_ids) > 0

    chunks = batch["chat_stream"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
    assert content == ref.text and ids == ref.token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_logprobs_and_echo(server, batch, reference):
    greedy = batch["greedy"].choices[0]
    lp = greedy.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == STOP_TOKENS
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)   # greedy: the sampled token is the top one
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = [c.choices[0] for c in batch["greedy_stream"]]
    assert [t for c in streamed for t in c.token_ids] == greedy.token_ids
    assert "".join(c.text for c in streamed) == greedy.text
    assert [t for c in streamed for t in c.logprobs.tokens] == lp.tokens
    assert [x for c in streamed for x in c.logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [x for c in streamed for x in c.logprobs.text_offset] == lp.text_offset

    chat = batch["chat"]
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens > 0
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode() == entry.token

    echo = batch["echo"]
    assert echo.choices[0].text.startswith(STOP_PROMPT) and len(echo.choices[0].text) > len(STOP_PROMPT)
    assert echo.choices[0].token_ids == greedy.token_ids[:2] and echo.usage.completion_tokens == 2

    # prompt_logprobs (vLLM's {id: {logprob, rank, decoded_token}}) are LLM.generate's; echo with
    # logprobs gives the echoed prompt's tokens the same numbers
    ref = reference["greedy"]
    choice = batch["prompt_logprobs"].choices[0]
    prompt_lps = choice.prompt_logprobs
    assert len(prompt_lps) == len(ref.prompt_token_ids) > 1 and prompt_lps[0] is None
    for token, entry, ref_entry in zip(ref.prompt_token_ids[1:], prompt_lps[1:], ref.prompt_logprobs[1:]):
        assert list(entry)[0] == str(token) and len(entry) <= 3
        assert sorted(e["rank"] for e in entry.values() if e["rank"] <= 2) == [1, 2]
        for t, e in entry.items():   # near ties may order the top 2 differently in another batch
            if int(t) in ref_entry:
                assert e["logprob"] == pytest.approx(ref_entry[int(t)].logprob, abs=1e-3), (t, e)
    lp = choice.logprobs
    prompt_len = len(ref.prompt_token_ids)
    assert choice.text.startswith(STOP_PROMPT) and len(lp.tokens) == prompt_len + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:prompt_len] == [e[str(t)]["logprob"] for t, e in zip(ref.prompt_token_ids[1:],
                                                                                     prompt_lps[1:])]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[prompt_len] == len(STOP_PROMPT)

    before, after = batch["metrics"]
    generated = after["m3_generation_tokens_total"] - before["m3_generation_tokens_total"]
    counted = sum(batch[name].usage.completion_tokens for name in ("seeded", "chat", "greedy", "echo", "stop",
                                                                   "stop_kept", "stop_token", "prompt_logprobs"))
    counted += batch["seeded_stream"][-1].usage.completion_tokens + batch["chat_stream"][-1].usage.completion_tokens
    counted += sum(len(c.choices[0].token_ids) for name in ("greedy_stream", "stop_stream") for c in batch[name])
    assert generated == counted > 0   # every token the server generated went to a client


def test_stop_strings_and_stop_tokens(server, batch, reference):
    """Greedy answers equal ``LLM.generate``'s; a stop string from the middle of that text cuts it
    just before (or after, with include_stop_str_in_output), streamed or not; a stop token ends it."""
    ref = reference["greedy"].outputs[0]
    base = batch["greedy"].choices[0]
    assert base.token_ids == ref.token_ids and len(base.token_ids) == STOP_TOKENS
    assert base.text == ref.text and base.finish_reason == "length"
    text, ids = ref.text, ref.token_ids
    (k, stop), j = reference["stop"], reference["stop_token"]
    plain = batch["stop"].choices[0]
    assert plain.text == text[:k] and plain.finish_reason == "stop" and plain.stop_reason == stop
    assert batch["stop"].usage.completion_tokens < STOP_TOKENS
    assert batch["stop_kept"].choices[0].text == text[:k + 2]
    pieces = batch["stop_stream"]
    assert "".join(p.choices[0].text for p in pieces) == text[:k]
    assert pieces[-1].choices[0].finish_reason == "stop"
    by_token = batch["stop_token"].choices[0]
    assert by_token.token_ids == ids[:j + 1] and by_token.finish_reason == "stop" and by_token.stop_reason == ids[j]


@pytest.mark.long
def test_concurrent_streams(server):
    """32 streaming clients of different lengths at once: each gets its tokens; the pool empties."""
    before = metrics(server.port)
    lengths = [1 + i % 3 for i in range(32)]

    async def one(client, i, n):
        ids, finish, usage = [], None, None
        stream = await client.completions.create(
            model=MODEL, prompt=f"client {i} " + "x " * (i % 7), max_tokens=n, temperature=0.7, seed=i,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            if chunk.choices:
                ids += chunk.choices[0].token_ids
                finish = chunk.choices[0].finish_reason or finish
            else:
                usage = chunk.usage
        return ids, finish, usage

    async def run():
        async with server.async_client() as client:
            return await asyncio.gather(*[one(client, i, n) for i, n in enumerate(lengths)])

    results = asyncio.run(run())
    for n, (ids, finish, usage) in zip(lengths, results):
        assert len(ids) == n and finish == "length" and usage.completion_tokens == n
    after = wait_idle(server.port)
    assert after["m3_generation_tokens_total"] - before["m3_generation_tokens_total"] == sum(lengths)
    assert after['m3_request_success_total{finished_reason="length"}'] - \
        before['m3_request_success_total{finished_reason="length"}'] == 32
    assert after["m3_time_to_first_token_seconds_count"] - before["m3_time_to_first_token_seconds_count"] == 32


def test_disconnect_frees_slots(server):
    """A stream closed mid-way, and a non-streamed request whose client goes away, are aborted at once."""
    before = metrics(server.port)
    stream = server.client().completions.create(model=MODEL, prompt="go on", max_tokens=200, stream=True,
                                                extra_body={"ignore_eos": True})
    for got, _ in enumerate(stream, 1):
        if got == 2:
            break
    stream.close()
    wait_idle(server.port)
    body = json.dumps({"model": MODEL, "prompt": "go on", "max_tokens": 200, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(server.port, lambda m: m["m3_num_requests_running"] == 1, "the request running")
    sock.close()
    after = wait_idle(server.port)
    assert after["m3_request_aborted_total"] - before["m3_request_aborted_total"] == 2
    assert after["m3_generation_tokens_total"] - before["m3_generation_tokens_total"] < 100


def test_constrained_answers_and_n(server):
    """Random weights under structured outputs: response_format json_schema gives JSON the schema
    accepts, chat.completions.parse a pydantic object, a regex a match; an invalid schema is a 400;
    n=3 gives three choices. (Tools need a longer context than this server's: their prompt is
    ~1000 tokens of the tiny tokenizer; the fake-runner tests above cover them.)"""
    import pydantic

    class Flags(pydantic.BaseModel):
        ok: bool
        level: typing.Literal["low", "high"]

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 5}},
              "required": ["ok", "n"]}
    ask = dict(model=MODEL, messages=MESSAGES, max_tokens=60, seed=7)

    async def run():
        async with server.async_client() as c:
            return await asyncio.gather(
                c.chat.completions.create(**ask, response_format={
                    "type": "json_schema", "json_schema": {"name": "flags", "schema": schema, "strict": True}}),
                c.chat.completions.parse(**ask, response_format=Flags),
                c.completions.create(model=MODEL, prompt="Call", max_tokens=8, seed=7,
                                     extra_body={"structured_outputs": {"regex": "[a-z]{2,4}"}}),
                c.completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=3, seed=7,
                                     extra_body={"ignore_eos": True, "return_token_ids": True}))

    by_schema, parsed, regex, three = asyncio.run(run())
    value = json.loads(by_schema.choices[0].message.content)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 5, value
    assert isinstance(parsed.choices[0].message.parsed, Flags)
    assert re.fullmatch("[a-z]{2,4}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    assert [c.index for c in three.choices] == [0, 1, 2] and three.usage.prompt_tokens == \
        len(three.choices[0].prompt_token_ids)
    with pytest.raises(openai.BadRequestError, match="nonsense"):
        server.client().chat.completions.create(**ask, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})


BAD = [
    # (method, path, body or raw bytes, key, status, type, param, code)
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}, None, 401, "authentication_error", None, None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}, "wrong", 401, "authentication_error", None, None),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": ', KEY, 400, "invalid_request_error", None, None),
    ("POST", "/v1/completions", b"[1, 2]", KEY, 400, "invalid_request_error", None, None),
    ("POST", "/v1/completions", b"\xff\xfe", KEY, 400, "invalid_request_error", None, None),
    ("POST", "/v1/completions", {"model": MODEL}, KEY, 400, "invalid_request_error", "prompt", None),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, KEY, 400, None, "temperature", None),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, KEY, 400, None, "top_p", None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, KEY, 400, None, "max_tokens", None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, KEY, 400, None, "max_tokens", None),
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, KEY, 400, None, "n", None),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, KEY, 400, None, "logprobs", None),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 5}, KEY, 400, None, "stop", None),
    ("POST", "/v1/completions", {"prompt": "x", "seed": -1}, KEY, 400, None, "seed", None),
    ("POST", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, KEY, 400, None,
     "stream_options", None),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 1}}, KEY, 400, None, "logit_bias", None),
    ("POST", "/v1/completions", {"prompt": [5] * MAX_CONTEXT}, KEY, 400, None, "prompt",
     "context_length_exceeded"),
    ("POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": MAX_CONTEXT - 1}, KEY, 400, None, "max_tokens",
     "context_length_exceeded"),
    ("POST", "/v1/completions", {"prompt": [5, 100000]}, KEY, 400, None, "prompt", None),
    ("POST", "/v1/completions", {"prompt": []}, KEY, 400, None, "prompt", None),
    ("POST", "/v1/completions", {"prompt": [[5, 6], []]}, KEY, 400, None, "prompt", None),
    ("POST", "/v1/completions", {"prompt": ["a"] * (MAX_QUEUE + 1), "max_tokens": 1}, KEY, 503,
     "service_unavailable_error", None, "queue_full"),
    ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}, KEY, 404, None, "model", "model_not_found"),
    ("POST", "/v1/chat/completions", {"messages": []}, KEY, 400, None, "messages", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, KEY, 400, None,
     "messages", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]}, KEY, 400, None,
     "messages", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, KEY,
     400, None, "messages", None),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 3}, KEY, 400, None, "top_logprobs",
     None),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, KEY, 400, None,
     "top_logprobs", None),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -3}, KEY, 400, None,
     "max_completion_tokens", None),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, KEY, 400, None,
     "tools", None),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, KEY, 400, None, "messages", None),
    ("POST", "/tokenize", {"prompt": "a", "messages": MESSAGES}, KEY, 400, None, None, None),
    ("POST", "/detokenize", {"tokens": [99999]}, KEY, 400, None, "tokens", None),
    ("POST", "/tokenize", {"prompt": "a"}, None, 401, "authentication_error", None, None),
    ("GET", "/v1/nope", None, KEY, 404, None, None, None),
    ("GET", "/v1/completions", None, KEY, 405, None, None, None),
]


def test_bad_requests_while_streaming(server):
    """Every malformed request gets its 4xx (or 503) with OpenAI's error body; a stream running
    meanwhile is not disturbed and the server stays healthy."""
    client = server.client()
    result = {}

    def stream():
        ids, finish = [], None
        for chunk in client.completions.create(model=MODEL, prompt="steady", max_tokens=6, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True,
                                                                        "return_token_ids": True}):
            ids += chunk.choices[0].token_ids
            finish = chunk.choices[0].finish_reason or finish
            result.setdefault("first", time.monotonic())
        result["ids"], result["finish"] = ids, finish

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + REQUEST_TIMEOUT
    while "first" not in result and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "first" in result, "the stream did not start"
    checked = 0
    for method, path, body, key, status, type_, param, code in BAD:
        raw = body if isinstance(body, bytes) else None
        got_status, got = call(server.port, method, path, None if raw is not None else body, key=key, raw=raw)
        check_error(got_status, got, status, type_, param, code)
        checked += 1
    thread.join(REQUEST_TIMEOUT)
    assert checked == len(BAD)
    assert result["finish"] == "length" and len(result["ids"]) == 6, result
    status, health = call(server.port, "GET", "/health", key=None)
    assert status == 200 and health["status"] == "ok"
    assert metrics(server.port)["m3_request_refused_total"] >= MAX_QUEUE + 1
    # the openai client sees the same errors as exceptions
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)


# -- the app in this process, its engine process over a fake runner ----------------------------------

@contextlib.contextmanager
def fake_app(model_dir, options: dict, features=None):
    """The app in this process (uvicorn in a thread) -> a :class:`Server`; its engine process runs
    ``engine_helpers.FakeLLM(model_dir, **options)``."""
    import uvicorn

    from m3_engine.server.app import create_app
    from m3_engine.server.engine_client import EngineClient

    client = EngineClient("engine_helpers:FakeLLM", model_dir, options, max_queue=8)
    app = create_app(client, served_model_name=[MODEL, ALIAS], api_key=KEY, features=features)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    srv = Server(port=sock.getsockname()[1])
    srv.engine_client = client
    try:
        yield srv
    finally:
        uv.should_exit = True
        thread.join(30)
        assert not thread.is_alive()
        assert not client.alive and client.process.process.exitcode == 0   # the lifespan stopped the engine
        client.close()
        sock.close()


@pytest.fixture(scope="module")
def fake_server(model_dir):
    """The app over a fake runner (no tool-call or reasoning parser)."""
    with fake_app(model_dir, dict(max_num_seqs=4, max_model_len=256, enable_prefix_caching=True)) as srv:
        yield srv


@pytest.fixture(scope="module")
def agent_server(model_dir):
    """The app over a fake runner with chat's parsers: --enable-auto-tool-choice --tool-call-parser
    minimax_m3 --reasoning-parser minimax_m3 (and room for a prompt with tools)."""
    from m3_engine.server.chat import ChatFeatures

    features = ChatFeatures(enable_auto_tool_choice=True, tool_call_parser="minimax_m3",
                            reasoning_parser="minimax_m3")
    with fake_app(model_dir, dict(max_num_seqs=4, max_model_len=2048), features) as srv:
        yield srv


def test_failed_step_fails_its_requests_and_the_server_goes_on(fake_server):
    client = fake_server.client()
    for failures in (1, 2, 3):   # one failed step after another: each fails its request; the third makes
        with pytest.raises(openai.InternalServerError, match="injected step failure"):   # /health answer 503
            client.completions.create(model=MODEL, prompt="a", max_tokens=5, seed=FAIL_SEED)
        status, health = call(fake_server.port, "GET", "/health", key=None)
        assert status == (503 if failures == 3 else 200) and "injected" in health["last_error"], health
        assert health["failed_steps"] == failures
    ok = client.completions.create(model=MODEL, prompt="a", max_tokens=5, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 5
    status, health = call(fake_server.port, "GET", "/health", key=None)
    assert status == 200 and health["failed_steps"] == 0
    # mid-stream: the chunks so far arrive, then an error event that the client raises
    chunks = []
    with pytest.raises(openai.APIError, match="injected step failure"):
        for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50, stream=True,
                                                    seed=FAIL_SEED + 3, extra_body={"ignore_eos": True}):
            chunks.append(chunk)
    assert 1 <= len(chunks) <= 4
    m = wait_idle(fake_server.port, timeout=10)
    assert m["m3_engine_step_errors_total"] == 4
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert ok.usage.completion_tokens == 3 and ok.choices[0].finish_reason == "length"


def test_fake_generation_defaults_fill_only_absent_fields(fake_server):
    """The model's generation_config values fill the fields a request leaves out, and only those:
    an explicit temperature equal to the class default (1.0) stays; an absent max_tokens is the
    model's max_new_tokens."""
    defaults = fake_server.engine_client.generation_defaults   # the fake runner's logprob is -temperature
    saved = dict(defaults)
    defaults.update(temperature=0.25, max_tokens=3)
    try:
        client = fake_server.client()
        out = client.completions.create(model=MODEL, prompt="a", logprobs=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3 and out.choices[0].logprobs.token_logprobs == [-0.25] * 3
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=5,
                                             logprobs=True, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
        assert [c.logprob for c in out.choices[0].logprobs.content] == [-1.0] * 5
    finally:
        defaults.clear()
        defaults.update(saved)
    wait_idle(fake_server.port, timeout=10)


def test_fake_many_clients_and_aborts(fake_server):
    """64 clients (more than the batch and the queue allow at once: some get a 503), half of them
    closing their stream early; every slot comes back."""
    async def one(client, i):
        try:
            stream = await client.completions.create(model=MODEL, prompt=f"c{i}", max_tokens=20, stream=True,
                                                     extra_body={"ignore_eos": True, "return_token_ids": True})
        except openai.APIStatusError as e:
            assert e.status_code == 503 and e.body["code"] == "queue_full"
            return "refused"
        n = 0
        async for chunk in stream:
            n += len(chunk.choices[0].token_ids)
            if i % 2 and n >= 2:
                await stream.close()
                return "closed"
        assert n == 20
        return "done"

    async def run():
        async with fake_server.async_client() as client:
            return await asyncio.gather(*[one(client, i) for i in range(64)])

    outcomes = asyncio.run(run())
    assert outcomes.count("done") > 0 and outcomes.count("closed") > 0
    assert outcomes.count("done") + outcomes.count("closed") + outcomes.count("refused") == 64
    wait_idle(fake_server.port, timeout=30)


def test_fake_prefix_cache_usage(fake_server):
    """With --enable-prefix-caching, usage.prompt_tokens_details.cached_tokens and /metrics show the reuse."""
    client = fake_server.client()
    prompt = list(range(10, 210))   # 200 tokens: one full block of 128
    before = metrics(fake_server.port)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 128 and second.usage.prompt_tokens == 200
    after = wait_idle(fake_server.port, timeout=10)
    assert after["m3_prefix_cache_hits_total"] - before["m3_prefix_cache_hits_total"] == 128
    assert after["m3_prefix_cache_queries_total"] > before["m3_prefix_cache_queries_total"]
    assert after["m3_kv_cache_evictable_blocks"] >= 1 and after["m3_kv_cache_cached_blocks"] >= 1


def test_fake_generation_tokens_counted_when_answered(fake_server):
    """``m3_generation_tokens_total`` holds an answer's tokens by the time the client has it, the last
    step's included, whatever that step brought (1 token, then one per choice)."""
    client = fake_server.client()
    for n in (1, 3):
        before = wait_idle(fake_server.port, timeout=10)
        out = client.completions.create(model=MODEL, prompt="a", max_tokens=4, n=n, extra_body={"ignore_eos": True})
        generated = metrics(fake_server.port)["m3_generation_tokens_total"] - before["m3_generation_tokens_total"]
        assert generated == out.usage.completion_tokens == 4 * n


def fake_prompt_entries(tok, prompt_ids: list, n: int, computed: int) -> list:
    """The ``prompt_logprobs`` of ``prompt_ids`` (top ``n`` of the ``computed`` ones) that the fake runner
    makes (``engine_helpers.FakeRunner``): the token ranks ``computed + 1``, after t + 1, t + 2, ..."""
    def entry(token, rank):
        return {"logprob": fake_prompt_logprob(rank), "rank": rank, "decoded_token": tok.token_text(token)}

    return [None] + [{str(t): entry(t, computed + 1), **{str(t + k): entry(t + k, k) for k in range(1, n + 1)}}
                     for t in prompt_ids[1:]]


def test_fake_prompt_logprobs(fake_server, tok):
    """``prompt_logprobs`` (vLLM's): per completions choice, at the top of a chat answer; None for the
    first prompt token, then the prompt's token first and the top N ({id: {logprob, rank,
    decoded_token}}). ``echo`` with ``logprobs`` gives the echoed prompt's tokens their logprobs,
    streamed (in a choice's first chunk) or not. A stream carries no prompt_logprobs (only 0 is
    accepted); out of range is a 400 naming the field."""
    prompt = [10, 11, 12, 13]
    status, out = call(fake_server.port, "POST", "/v1/completions",
                       {"prompt": prompt, "max_tokens": 2, "n": 2, "seed": 5, "prompt_logprobs": 2})
    assert status == 200, out
    expected = fake_prompt_entries(tok, prompt, 2, 2)
    for choice in out["choices"]:
        assert choice["prompt_logprobs"] == expected and choice["logprobs"] is None
        assert [list(e) for e in choice["prompt_logprobs"][1:]] == [list(e) for e in expected[1:]]   # vLLM's order

    status, chat = call(fake_server.port, "POST", "/v1/chat/completions",
                        {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0})
    assert status == 200, chat
    ids = call(fake_server.port, "POST", "/tokenize", {"messages": MESSAGES})[1]["tokens"]
    assert chat["prompt_logprobs"] == fake_prompt_entries(tok, ids, 0, 0)
    assert "prompt_logprobs" not in chat["choices"][0]

    # echo + logprobs=1, with prompt_logprobs=3: the prompt's tokens rank 4, each shows itself and the top 1
    client = fake_server.client()
    asked = dict(model=MODEL, prompt=prompt, max_tokens=3, seed=5, echo=True, logprobs=1,
                 extra_body={"ignore_eos": True})
    whole = client.completions.create(n=2, **{**asked, "extra_body": {"ignore_eos": True, "prompt_logprobs": 3}})
    assert len(whole.choices) == 2
    for choice in whole.choices:
        assert choice.prompt_logprobs == fake_prompt_entries(tok, prompt, 3, 3)
        lp = choice.logprobs
        text = [tok.token_text(t) for t in prompt]
        assert lp.tokens[:4] == text and len(lp.tokens) == 4 + 3
        assert lp.token_logprobs[:4] == [None] + [fake_prompt_logprob(4)] * 3
        assert lp.top_logprobs[:4] == [None] + [{tok.token_text(t): fake_prompt_logprob(4),
                                                 tok.token_text(t + 1): fake_prompt_logprob(1)} for t in prompt[1:]]
        assert lp.text_offset[:5] == [len(tok.decode(prompt[:k])) for k in range(5)]   # where each begins
        assert choice.text.startswith(tok.decode(prompt))
    plain = client.completions.create(n=2, **asked)
    assert plain.choices[0].logprobs.token_logprobs[:4] == [None] + [fake_prompt_logprob(2)] * 3
    chunks = list(client.completions.create(n=2, stream=True, **asked))
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in mine for x in getattr(c.logprobs, key)] == getattr(choice.logprobs, key), key
        assert not hasattr(mine[0], "prompt_logprobs")

    stream = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=True,
                                                 extra_body={"prompt_logprobs": 0}))
    assert stream and not any(hasattr(c, "prompt_logprobs") for c in stream)
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        for bad, message in (({"prompt_logprobs": -2}, "expected an int >= 0, or -1"),
                             ({"prompt_logprobs": -1}, "whole vocabulary (512 tokens)"),
                             ({"prompt_logprobs": 21}, "[0, 20]"),
                             ({"prompt_logprobs": "some"}, "prompt_logprobs"),
                             ({"prompt_logprobs": 1, "stream": True}, "not available with stream=true")):
            status, got = call(fake_server.port, "POST", path, {**base, "max_tokens": 2, **bad})
            check_error(status, got, 400, "invalid_request_error", "prompt_logprobs")
            assert message in got["error"]["message"], (path, bad, got)
    wait_idle(fake_server.port, timeout=10)


def test_fake_context_limit_alias_version_ping_and_vllm_metrics(fake_server):
    """vLLM's rules: prompt + max_tokens never exceed max_model_len (a 400 naming the numbers; left
    out, max_tokens fills the context exactly); the response names the model alias the request
    used; /version and /ping answer; /metrics also carries vLLM's metric names."""
    client = fake_server.client()
    prompt = list(range(10, 210))   # 200 of the 256 tokens
    with pytest.raises(openai.BadRequestError, match="57 is more than the 56 tokens left") as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=57)
    assert info.value.body["param"] == "max_tokens" and info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens: 300 is more than") as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=300)
    full = client.completions.create(model=ALIAS, prompt=prompt, extra_body={"ignore_eos": True})
    assert full.usage.total_tokens == 256 and full.choices[0].finish_reason == "length"
    assert full.model == ALIAS
    assert client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=1).model == ALIAS
    assert client.completions.create(prompt="a", max_tokens=1, model=MODEL).model == MODEL
    status, version = call(fake_server.port, "GET", "/version", key=None)
    assert status == 200 and isinstance(version["version"], str)
    assert call(fake_server.port, "GET", "/ping", key=None)[0] == 200
    assert call(fake_server.port, "POST", "/ping", key=None)[0] == 200
    m = wait_idle(fake_server.port, timeout=10)
    for ours, vllm in (("m3_num_requests_running", "vllm:num_requests_running"),
                       ("m3_generation_tokens_total", "vllm:generation_tokens_total"),
                       ("m3_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
                       ('m3_request_success_total{finished_reason="length"}',
                        'vllm:request_success_total{finished_reason="length"}')):
        assert m[vllm] == m[ours], (ours, vllm)


def test_fake_stop_string_ends_the_request_in_the_engine(fake_server):
    """A stop string is found in this process (the engine process sees token ids only): the answer
    is cut before it, and the request ends in the engine too instead of running to max_tokens."""
    client = fake_server.client()
    before = metrics(fake_server.port)
    out = client.completions.create(model=MODEL, prompt=say("one two three"), max_tokens=200, stop=["two"],
                                    extra_body={"ignore_eos": True})
    c = out.choices[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("one ", "stop", "two")
    after = wait_idle(fake_server.port, timeout=10)
    generated = after["m3_generation_tokens_total"] - before["m3_generation_tokens_total"]
    assert out.usage.completion_tokens <= generated < 100, generated   # 200 if the engine went on


def test_fake_min_tokens_and_bad_words_reach_the_engine(fake_server):
    """vLLM's min_tokens and bad_words are SamplingParams' (not dropped as unknown fields): before
    min_tokens outputs no stop string is looked for; bad values are a 400 naming the field."""
    client = fake_server.client()
    out = client.completions.create(model=MODEL, prompt=say("one two three"), max_tokens=40, stop=["two"],
                                    extra_body={"ignore_eos": True, "min_tokens": 40})
    c = out.choices[0]
    assert (c.text, c.finish_reason, out.usage.completion_tokens) == ("one two three", "length", 40)
    for body, param in (({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"bad_words": [" "]}, "bad_words")):
        status, got = call(fake_server.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, **body})
        check_error(status, got, 400, "invalid_request_error", param)
    wait_idle(fake_server.port, timeout=10)


def test_fake_disconnect_aborts_in_the_engine(fake_server):
    """A client that closes its stream, or leaves while waiting for a non-streamed answer, has its
    request aborted in the engine process: nothing runs there any more."""
    before = metrics(fake_server.port)
    stream = fake_server.client().completions.create(model=MODEL, prompt="go on", max_tokens=200, stream=True,
                                                     extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    wait_idle(fake_server.port, timeout=10)
    body = json.dumps({"model": MODEL, "prompt": "go on", "max_tokens": 200, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", fake_server.port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(fake_server.port, lambda m: m["m3_num_requests_running"] == 1, "the request running", timeout=10)
    sock.close()
    after = wait_idle(fake_server.port, timeout=10)
    assert after["m3_request_aborted_total"] - before["m3_request_aborted_total"] == 2
    assert after["m3_generation_tokens_total"] - before["m3_generation_tokens_total"] < 2 * 200


@pytest.mark.long
def test_engine_process_death(model_dir, tmp_path):
    """The engine process killed mid-stream: the stream ends with an error event, a non-streamed
    request gets a 500, /health answers 503, and the server exits with status 1 within seconds."""
    srv = Server("torch", model_dir, tmp_path / "server.log")
    try:
        health = srv.wait_ready()
        client = srv.client()
        result = {}

        def plain():
            try:
                client.completions.create(model=MODEL, prompt="wait", max_tokens=200, extra_body={"ignore_eos": True})
            except openai.APIStatusError as e:
                result["status"], result["message"] = e.status_code, e.message

        thread = threading.Thread(target=plain)
        thread.start()
        stream = client.completions.create(model=MODEL, prompt="go on", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        wait_for(srv.port, lambda m: m["m3_num_requests_running"] == 2, "both requests running")
        os.kill(health["engine_pid"], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine process was killed by SIGKILL"):
            for chunk in chunks:
                assert chunk.choices[0].finish_reason is None
        status, health = call(srv.port, "GET", "/health", key=None)
        assert status == 503 and "SIGKILL" in health["error"], health
        thread.join(30)
        assert result.get("status") == 500 and "SIGKILL" in result["message"], result
        assert srv.proc.wait(timeout=15) == 1, srv.log.read_text()[-4000:]
        assert "error: the engine process was killed by SIGKILL" in srv.log.read_text()
    finally:
        srv.kill()


# -- agents: tools, tool_choice, response_format, reasoning, n (fake runner) ----------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                       "required": ["city", "days"]}}},
    {"type": "function", "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def valid(arguments: dict, schema: dict) -> bool:
    """``arguments`` fits one of TOOLS' parameter schemas (required keys, enums, integer bounds)."""
    props = schema["properties"]
    return set(arguments) <= set(props) and set(schema["required"]) <= set(arguments) and all(
        (v in props[k]["enum"]) if "enum" in props[k] else
        (isinstance(v, int) and props[k]["minimum"] <= v <= props[k]["maximum"]) for k, v in arguments.items())


def scripted(text, messages=MESSAGES) -> list:
    """``messages`` whose system message makes the fake runner answer ``text`` (then eos)."""
    system, *rest = messages
    assert system["role"] == "system"
    return [{**system, "content": system["content"] + say(text)}, *rest]


def unconstrained(seed: int, count: int, vocab: int) -> list:
    """The fake runner's first ``count`` tokens for a request seeded ``seed`` without a token bitmask."""
    return [3 + (seed + 7 * k) % (vocab - 3) for k in range(count)]


def streamed(chunks, index=0) -> tuple:
    """A chat stream's choice ``index`` -> (reasoning, content, tool_calls as (name, arguments dict), finish)."""
    reasoning = content = ""
    calls, finish = {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index != index:
                continue
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls and d.id.startswith("call_") and d.type == "function"
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())], finish


def whole(message) -> list:
    assert all(t.id.startswith("call_") and t.type == "function" for t in message.tool_calls or [])
    return [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []]


def test_fake_auto_tool_calls_and_reasoning(agent_server, tok):
    """tool_choice "auto" (the default with tools): M3's markup becomes tool_calls (two in one
    message), the <mm:think> span reasoning_content, streamed or not alike; "none" leaves the
    markup as content; an answer without calls keeps finish_reason "stop"."""
    from m3_engine.tool_parser import NS, TOOL_CALL_END, TOOL_CALL_START, to_xml

    calls = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]
    markup = TOOL_CALL_START + "\n" + "".join(f'{NS}<invoke name="{name}">{to_xml(args)}{NS}</invoke>\n'
                                              for name, args in calls) + TOOL_CALL_END
    client = agent_server.client()
    ask = dict(model=MODEL, tools=TOOLS, max_tokens=400, temperature=0)
    thought = scripted("<mm:think>Weather first.</mm:think>Checking." + markup)
    answer = client.chat.completions.create(**ask, messages=thought)
    chunks = list(client.chat.completions.create(**ask, messages=thought, stream=True))
    plain = client.chat.completions.create(**ask, messages=thought, tool_choice="none")
    c = answer.choices[0]
    assert (c.message.reasoning_content, c.message.content, whole(c.message), c.finish_reason) == \
        ("Weather first.", "Checking.", calls, "tool_calls")
    assert streamed(chunks) == ("Weather first.", "Checking.", calls, "tool_calls")
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]) >= 2
    p = plain.choices[0]
    assert (p.message.content, p.message.tool_calls, p.finish_reason) == ("Checking." + markup, None, "stop")
    only = client.chat.completions.create(**ask, messages=scripted(markup)).choices[0].message   # content None
    assert only.content is None and whole(only) == calls and only.reasoning_content is None
    c = client.chat.completions.create(**ask, messages=scripted("No tools needed.")).choices[0]
    assert (c.message.content, c.message.tool_calls, c.finish_reason) == ("No tools needed.", None, "stop")
    # a request's assistant tool_calls and tool results are rendered by the template
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    c = client.chat.completions.create(**ask, messages=scripted("It is noon.", history),
                                       extra_body={"return_token_ids": True})
    prompt = tok.decode(c.prompt_token_ids, skip_special_tokens=False)
    assert "<response>12:00</response>" in prompt and 'invoke name="get_time"' in prompt and "<tools>" in prompt
    assert c.choices[0].message.content == "It is noon."
    wait_idle(agent_server.port, timeout=10)


def test_fake_required_and_named_tool_choice(agent_server):
    """"required" and a named function are enforced by structured outputs (a JSON array of
    {name, parameters} / the parameters object): the walk of a random model through the mask gives
    valid calls, streamed or not."""
    client = agent_server.client()
    vocab = agent_server.engine_client.vocab_size
    ask = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=10)   # a seed whose walk ends
    required = client.chat.completions.create(**ask, tool_choice="required", extra_body={"return_token_ids": True})
    c = required.choices[0]
    assert c.token_ids != unconstrained(10, len(c.token_ids), vocab), "no structured-outputs bitmask reached the runner"
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    assert len(whole(c.message)) == 2 and all(valid(args, SCHEMAS[name]) for name, args in whole(c.message)), c
    chunks = list(client.chat.completions.create(**ask, tool_choice="required", stream=True))
    _, content, calls, finish = streamed(chunks)
    assert (content, calls, finish) == ("", whole(c.message), "tool_calls")   # same seed: same answer
    named = {"type": "function", "function": {"name": "get_weather"}}
    c = client.chat.completions.create(**ask, tool_choice=named).choices[0]
    [(name, args)] = whole(c.message)
    assert name == "get_weather" and valid(args, SCHEMAS[name]) and c.finish_reason == "stop"
    assert c.message.content is None
    _, content, calls, finish = streamed(list(client.chat.completions.create(**ask, tool_choice=named, stream=True)))
    assert (content, calls, finish) == ("", [(name, args)], "stop")
    # the scripted array of two calls: each element one call
    text = '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "get_weather", "parameters": ' \
           '{"city": "Rome", "days": 2}}]'
    ask = {**ask, "messages": scripted(text)}
    c = client.chat.completions.create(**ask, tool_choice="required").choices[0]
    _, _, calls, _ = streamed(list(client.chat.completions.create(**ask, tool_choice="required", stream=True)))
    assert whole(c.message) == calls == [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome", "days": 2})]
    wait_idle(agent_server.port, timeout=10)


def test_fake_response_format_and_structured_outputs(agent_server):
    """response_format json_schema / json_object, chat.completions.parse with a pydantic model,
    vLLM's structured_outputs (chat and completions): the constraint reaches the engine and the
    answers fit it."""
    import pydantic

    class Weather(pydantic.BaseModel):
        city: str
        days: int

    client = agent_server.client()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 5}},
              "required": ["ok", "n"]}
    vocab = agent_server.engine_client.vocab_size
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, seed=3, response_format={
        "type": "json_schema", "json_schema": {"name": "flags", "schema": schema, "strict": True}},
        extra_body={"return_token_ids": True})
    ids = out.choices[0].token_ids
    assert ids != unconstrained(3, len(ids), vocab), "no structured-outputs bitmask reached the runner"
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 5
    text = '{"city": "Paris", "days": 4}'
    parsed = client.chat.completions.parse(model=MODEL, messages=scripted(text), max_tokens=60,
                                           response_format=Weather)
    obj = client.chat.completions.create(model=MODEL, messages=scripted(text), max_tokens=60,
                                         response_format={"type": "json_object"})
    done = client.completions.create(model=MODEL, prompt=say(text), max_tokens=60,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert parsed.choices[0].message.parsed == Weather(city="Paris", days=4)
    assert json.loads(obj.choices[0].message.content) == json.loads(done.choices[0].text) == {"city": "Paris",
                                                                                               "days": 4}
    yes_no = client.completions.create(model=MODEL, prompt="x", max_tokens=10, seed=5, extra_body={
        "structured_outputs": {"choice": ["yes", "no"]}, "return_token_ids": True}).choices[0]
    assert yes_no.text in ("yes", "no") and yes_no.token_ids != unconstrained(5, len(yes_no.token_ids), vocab)
    digits = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, seed=5,
                                            extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].message.content)
    wait_idle(agent_server.port, timeout=10)


def test_fake_n_choices(agent_server):
    """n choices: own indexes, seeds seed + i (the fake's first token is 3 + seed % (vocab - 3)),
    the prompt counted once in usage; streamed chunks carry their choice's index."""
    client = agent_server.client()
    vocab = agent_server.engine_client.vocab_size
    ask = dict(model=MODEL, max_tokens=3, seed=100, n=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    chat = client.chat.completions.create(messages=MESSAGES, **ask)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert [c.token_ids[0] for c in chat.choices] == [3 + (100 + i) % (vocab - 3) for i in range(3)]
    assert chat.usage.prompt_tokens == len(chat.prompt_token_ids) and chat.usage.completion_tokens == 9
    done = client.completions.create(prompt=["a b", "c"], **ask)
    assert [c.index for c in done.choices] == list(range(6))
    assert [c.token_ids[0] for c in done.choices] == [3 + (100 + i % 3) % (vocab - 3) for i in range(6)]
    assert done.usage.prompt_tokens == sum(len(c.prompt_token_ids) for c in done.choices[::3])
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **{**ask, "n": 2}))
    for i in range(2):
        assert sum(len(getattr(ch.choices[0], "token_ids", None) or []) for ch in chunks
                   if ch.choices[0].index == i) == 3
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].index == i][-1] == "length"
    unseeded = client.completions.create(model=MODEL, prompt="a", max_tokens=3, n=2,
                                         extra_body={"ignore_eos": True})
    assert unseeded.choices[0].text != unseeded.choices[1].text
    wait_idle(agent_server.port, timeout=10)


AGENT_BAD = [
    # (server, body, param, message)
    ("agent", {"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice", "expected"),
    ("agent", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("agent", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not one of the tools"),
    ("agent", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nonsense"}}}}, "structured_outputs", "nonsense"),
    ("agent", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ("agent", {"response_format": {"type": "xml"}}, "response_format", "xml"),
    ("agent", {"structured_outputs": {"regex": "("}}, "structured_outputs", "parenthesis"),
    ("agent", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("agent", {"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown field"),
    ("agent", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "cannot be combined"),
    ("agent", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ("plain", {"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
    ("plain", {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
]


def test_fake_agent_bad_requests(agent_server, fake_server):
    """Bad tools / tool_choice / response_format / structured_outputs: a 400 naming the field; "auto"
    without --enable-auto-tool-choice is vLLM's 400; tool_choice "none" needs no flag."""
    for which, body, param, message in AGENT_BAD:
        srv = agent_server if which == "agent" else fake_server
        status, got = call(srv.port, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **body})
        check_error(status, got, 400, "invalid_request_error", param)
        assert message in got["error"]["message"], (body, got)
    status, got = call(agent_server.port, "POST", "/v1/completions",
                       {"prompt": "x", "structured_outputs": {"regex": "("}})
    check_error(status, got, 400, None, "structured_outputs")
    status, got = call(fake_server.port, "POST", "/v1/chat/completions",
                       {"messages": MESSAGES, "max_tokens": 2, "tools": TOOLS[:1], "tool_choice": "none"})
    assert status == 400 and got["error"]["code"] == "context_length_exceeded"   # the tools' prompt: rendered
    wait_idle(agent_server.port, timeout=10)


def test_fake_llm_chat_renders_tools(model_dir):
    llm = FakeLLM(model_dir, max_num_seqs=2, max_model_len=2048)
    try:
        [out] = llm.chat(MESSAGES, SamplingParams(max_tokens=1), tools=TOOLS, use_tqdm=False)
    finally:
        llm.close()
    assert "<tools>" in out.prompt and '"name": "get_time"' in out.prompt


def test_cli_flags():
    from m3_engine.args import EngineArgs, engine_options
    from m3_engine.server.cli import build_parser

    args = build_parser().parse_args([
        "DIR", "--framework", "jax", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k",
        "--served-model-name", "a", "b", "--max-num-seqs", "4", "--max-model-len", "1024", "--dtype", "bfloat16",
        "--kv-cache-dtype", "fp8", "--index-cache-dtype", "fp8", "-tp", "2", "--max-queue", "7",
        "--enable-prefix-caching", "--chat-template", "t.jinja", "--enable-auto-tool-choice", "--tool-call-parser",
        "minimax_m3", "--reasoning-parser", "minimax_m3"])
    assert (args.framework, args.host, args.port, args.api_key, args.served_model_name, args.max_queue,
            args.chat_template) == ("jax", "0.0.0.0", 9000, "k", ["a", "b"], 7, "t.jinja")
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser) == (True, "minimax_m3",
                                                                                            "minimax_m3")
    options = engine_options(args)
    assert options["max_num_seqs"] == 4 and options["max_model_len"] == 1024 and options["dtype"] == "bfloat16"
    assert options["kv_cache_dtype"] == options["index_cache_dtype"] == "fp8"
    assert options["tensor_parallel_size"] == 2 and options["enable_prefix_caching"] is True
    import dataclasses
    assert set(options) == {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}   # every engine option


@pytest.mark.parametrize("argv, message", [
    (["DIR", "--framework", "tf"], r"^error: argument --framework: invalid choice: 'tf'"),
    (["DIR", "--max-num-seqs", "x"], r"^error: argument --max-num-seqs: invalid int value: 'x'$"),
    (["{m}", "--port", "-1"], r"^error: argument --port: expected an int >= 0, got -1$"),
    (["{m}", "--port", "99999"], r"^error: argument --port: expected a port in \[0, 65535\], got 99999$"),
    (["{m}", "--port", "http"], r"^error: argument --port: expected an int >= 0, got 'http'$"),
    (["{m}", "--max-queue", "x"], r"^error: argument --max-queue: expected an int >= 0, got 'x'$"),
    (["/nonexistent/m3"], r"^error: MODEL_DIR: /nonexistent/m3 has no config.json"),
    (["{m}", "--max-num-seqs", "0"], r"^error: --max-num-seqs: expected an int >= 1, got 0$"),
    (["{m}", "--quantization", "awq"], r"^error: --quantization: expected None"),
    (["{m}", "--tool-call-parser", "hermes"], r"^error: argument --tool-call-parser: invalid choice: 'hermes'"),
    (["{m}", "--reasoning-parser", "r1"], r"^error: argument --reasoning-parser: invalid choice: 'r1'"),
    (["{m}", "--enable-auto-tool-choice"], r"^error: --enable-auto-tool-choice: needs --tool-call-parser"),
])
def test_bad_command_line_is_one_error_line(model_dir, capsys, argv, message):
    from m3_engine.server.cli import main

    assert main([a.format(m=model_dir) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and re.match(message, err) and err.count("\n") == 1, err
