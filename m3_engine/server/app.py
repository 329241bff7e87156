"""The FastAPI app of ``m3-serve``: OpenAI's routes over an :class:`EngineClient`.

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed (server-sent
  events ``data: {...}``, then ``data: [DONE]``) or not, in OpenAI's shapes;
  ``stream_options.include_usage`` adds a last chunk with ``usage``.
* ``GET /v1/models`` (and ``/v1/models/{name}``; the card adds ``max_model_len``
  and ``vocab_size``), ``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes).
* ``GET /health``: 200 ``{"status": "ok", "running", "waiting", "unfinished",
  "kv_pages_used", "kv_pages_total", "in_flight", "failed_steps", "last_error",
  "engine_pid", "startup_times" (``LLM.startup_times``: seconds to ready, by part),
  ...the engine's stats}``; 503 when the engine process is not running
  or the last 3 steps all failed. ``GET``/``POST /ping``: 200 (empty) or 503 alike (vLLM's).
  ``GET /version``: ``{"version": ...}`` (vLLM's shape; this package's version).
* ``GET /metrics``: Prometheus text (``m3_engine.server.metrics``; our names and
  vLLM's). After a load the pool is empty again when running, waiting, in-flight
  and used pages are all 0.

Request fields: OpenAI's ``model``, ``prompt`` (a string, a list of strings,
token ids, a list of token-id lists: ``n`` choices per prompt), ``messages``,
``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``logprobs`` / ``top_logprobs``, ``presence_penalty``,
``frequency_penalty``, ``n``, ``echo``, ``stream``, ``stream_options``,
``response_format`` (chat and completions), ``tools``, ``tool_choice`` (chat); and
vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``bad_words``,
``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``return_token_ids`` (each choice / chunk gets ``token_ids``, and
``prompt_token_ids``), ``prompt_logprobs``, ``structured_outputs`` (chat and
completions), ``add_generation_prompt`` (chat). Tools, tool choice, constrained output and the
reasoning split: ``m3_engine.server.chat`` (a constraint goes to the engine process
as the requests' ``SamplingParams.structured_outputs``).
Unknown fields are ignored; fields this engine cannot honour (``logit_bias``,
``best_of`` > 1, ``suffix``, ``functions``, ...) are a 400.

Semantics worth knowing:

* The prompt and the output together never exceed ``max_model_len`` (vLLM's
  rule): a prompt of ``max_model_len`` tokens or more is a 400, and so is a
  ``max_tokens`` (``max_completion_tokens``) beyond what is left of the context
  after the prompt; both name the numbers (``code="context_length_exceeded"``).
  ``max_tokens`` left out = what is left of the context, for completions and
  chat alike (vLLM's default, not OpenAI's 16 for completions), at most the
  model's ``generation_config.json`` ``max_new_tokens``.
* ``model``: one of the ``--served-model-name`` names (another is a 404); the
  response's ``model`` is the name the request used (the first name when it
  names none).
* ``usage.prompt_tokens_details.cached_tokens``: the prompt tokens the prefix
  cache served (``--enable-prefix-caching``; else 0).
* ``n``: ``SamplingParams.n``: a prompt's choices are the completions of one engine request
  (``m3_engine.output_processor``: ``choices[i].index`` = i; with several prompts, prompt 0's
  choices first); a seeded request's choice ``i`` samples with ``seed + i`` (vLLM's rule). The
  prompt is tokenized once and counted once in ``usage``; its KV is computed by each choice
  unless ``--enable-prefix-caching`` shares its full blocks.
* A choice's text leaves out the text of the stop token that ended it (an eos or a
  ``stop_token_ids`` id; it shows with ``skip_special_tokens=false``, which chat's
  parsers set) unless ``include_stop_str_in_output``, as vLLM's (``m3_engine.output_processor``).
  A stop string ends its request in the engine process too (the engine sees no text).
* ``echo`` (completions) puts the prompt text before the completion; with
  ``logprobs`` the echoed prompt's tokens come first in ``logprobs`` too (the
  first with None logprobs; streamed, in a choice's first chunk; ``text_offset``
  where each token's text begins in the returned text), as OpenAI's legacy API
  did. In chat, ``echo`` puts the last message's content first when that
  message is the assistant's (vLLM's rule).
* ``prompt_logprobs`` N (vLLM's): each completions choice, and a chat answer at
  its top level, gets ``prompt_logprobs``: None for the first prompt token, then
  per prompt token ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` of
  the prompt's token (first) and the N most likely ones
  (``SamplingParams.prompt_logprobs``; such a request does not use the prefix
  cache). N is at most 20; -1 (vLLM's whole vocabulary) is a 400 unless the
  vocabulary has at most 20 tokens. A stream carries none: with ``stream`` only
  0 is accepted (and nothing is computed), as vLLM's.
* Sampling defaults a request leaves out come from the model's
  ``generation_config.json``; the server passes on only the fields a request
  sets and the engine fills the others, as for ``LLM.generate`` (an explicit
  ``"temperature": 1.0`` stays 1.0). A request with ``seed`` samples the same
  tokens as ``LLM.generate`` with the same parameters.
* ``--max-queue N``: an HTTP request whose prompts would make more than N
  requests wait (admitted to no batch yet) is refused with a 503
  (``code="queue_full"``); a list prompt counts one per prompt.
* Errors are OpenAI's body ``{"error": {"message", "type", "param", "code"}}``:
  400 for a bad request (pydantic's checks and ``SamplingParams``'), 401 for a
  missing or wrong API key (``/v1/*``, ``/tokenize``, ``/detokenize``; ``/health``,
  ``/ping``, ``/version`` and ``/metrics`` stay open), 404 for an unknown model or
  path, 503 when the waiting queue is full (``--max-queue``) or the server is
  stopping, 500 when a model step fails (the requests of that step fail; the
  server goes on) and when the engine process dies (every open request fails,
  a stream with an error event; ``/health`` answers 503 and ``m3-serve`` exits
  with status 1: ``m3_engine.server.engine_client``).

A client that goes away (a closed stream, a dropped connection while waiting
for a non-streamed answer) has its requests aborted, which frees their cache
pages at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import time
import traceback
import uuid
from typing import Optional

# first: without FastAPI, pydantic or uvicorn, .protocol names the extra that installs them
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerationRequest,
                       TokenizeRequest, bad, param_of)
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling_params import MAX_LOGPROBS, SamplingParams
from ..structured_outputs import StructuredOutputsParams
from ..tokenizer import IncrementalDetokenizer
from .chat import ChatFeatures, ChoiceOutput, merge_deltas, structured_outputs, tool_choice
from .engine_client import EngineClient, Sink
from .metrics import render_metrics

__all__ = ["create_app"]

log = logging.getLogger("uvicorn.error")   # uvicorn's configured logger: our lines look like its own


# -- the server ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Server:
    """What the routes share: the engine client, the served names, the HTTP requests open."""
    client: EngineClient
    model_names: list
    api_key: Optional[str]
    features: ChatFeatures
    in_flight: int = 0

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.vocab_size

    def model_name(self, model: Optional[str]) -> str:
        """The name a response carries: the request's (checked), or the first served name."""
        if model is None:
            return self.model_names[0]
        if model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist (this server has {self.model_names}).",
                           param="model", code="model_not_found")
        return model

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id) if self.tokenizer is not None else f"token_id:{token_id}"

    def check_ids(self, ids: list, param: str) -> list:
        """A prompt's ids: not empty, in the vocabulary, and shorter than ``max_model_len`` (the
        output needs at least one of its tokens)."""
        if not ids:
            raise bad(f"{param}: empty prompt (expected at least one token)", param)
        outside = [t for t in ids if not 0 <= t < self.vocab_size]
        if outside:
            raise bad(f"{param}: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})", param)
        if len(ids) >= self.max_model_len:
            raise bad(f"{param}: the prompt has {len(ids)} tokens; this server's context is {self.max_model_len} "
                      f"tokens (--max-model-len), prompt and output together, so a prompt may have at most "
                      f"{self.max_model_len - 1}", param, code="context_length_exceeded")
        return ids

    def max_tokens(self, requested: Optional[int], prompt_len: int, param: str) -> int:
        """A request's ``max_tokens``: at most what is left of the context after the prompt (a 400
        naming the limit otherwise); left out: all of that, at most the model's
        ``generation_config.json`` ``max_new_tokens``."""
        room = self.max_model_len - prompt_len
        if requested is None:
            return min(room, self.client.generation_defaults.get("max_tokens", room))
        if requested > room:
            raise bad(f"{param}: {requested} is more than the {room} tokens left of this server's context of "
                      f"{self.max_model_len} (--max-model-len) after the prompt's {prompt_len}; prompt and output "
                      f"together never exceed it", param, code="context_length_exceeded")
        return requested

    def encode(self, text: str, param: str, *, add_special_tokens: bool = True) -> list:
        if self.tokenizer is None:
            raise bad(f"{param}: this model has no tokenizer.json; send token ids", param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def text_offsets(self, ids: list) -> list:
        """Where each token's text begins in the text of ``ids`` (as ``echo`` shows a prompt: special
        tokens left out; all 0 without a tokenizer, whose echo is empty)."""
        if self.tokenizer is None:
            return [0] * len(ids)
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        offsets = []
        for token in ids:
            offsets.append(len(detokenizer.text))
            detokenizer.add([token])
        return offsets


def create_app(client: EngineClient, *, served_model_name=None, api_key: Optional[str] = None,
               features: Optional[ChatFeatures] = None) -> FastAPI:
    """The FastAPI app over ``client``. Its lifespan starts reading the client's engine and stops it.

    served_model_name: the name, or list of names, requests may use (default: the model folder).
    api_key:           when set, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need
                       ``Authorization: Bearer <api_key>``.
    features:          chat's tool-call and reasoning parsers (``m3_engine.server.chat``; default: none).
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    server = _Server(client=client, model_names=names or [str(client.model_dir)], api_key=api_key or None,
                     features=features or ChatFeatures())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client.start()
        yield
        await client.stop()

    app = FastAPI(title="m3-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.m3 = server
    if server.api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=server.api_key)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

    @app.get("/health")
    async def health_route():
        return _health(server)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping_route():
        return Response(status_code=_health(server).status_code)

    @app.get("/version")
    async def version_route():
        from ..cli import version
        return {"version": version()}

    @app.get("/v1/models")
    async def models_route():
        return {"object": "list", "data": [_model_card(server, n) for n in server.model_names]}

    @app.get("/v1/models/{name:path}")
    async def model_route(name: str):
        return _model_card(server, server.model_name(name))

    @app.get("/metrics")
    async def metrics_route():
        text = render_metrics(client.snapshot, client.metrics, in_flight=server.in_flight,
                              model_name=server.model_names[0])
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return _tokenize(server, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return _detokenize(server, body)

    @app.post("/v1/completions")
    async def completions_route(body: CompletionRequest, request: Request):
        return await _completions(server, body, request)

    @app.post("/v1/chat/completions")
    async def chat_route(body: ChatCompletionRequest, request: Request):
        return await _chat(server, body, request)

    return app


# -- errors ---------------------------------------------------------------------------------------------

async def _api_error(request, e: APIError):
    return e.response()


async def _validation_error(request, e: RequestValidationError):
    errors = e.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return bad(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}").response()
    param = ".".join(loc) or None
    message = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: "
                        f"{err.get('msg')}" for err in errors[:5]) or "invalid request"
    return bad(message, loc[0] if loc else param).response()


async def _http_error(request, e: StarletteHTTPException):
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
    return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind).response()


async def _internal_error(request, e: Exception):
    log.error("m3-serve: %s %s failed:\n%s", request.method, request.url.path, traceback.format_exc())
    return APIError(500, f"{type(e).__name__}: {e}", type="internal_server_error").response()


# -- status and tokens ----------------------------------------------------------------------------------

def _health(server: _Server) -> JSONResponse:
    """200 with the engine's load, or 503 (``EngineClient.health``)."""
    healthy, detail = server.client.health()
    detail = {"status": "ok" if healthy else "error", **detail, "in_flight": server.in_flight}
    return JSONResponse(detail, status_code=200 if healthy else 503)


def _tokenize(server: _Server, body: TokenizeRequest) -> dict:
    server.model_name(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad("tokenize: expected one of 'prompt' or 'messages'", "prompt")
    if body.messages is not None:
        _, ids = _chat_prompt(server, body.messages, body.add_generation_prompt)
    else:
        ids = server.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
    out = {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [server.token_text(t) for t in ids]
    return out


def _detokenize(server: _Server, body: DetokenizeRequest) -> dict:
    server.model_name(body.model)
    if server.tokenizer is None:
        raise bad("detokenize: this model has no tokenizer.json", "tokens")
    outside = [t for t in body.tokens if not 0 <= t < server.vocab_size]
    if outside:
        raise bad(f"tokens: token id {outside[0]} is outside the vocabulary [0, {server.vocab_size})", "tokens")
    return {"prompt": server.tokenizer.decode(body.tokens)}


# -- the HTTP side of a request ----------------------------------------------------------------------

class _Job:
    """One HTTP request's engine requests (one per prompt, each with its ``n`` completions), seen
    from the event loop."""

    def __init__(self, server: "_Server", request_ids: list):
        self.server, self.request_ids = server, request_ids
        self.index = {r: i for i, r in enumerate(request_ids)}
        self.sink = Sink()
        self.outputs: dict = {}          # request id -> its latest RequestOutput
        self.finished: set = set()
        self._open = False

    async def start(self, items: list, arrival: float) -> None:
        self.server.client.add(items, self.sink, arrival)
        self._open = True
        self.server.in_flight += 1
        try:
            kind, value = await self.sink.queue.get()
        except BaseException:   # cancelled: the abort follows the add in the engine's queue
            self.close()
            raise
        if kind == "error":
            self._close(abort=False)
            raise value

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)

    async def updates(self) -> list:
        """Wait for news; -> the latest ``RequestOutput`` of each request that moved (several
        steps' worth come as one). An engine error is raised as the ``APIError``."""
        events = [await self.sink.queue.get()]
        while not self.sink.queue.empty():
            events.append(self.sink.queue.get_nowait())
        changed = {}
        for kind, value in events:
            if kind == "error":
                self.finished.update(self.request_ids)   # the engine dropped them already
                raise value
            self.outputs[value.request_id] = changed[value.request_id] = value
            if value.finished:
                self.finished.add(value.request_id)
        return sorted(changed.values(), key=lambda o: self.index[o.request_id])

    async def collect(self, request: Request) -> bool:
        """Wait until every request finished (-> True) or the client went away (-> False)."""
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while not self.done:
                news = asyncio.ensure_future(self.updates())
                await asyncio.wait({news, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not news.done():
                    news.cancel()
                    return False
                news.result()
            return True
        finally:
            gone.cancel()

    async def wait_all(self, request: Request):
        """A non-streamed answer's wait: None once every request finished, or the 499 response when
        the client went away first (what has not finished is aborted)."""
        try:
            if not await self.collect(request):
                return APIError(499, "the client closed the connection").response()
        finally:
            self.close()
        return None

    def close(self) -> None:
        """Abort what has not finished (the client is gone or the answer failed)."""
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        if self._open:
            self._open = False
            self.server.in_flight -= 1
            left = [r for r in self.request_ids if r not in self.finished]
            if abort and left:
                self.server.client.abort(left)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return



def _check_unsupported(body: BaseModel, fields: dict) -> None:
    """``fields``: name -> predicate that is True for the values we can honour."""
    for name, fine in fields.items():
        value = getattr(body, name, None)
        if value is not None and not fine(value):
            raise bad(f"{name}: not supported by this server (got {value!r:.60})", name)


def _sampling_params(server: "_Server", body: GenerationRequest, *, max_tokens: int, logprobs: Optional[int],
                     prompt_logprobs: Optional[int], rename: dict,
                     constraint: Optional[StructuredOutputsParams] = None,
                     skip_special_tokens: Optional[bool] = None) -> SamplingParams:
    """The request's ``SamplingParams`` (``n`` choices), with only the fields it sets (the engine
    gives the others the model's ``generation_config.json`` values, as for ``LLM.generate``)."""
    kwargs = dict(n=1 if body.n is None else body.n, max_tokens=max_tokens, logprobs=logprobs,
                  prompt_logprobs=prompt_logprobs, ignore_eos=body.ignore_eos,
                  include_stop_str_in_output=body.include_stop_str_in_output,
                  skip_special_tokens=body.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
                  structured_outputs=constraint)
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens", "bad_words"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        param = param_of(e, rename)
        raise bad(str(e) if param is None or param == param_of(e) else f"{param}{str(e)[len(param_of(e)):]}",
                   param) from None


def _moved_choices(outputs: list) -> list:
    """``[(RequestOutput, CompletionOutput)]``: every completion of these outputs (the streams skip
    those with nothing new)."""
    return [(out, c) for out in outputs for c in out.outputs]


def _stream_flags(body: GenerationRequest) -> bool:
    if body.stream_options is not None and not body.stream:
        raise bad("stream_options: only allowed with stream=true", "stream_options")
    return bool(body.stream and body.stream_options is not None and body.stream_options.include_usage)


def _prompt_logprobs(server: "_Server", body: GenerationRequest) -> Optional[int]:
    """The top-N of the ``prompt_logprobs`` the answer carries (vLLM's rules): an int >= 0, or -1 for
    the whole vocabulary (a 400 when that is more than ``MAX_LOGPROBS``); a stream carries none, so
    a streamed request may ask only 0 (accepted, None: nothing is computed)."""
    n = body.prompt_logprobs
    if n is None:
        return None
    if n < -1:
        raise bad(f"prompt_logprobs: expected an int >= 0, or -1 for the whole vocabulary, got {n}",
                  "prompt_logprobs")
    if body.stream:
        if n != 0:
            raise bad(f"prompt_logprobs: not available with stream=true (a streamed chunk has no field for them), "
                      f"got {n}", "prompt_logprobs")
        return None
    if n == -1 and server.vocab_size > MAX_LOGPROBS:
        raise bad(f"prompt_logprobs: -1 asks for the whole vocabulary ({server.vocab_size} tokens) at each prompt "
                  f"token; this server returns at most {MAX_LOGPROBS}", "prompt_logprobs")
    return server.vocab_size if n == -1 else n


def _prompt_logprobs_json(server: "_Server", prompt_ids: list, entries: list, n: int) -> list:
    """vLLM's ``prompt_logprobs`` of a prompt: None for its first token, then per token
    ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` of the prompt's token (first) and the
    ``n`` most likely ones."""
    out = [None]
    for token, entry in zip(prompt_ids[1:], entries[1:]):
        kept = [(token, entry[token])] + sorted(((t, lp) for t, lp in entry.items() if t != token and lp.rank <= n),
                                                key=lambda kv: kv[1].rank)
        out.append({str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for t, lp in kept})
    return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(outputs: list) -> dict:
    """OpenAI's usage of one ``RequestOutput`` per prompt: each prompt counted once (its choices
    share it); ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache served."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _completion_logprobs(server: _Server, token_ids: list, logprobs: list, n: int, offset: int) -> dict:
    """OpenAI's completions logprobs of these tokens: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (the top ``n`` and the token itself), ``text_offset`` (from ``offset``). A
    None entry (an echoed prompt's first token) has None logprobs."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, logprobs):
        text = server.token_text(token)
        out["tokens"].append(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(_finite(entry[token].logprob))
            ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 0))
            out["top_logprobs"].append({server.token_text(t): _finite(lp.logprob) for t, lp in ranked
                                        if (lp.rank is not None and lp.rank <= n) or t == token})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _joined(first: dict, then: dict) -> dict:
    """Two completions logprobs one after the other."""
    return {key: first[key] + then[key] for key in first}


def _chat_logprobs(server: _Server, token_ids: list, logprobs: list, n: int) -> list:
    """OpenAI's chat ``logprobs.content`` of these tokens."""
    content = []
    for token, entry in zip(token_ids, logprobs):
        text = server.token_text(token)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n),
                     key=lambda kv: kv[1].rank)
        content.append({"token": text, "logprob": _finite(entry[token].logprob), "bytes": list(text.encode()),
                        "top_logprobs": [{"token": server.token_text(t), "logprob": _finite(lp.logprob),
                                          "bytes": list(server.token_text(t).encode())} for t, lp in top[:n]]})
    return content


def _messages(messages: list) -> list:
    """OpenAI messages -> the chat template's: content parts ``[{"type": "text", "text"}]`` joined."""
    if not messages:
        raise bad("messages: expected at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]: expected a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad(f"messages[{i}].content: only text parts are supported, got {kind!r}", "messages")
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content: expected a string or a list of text parts", "messages")
        out.append(m)
    return out


def _chat_prompt(server: _Server, messages: list, add_generation_prompt: bool, tools=None) -> tuple:
    """-> (prompt text, prompt ids) of a conversation (and its OpenAI ``tools``), with the chat template
    (``--chat-template``'s, else the model's)."""
    if server.tokenizer is None:
        raise bad("messages: this model has no tokenizer.json (chat needs one); use /v1/completions with token ids",
                  "messages")
    try:
        text = server.tokenizer.apply_chat_template(_messages(messages), chat_template=server.client.chat_template,
                                                    add_generation_prompt=add_generation_prompt, tools=tools)
    except APIError:
        raise
    except Exception as e:   # jinja2's errors, raise_exception() of the template, our own checks
        raise bad(f"messages: {e}", "messages") from None
    return text, server.tokenizer.encode(text, add_special_tokens=False)



# -- completions -----------------------------------------------------------------------------------------

async def _completions(server: _Server, body: CompletionRequest, request: Request):
    arrival = time.time()
    model = server.model_name(body.model)
    _check_unsupported(body, {"best_of": lambda v: v == 1, "suffix": lambda v: v == "",
                              "logit_bias": lambda v: not v})
    include_usage = _stream_flags(body)
    n_prompt_logprobs = _prompt_logprobs(server, body)
    n_logprobs = body.logprobs
    echo_logprobs = bool(body.echo) and n_logprobs is not None   # the echoed prompt's tokens get logprobs too
    computed = n_prompt_logprobs   # the top-N of the prompt logprobs the engine computes: enough for both uses
    if echo_logprobs:
        computed = max(n_logprobs, n_prompt_logprobs or 0)
    constraint = structured_outputs(body.response_format, body.structured_outputs)
    prompts = _completion_prompts(server, body.prompt)
    base = f"cmpl-{uuid.uuid4().hex}"
    items, echo = [], []   # one per prompt, with its n choices: prompt 0's, then prompt 1's, ... (vLLM's order)
    for text, ids in prompts:
        params = _sampling_params(server, body, max_tokens=server.max_tokens(body.max_tokens, len(ids), "max_tokens"),
                                  logprobs=n_logprobs, prompt_logprobs=computed, rename={}, constraint=constraint)
        shown = ((text if text is not None else (server.tokenizer.decode(ids) if server.tokenizer else ""))
                 if body.echo else "")
        items.append((f"{base}-{len(items)}", {"prompt_token_ids": ids, "prompt": text}, params))
        echo += [shown] * params.n
    n = items[0][2].n
    job = _Job(server, [r for r, _, _ in items])
    await job.start(items, arrival)
    created = int(arrival)

    def echoed_logprobs(out) -> dict:
        """The completions logprobs of the echoed prompt (None for its first token); ``text_offset``:
        where each token's text begins in the echoed text."""
        logprobs = _completion_logprobs(server, out.prompt_token_ids, out.prompt_logprobs, n_logprobs, 0)
        logprobs["text_offset"] = server.text_offsets(out.prompt_token_ids)
        return logprobs

    def choice_extras(out, c, sent: int) -> dict:
        extra = {}
        if body.return_token_ids:
            extra["token_ids"] = c.token_ids[sent:]
            if sent == 0:
                extra["prompt_token_ids"] = out.prompt_token_ids
        return extra

    if not body.stream:
        gone = await job.wait_all(request)
        if gone is not None:
            return gone
        outs = [job.outputs[r] for r in job.request_ids]
        choices = []
        for k, out in enumerate(outs):
            for c in out.outputs:
                i = k * n + c.index
                logprobs = None
                if n_logprobs is not None:
                    logprobs = _completion_logprobs(server, c.token_ids, c.logprobs, n_logprobs, len(echo[i]))
                    if echo_logprobs:
                        logprobs = _joined(echoed_logprobs(out), logprobs)
                choice = {"index": i, "text": echo[i] + c.text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, **choice_extras(out, c, 0)}
                if n_prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_json(server, out.prompt_token_ids,
                                                                      out.prompt_logprobs, n_prompt_logprobs)
                choices.append(choice)
        return {"id": base, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(outs)}

    async def events():
        sent_text = [0] * len(echo)
        sent_tokens = [0] * len(echo)
        offsets = [len(e) for e in echo]
        started, ended = set(), set()   # the choices whose first / last chunk went out
        while not job.done:
            for out, c in _moved_choices(await job.updates()):
                i = job.index[out.request_id] * n + c.index
                new_tokens = c.token_ids[sent_tokens[i]:]
                delta = c.text[sent_text[i]:]
                finished = c.finish_reason is not None
                if i in ended or (not new_tokens and not delta and not finished):
                    continue
                first = i not in started
                if first and echo_logprobs and out.prompt_logprobs is None:
                    continue   # the prompt's logprobs come with its first completion's first token
                started.add(i)
                if first:
                    delta = echo[i] + delta
                logprobs = None
                if n_logprobs is not None:
                    logprobs = _completion_logprobs(server, new_tokens, c.logprobs[sent_tokens[i]:],
                                                    n_logprobs, offsets[i])
                    offsets[i] += sum(len(t) for t in logprobs["tokens"])
                    if first and echo_logprobs:
                        logprobs = _joined(echoed_logprobs(out), logprobs)
                choice = {"index": i, "text": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
                          **choice_extras(out, c, sent_tokens[i])}
                if finished:
                    choice["stop_reason"] = c.stop_reason
                    ended.add(i)
                sent_text[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                chunk = {"id": base, "object": "text_completion", "created": created, "model": model,
                         "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
        if include_usage:
            yield _sse({"id": base, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": _usage([job.outputs[r] for r in job.request_ids])})

    return _EventStream(_events_then_done(events(), job), on_close=job.close)


# -- chat ------------------------------------------------------------------------------------------------

async def _chat(server: _Server, body: ChatCompletionRequest, request: Request):
    arrival = time.time()
    model = server.model_name(body.model)
    _check_unsupported(body, {"logit_bias": lambda v: not v, "functions": lambda v: not v,
                              "function_call": lambda v: v == "none"})
    include_usage = _stream_flags(body)
    n_prompt_logprobs = _prompt_logprobs(server, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad("top_logprobs: needs logprobs=true", "top_logprobs")
    n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    tools = tool_choice(body.tools, body.tool_choice, server.features)
    constraint = structured_outputs(body.response_format, body.structured_outputs, tools)
    text, ids = _chat_prompt(server, body.messages, body.add_generation_prompt, tools.tools)
    server.check_ids(ids, "messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    rename = {"logprobs": "top_logprobs", "max_tokens": max_tokens_param}
    params = _sampling_params(server, body, max_tokens=server.max_tokens(requested, len(ids), max_tokens_param),
                              logprobs=n_logprobs, prompt_logprobs=n_prompt_logprobs, rename=rename,
                              constraint=constraint,
                              skip_special_tokens=False if ChoiceOutput.parses_text(tools, server.features) else None)
    readers = [ChoiceOutput(tools, server.features, text) for _ in range(params.n)]   # one per choice
    echo = ""
    last = body.messages[-1]
    if body.echo and last.get("role") == "assistant":
        echo = _messages([last])[0].get("content") or ""
    base = f"chatcmpl-{uuid.uuid4().hex}"
    job = _Job(server, [base])
    await job.start([(base, {"prompt_token_ids": ids, "prompt": text}, params)], arrival)
    created = int(arrival)

    if not body.stream:
        gone = await job.wait_all(request)
        if gone is not None:
            return gone
        out = job.outputs[base]
        choices = []
        for i, (c, reader) in enumerate(zip(out.outputs, readers)):
            message, finish_reason = reader.message(c.text, c.finish_reason)
            if echo:
                message["content"] = echo + (message["content"] or "")
            choice = {"index": i, "message": message,
                      "logprobs": None if n_logprobs is None else
                      {"content": _chat_logprobs(server, c.token_ids, c.logprobs, n_logprobs)},
                      "finish_reason": finish_reason, "stop_reason": c.stop_reason}
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        response = {"id": base, "object": "chat.completion", "created": created, "model": model,
                    "choices": choices, "usage": _usage([out])}
        if n_prompt_logprobs is not None:
            response["prompt_logprobs"] = _prompt_logprobs_json(server, out.prompt_token_ids, out.prompt_logprobs,
                                                                n_prompt_logprobs)
        if body.return_token_ids:
            response["prompt_token_ids"] = out.prompt_token_ids
        return response

    def chunk(index: int, delta: dict, *, finish=None, logprobs=None, extra=None) -> str:
        c = {"id": base, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                          **(extra or {})}]}
        if include_usage:
            c["usage"] = None
        return _sse(c)

    async def events():
        sent_text = [0] * len(readers)
        sent_tokens = [0] * len(readers)
        for i in range(len(readers)):
            yield chunk(i, {"role": "assistant", "content": ""})
            if echo:
                yield chunk(i, {"content": echo})
        ended = set()   # the choices whose last chunk went out
        while not job.done:
            for _, c in _moved_choices(await job.updates()):
                i = c.index
                reader = readers[i]
                new_tokens = c.token_ids[sent_tokens[i]:]
                finished = c.finish_reason is not None
                if i in ended or (not new_tokens and len(c.text) == sent_text[i] and not finished):
                    continue
                delta = reader.feed(c.text[sent_text[i]:])
                finish = None
                if finished:
                    ended.add(i)
                    last, finish = reader.finish(c.finish_reason)
                    delta = merge_deltas(delta, last)
                logprobs = None if n_logprobs is None else \
                    {"content": _chat_logprobs(server, new_tokens, c.logprobs[sent_tokens[i]:], n_logprobs)}
                extra = {"token_ids": new_tokens} if body.return_token_ids else {}
                if finished:
                    extra["stop_reason"] = c.stop_reason
                sent_text[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                if not delta and not finished and logprobs is None and not extra:
                    continue   # text the parser holds back (a tag still arriving)
                yield chunk(i, delta, finish=finish, logprobs=logprobs, extra=extra)
        if include_usage:
            yield _sse({"id": base, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [], "usage": _usage([job.outputs[base]])})

    return _EventStream(_events_then_done(events(), job), on_close=job.close)


async def _events_then_done(events, job: "_Job"):
    """A stream's server-sent events, then ``data: [DONE]``. An error while making them ends the
    stream with an error event in OpenAI's body (an ``APIError``'s own, or a 500 for a bug) instead
    of cutting it; the job's requests are closed however the stream ends (a client that leaves
    closes this generator: no ``[DONE]`` then)."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield _sse(e.body())
    except Exception as e:   # a bug: the client gets an error event, not a cut stream
        log.error("m3-serve: a stream failed:\n%s", traceback.format_exc())
        yield _sse(APIError(500, f"{type(e).__name__}: {e}", type="internal_server_error").body())
    finally:
        await events.aclose()
        job.close()
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (also when the client left
    before the stream began, so that the generator never ran)."""

    def __init__(self, body, *, on_close):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _completion_prompts(server: _Server, prompt) -> list:
    """``prompt`` of a completions request -> ``[(text or None, ids), ...]``, checked."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif not prompt:
        raise bad("prompt: expected a string, a list of strings, token ids or a list of token-id lists; "
                   "got an empty list", "prompt")
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    out = []
    for p in prompts:
        if isinstance(p, str):
            ids = server.encode(p, "prompt")
            out.append((p, server.check_ids(ids, "prompt")))
        else:
            out.append((None, server.check_ids(list(p), "prompt")))
    return out


def _model_card(server: "_Server", name: str) -> dict:
    client = server.client
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "m3",
            "root": str(client.model_dir), "parent": None, "max_model_len": client.max_model_len,
            "vocab_size": client.vocab_size, "framework": client.framework}


class _APIKeyMiddleware:
    """401 for ``/v1/*``, ``/tokenize`` and ``/detokenize`` without ``Authorization: Bearer <key>``."""

    PROTECTED = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.PROTECTED):
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                 type="authentication_error", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

