"""``m3-serve``'s command line: the flags, the model load, uvicorn.

    m3-serve MODEL_DIR --framework torch --port 8000 --max-num-seqs 32 --max-model-len 8192
    python -m m3_engine.server MODEL_DIR --framework jax --api-key secret --served-model-name m3

The engine flags are ``m3-generate``'s (``m3_engine.args.add_engine_flags``: one per
``EngineArgs`` field, vLLM's names and defaults); the server's own are ``--framework``,
``--host``, ``--port``, ``--api-key``, ``--served-model-name``, ``--chat-template``,
``--enable-auto-tool-choice``, ``--tool-call-parser``, ``--reasoning-parser`` (vLLM's; see
``m3_engine.server.chat``), ``--max-queue``, ``--shutdown-timeout``, ``--log-level``,
``--no-access-log``. A bad command line, a model folder without config.json, a port that cannot
be bound or an engine option the engine refuses is one ``error: ...`` line on stderr and exit
status 2.

The engine runs in a process of its own (``m3_engine.server.core_process``), started before
the port is served; an engine that fails to load is one ``error: ...`` line too (exit status
2 for a bad option or model folder, 1 otherwise). SIGTERM (and SIGINT) stop the server
cleanly: no new connections; open requests may finish for ``--shutdown-timeout`` seconds, then
what is left is aborted (each gets a 503 error body or error event, then ``[DONE]``) and the
engine process stops (``llm.close()`` there ends tensor-parallel workers); exit status 0. An
engine process that dies on its own fails every open request with a 500, ``/health`` answers
503, and the server stops ``DEAD_EXIT_DELAY`` seconds later with exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

from ..args import ArgumentParser, EngineArgs, UsageError, add_engine_flags, engine_flags, engine_options, flag_message
from .app import create_app
from .chat import REASONING_PARSERS, TOOL_CALL_PARSERS, ChatFeatures
from .core_process import EngineStartError
from .engine_client import DEFAULT_MAX_QUEUE, EngineClient

__all__ = ["main", "build_parser"]

FRAMEWORKS = ("torch", "jax")
DEAD_EXIT_DELAY = 2.0   # seconds /health answers 503 after the engine process died, before the server stops


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {value}")
    return value


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="m3-serve", allow_abbrev=False,
                       description="An OpenAI-compatible server (completions, chat, streaming) over a MiniMax-M3 "
                       "checkpoint, with the torch or the JAX engine.")
    p.add_argument("model", type=Path, metavar="MODEL_DIR",
                   help="folder with config.json, *.safetensors and (for text and chat) tokenizer.json")
    p.add_argument("--framework", choices=FRAMEWORKS, default="torch", help="engine: m3_torch.LLM (default) or "
                   "m3_jax.LLM")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=_port, default=8000, help="default 8000; 0 picks a free port (the "
                   "'listening on' line shows it)")
    p.add_argument("--api-key", default=os.environ.get("M3_API_KEY"), help="require 'Authorization: Bearer KEY' "
                   "on /v1/*, /tokenize and /detokenize (default: $M3_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) requests use and /v1/models lists (default: MODEL_DIR)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file that replaces the model folder's (chat completions, /tokenize)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default when a request has tools): the model decides to call tools, '
                   "its tool-call markup parsed into tool_calls (needs --tool-call-parser)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the model's tool-call format (MiniMax-M3's markup: minimax_m3)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split the model's thinking into reasoning_content (MiniMax-M3's <mm:think>: minimax_m3)")
    p.add_argument("--max-queue", type=_non_negative_int, default=DEFAULT_MAX_QUEUE,
                   help=f"waiting requests beyond which new ones get a 503 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                   help="on SIGTERM, seconds open requests may still take before they are aborted (default 5)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--no-access-log", action="store_true", help="no line per HTTP request")
    add_engine_flags(p)
    return p


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _uvicorn_server(config, *, client: EngineClient, grace: float):
    """uvicorn's server, whose shutdown ends open requests itself after ``grace`` seconds: the
    engine client stops and hands each open request a 503 error (a stream ends with an error
    event and ``[DONE]``) instead of uvicorn cancelling the request tasks."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            async def drain():
                await asyncio.sleep(grace)
                await client.stop()

            task = asyncio.ensure_future(drain())
            try:
                await super().shutdown(sockets)
            finally:
                task.cancel()

    return Server(config)


def _exit_cleanly(signum, frame):
    raise SystemExit(0)


def main(argv=None) -> int:
    """Serve until SIGTERM / SIGINT; -> the exit status (0 stopped, 2 a user error, 1 the server
    did not start or its engine process died)."""
    try:
        return _serve(build_parser().parse_args(argv))
    except UsageError as e:
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        return 2


def _serve(args) -> int:
    import uvicorn

    if not (args.model / "config.json").is_file():
        raise UsageError(f"MODEL_DIR: {args.model} has no config.json (expected a transformers-format checkpoint)")
    options = engine_options(args)
    try:   # the options checked before a port is bound or a framework imported
        EngineArgs(args.model, **options).check()
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError(flag_message(str(e), engine_flags())) from None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UsageError("--enable-auto-tool-choice: needs --tool-call-parser (e.g. --tool-call-parser minimax_m3)")
    features = ChatFeatures(enable_auto_tool_choice=args.enable_auto_tool_choice,
                            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--chat-template {args.chat_template}: {e.strerror}") from None
    # SIGTERM / SIGINT: exit 0 (also while the model loads). uvicorn replaces these handlers while it
    # serves, shuts down gracefully, then raises the signal again, which lands here.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    signal.signal(signal.SIGINT, _exit_cleanly)
    try:
        sock = _listen(args.host, args.port)   # before loading: a busy port fails at once
    except OSError as e:
        raise UsageError(f"--host/--port: cannot listen on {args.host}:{args.port}: {e}") from None
    client = None
    try:
        try:
            client = EngineClient(f"m3_{args.framework}:LLM", args.model, options, max_queue=args.max_queue,
                                  chat_template=chat_template)
        except EngineStartError as e:
            if e.user_error:
                raise UsageError(flag_message(str(e), engine_flags())) from None
            sys.stderr.write(f"error: the engine did not start: {' '.join(str(e).split())}\n")
            return 1
        app = create_app(client, served_model_name=args.served_model_name or [str(args.model)],
                         api_key=args.api_key, features=features)
        config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log,
                                timeout_graceful_shutdown=args.shutdown_timeout + 30, lifespan="on")
        server = _uvicorn_server(config, client=client, grace=args.shutdown_timeout)

        def engine_died(reason: str) -> None:
            asyncio.get_running_loop().call_later(DEAD_EXIT_DELAY, setattr, server, "should_exit", True)

        client.on_dead = engine_died
        host, port = sock.getsockname()[:2]
        print(f"m3-serve: {args.framework} engine over {args.model} (max_num_seqs {client.max_num_seqs}, "
              f"max_model_len {client.max_model_len}, {client.num_kv_pages} KV pages); listening on "
              f"http://{host}:{port}", flush=True)
        server.run(sockets=[sock])
        if client.dead:
            sys.stderr.write(f"error: {client.dead}\n")
            return 1
        if server.started is False and not server.should_exit:
            return 1
    finally:
        if client is not None:
            client.close()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
