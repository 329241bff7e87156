"""Load test of the OpenAI-compatible server: `python3 -m benchmarks.serve --model DIR [options]`.

    python3 -m benchmarks.serve --model /tmp/m3e2e --e2e-model --max-num-seqs 64 --max-model-len 4096 \\
        --input-len 1024 --output-len 256 --num-requests 256 --request-rate 4,16,inf --max-concurrency 64 \\
        --out benchmarks/results/latest                     # GPU: the random M3-shaped model of benchmarks.e2e
    python3 -m benchmarks.serve --model /tmp/m3e2e --e2e-model --max-num-seqs 64 --max-model-len 4096 \\
        --input-len 1024 --output-len 256 --num-requests 128,16 --max-concurrency 64,1 --offline \\
        --out DIR                                           # the server against the engine alone (--framework jax too)
    python3 -m benchmarks.serve --url http://127.0.0.1:8000/v1 --api-key KEY ...   # a server already running
    python3 -m benchmarks.serve --tiny                      # CPU smoke run: the tiny test model, a few requests

Without ``--url`` the server is started here as a subprocess (``python -m
m3_engine.server MODEL --port 0`` with ``--framework``, ``--max-num-seqs``,
``--max-model-len``, ``--dtype``, ``--kv-cache-dtype``, ``--tensor-parallel-size``
and anything in ``--server-args``), waited for (``/health``), warmed up (``--warmup``
requests of the rows' lengths, at most the largest ``--max-concurrency`` in flight: the
rows' step shapes, decode batches included, are compiled before they are measured), and
stopped with SIGTERM at the end (its exit status is checked). ``--e2e-model``
writes ``benchmarks.e2e``'s random bf16 model (MiniMax-M3's attention shapes,
4 layers, a 32k vocabulary, no tokenizer) into ``--model`` first when that
folder has no ``config.json``.

Load: ``--num-requests`` requests per row (a comma list: one count per
``--max-concurrency`` value); arrivals are a Poisson process of
``--request-rate`` requests/s (``inf``: all at once), at most
``--max-concurrency`` in flight (a request that arrives beyond it waits for a
free place, as vLLM's ``benchmark_serving`` does). Prompt and output lengths
are uniform in ``[L * (1 - r), L * (1 + r)]`` (``--input-len``,
``--output-len``, ``--range-ratio r``); prompts are random token ids (the e2e
model has no tokenizer), requests are streamed ``/v1/completions`` with
``ignore_eos`` (every request generates its full output length) and
``return_token_ids`` (token counts per chunk). Comma lists of
``--request-rate`` and ``--max-concurrency`` give one row per pair, in one
server.

Per row: request throughput (req/s), output and total (prompt + output) token
throughput (tok/s) over the row's wall time, and p50 / p99 (and mean) of
TTFT (request sent -> first token), TPOT ((last token - first token) / (output
tokens - 1), per request), ITL (between two token chunks) and end-to-end
latency. The server's ``/metrics`` generation-token counter is compared with
the tokens the client counted, and the server must be idle after each row.
The HTTP client is the standard library's asyncio streams (no HTTP package
on the load side). When it starts the server on a GPU it measures the
device's copy bandwidth first (``benchmarks.run.copy_bandwidth``) and
records it with the GPU's name. ``--out DIR`` writes ``serve.json`` and
``serve.md``.

``--offline``: once the server has stopped, the same requests through the
engine alone, ``m3_<framework>.LLM`` built with the server's engine options
(its command line read by ``m3-serve``'s own parser) in a spawned process of
its own (:func:`offline`). Per concurrency: a warm-up pass (the same lengths,
other token ids: everything compiled, no prefix-cache hits), then the row's
requests (the same prompt token ids and output lengths, ``ignore_eos``) run as
``LLM.generate`` runs them, at most ``concurrency`` in flight
(:func:`offline_pass`): its output tok/s, per-request TPOT, and the wall time of
each ``llm.engine.step()`` that was decode-only, by batch (the engine's decode
step, host work included). The "server vs offline" table puts beside each
row: offline and server output tok/s and their ratio, the server's TPOT p50
against the median decode step at batch ``min(concurrency, max_num_seqs)``,
and the targets (:data:`THROUGHPUT_RATIO_MIN`, :data:`TPOT_STEP_RATIO_MAX_FULL`,
:data:`TPOT_STEP_RATIO_MAX_ONE`).

Step timeline: the server's engine core (and the offline engine's) writes a line per step
(``m3_engine.step_timeline``, ``$M3_STEP_TIMELINE``, set here); the client keeps each request's
send time and the times its first and last tokens came (``time.time()``, the clock of the engine's
processes on this host). Per row, "Step timeline" puts the server's and the offline engine's
:func:`timeline_summary` side by side: steps, their mean generation rows, prefill steps and their
prompt tokens, the core's busy time (and its wait for the device) and idle time, request send ->
in the core, and step end -> client for first and last tokens. ``--out`` keeps the step files too
(``timeline-server.jsonl``, ``timeline-offline.jsonl``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Optional

import numpy as np

from m3_engine.step_timeline import ENV_VAR as STEP_TIMELINE, PROFILE_ENV_VAR as STEP_PROFILE
from m3_engine.step_timeline import read as read_timeline

REPO = Path(__file__).resolve().parents[1]


# -- the HTTP client ----------------------------------------------------------------------------------

class Endpoint:
    def __init__(self, url: str, api_key: str | None):
        parsed = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if parsed.scheme != "http":
            raise SystemExit(f"--url: only http:// is supported, got {url!r}")
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.prefix = parsed.path.rstrip("/")          # ".../v1"
        self.root = self.prefix[:-3] if self.prefix.endswith("/v1") else self.prefix
        self.api_key = api_key

    async def request(self, method: str, path: str, payload=None, on_event=None):
        """-> (status, body bytes). With ``on_event``, each SSE ``data:`` payload is handed to it as
        it arrives (``time.perf_counter()`` is taken by the caller)."""
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        try:
            body = b"" if payload is None else json.dumps(payload).encode()
            head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Connection: close",
                    f"Content-Length: {len(body)}", "Content-Type: application/json", "Accept: */*"]
            if self.api_key:
                head.append(f"Authorization: Bearer {self.api_key}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            headers = {}
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                k, _, v = line.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            buffer, whole = b"", []
            async for data in _body(reader, headers):
                if on_event is None or status != 200:
                    whole.append(data)
                    continue
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            on_event(line[5:].strip())
            return status, b"".join(whole)
        finally:
            writer.close()

    async def json(self, method: str, path: str, payload=None):
        status, body = await self.request(method, path, payload)
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode(errors="replace")


async def _body(reader, headers):
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(1 << 16):
            yield data


def parse_metrics(text: str) -> dict:
    """``/metrics`` (Prometheus text) -> ``{name or name{labels}: value}``, the model_name label left out
    (the server's tests read it too)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([\w:]+)(?:\{([^}]*)\})? (\S+)$", line)
        if m:
            labels = ",".join(x for x in (m.group(2) or "").split(",") if x and not x.startswith("model_name="))
            out[m.group(1) + (f"{{{labels}}}" if labels else "")] = float(m.group(3))
    return out


# -- one request, one row ------------------------------------------------------------------------------

async def one_request(ep: Endpoint, model: str, prompt: list, output_len: int, temperature: float) -> dict:
    payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": temperature,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
               "return_token_ids": True}
    times, counts, record = [], [], {"input_len": len(prompt), "output_len": 0, "error": None}
    walls = []   # time.time() of the chunks with tokens: set against the engine core's step timeline

    def on_event(data: bytes):
        now, wall = time.perf_counter(), time.time()
        if data == b"[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            record["error"] = event["error"].get("message")
            return
        record.setdefault("id", event.get("id"))
        for choice in event.get("choices") or ():
            n = len(choice.get("token_ids") or ())
            if n:
                times.append(now)
                walls.append(wall)
                counts.append(n)
        if event.get("usage"):
            record["usage"] = event["usage"]

    start, record["sent_at"] = time.perf_counter(), time.time()
    try:
        status, body = await ep.request("POST", ep.prefix + "/completions", payload, on_event)
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        status, body = None, f"{type(e).__name__}: {e}".encode()
    end = time.perf_counter()
    if status != 200:
        record["error"] = f"HTTP {status}: {body[:300].decode(errors='replace')}"
    record.update(start=start, end=end, output_len=sum(counts))
    if times:
        record["first_at"], record["last_at"] = walls[0], walls[-1]
        record["ttft"] = times[0] - start
        record["itl"] = [b - a for a, b in zip(times, times[1:])]
        if record["output_len"] > 1:
            record["tpot"] = (times[-1] - times[0]) / (record["output_len"] - 1)
    record["e2e"] = end - start
    return record


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def make_requests(rng: random.Random, args, num_requests: int, vocab: int) -> tuple:
    """-> ``(prompts, output lengths)``: ``num_requests`` prompts of random token ids in ``[3, vocab)``
    and their output lengths, drawn from ``rng`` (a row's requests; the offline run draws the same)."""
    inputs = _lengths(rng, num_requests, args.input_len, args.range_ratio)
    outputs = _lengths(rng, num_requests, args.output_len, args.range_ratio)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in inputs]
    return prompts, outputs


async def run_row(ep: Endpoint, model: str, vocab: int, args, rate: float, concurrency: int, num_requests: int,
                  seed: int) -> dict:
    rng = random.Random(seed)
    prompts, outputs = make_requests(rng, args, num_requests, vocab)
    gaps = [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in prompts]
    gate = asyncio.Semaphore(concurrency)
    _, before = await ep.request("GET", ep.root + "/metrics")

    async def limited(prompt, n):
        async with gate:
            return await one_request(ep, model, prompt, n, args.temperature)

    start, began = time.perf_counter(), time.time()
    tasks = []
    for prompt, n, gap in zip(prompts, outputs, gaps):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.ensure_future(limited(prompt, n)))
    records = await asyncio.gather(*tasks)
    duration, ended = time.perf_counter() - start, time.time()
    _, after = await ep.request("GET", ep.root + "/metrics")
    idle = await wait_idle(ep)
    before, after = parse_metrics(before.decode()), parse_metrics(after.decode())

    ok = [r for r in records if r["error"] is None]
    out_tokens = sum(r["output_len"] for r in ok)
    in_tokens = sum(r["input_len"] for r in ok)
    row = dict(request_rate="inf" if math.isinf(rate) else rate, max_concurrency=concurrency,
               num_requests=len(records), completed=len(ok), failed=len(records) - len(ok),
               errors=sorted({r["error"] for r in records if r["error"]})[:5],
               short_outputs=sum(r["output_len"] != n for r, n in zip(records, outputs) if r["error"] is None),
               duration_s=duration, request_throughput=len(ok) / duration,
               output_throughput=out_tokens / duration, total_token_throughput=(in_tokens + out_tokens) / duration,
               mean_input_len=in_tokens / max(len(ok), 1), mean_output_len=out_tokens / max(len(ok), 1),
               server_generation_tokens=after.get("m3_generation_tokens_total", 0)
               - before.get("m3_generation_tokens_total", 0),
               server_idle_after=idle,
               # for the step timeline (taken out once read): the engine core names the completion of
               # prompt 0 of the request "cmpl-..." "cmpl-...-0" (m3_engine.server.app)
               timing=dict(window=(began, ended), requests=[(f"{r['id']}-0", r["sent_at"], r["first_at"], r["last_at"])
                                                            for r in ok if "first_at" in r]))
    for key, values in (("ttft", [r["ttft"] for r in ok if "ttft" in r]),
                        ("tpot", [r["tpot"] for r in ok if "tpot" in r]),
                        ("itl", [x for r in ok for x in r.get("itl", ())]),
                        ("e2e", [r["e2e"] for r in ok])):
        row[f"{key}_ms"] = _summary(values)
    return row


def _summary(values: list) -> dict:
    """Seconds -> mean, p50 and p99 in ms (percentiles interpolated linearly, numpy's default)."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ms = np.asarray(values, np.float64) * 1e3
    p50, p99 = np.percentile(ms, [50, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p99": float(p99)}


async def wait_idle(ep: Endpoint, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, text = await ep.request("GET", ep.root + "/metrics")
        m = parse_metrics(text.decode())
        if all(m.get(k, 0) == 0 for k in ("m3_num_requests_running", "m3_num_requests_waiting",
                                          "m3_kv_cache_used_pages")):
            return True
        await asyncio.sleep(0.1)
    return False


# -- the server subprocess ------------------------------------------------------------------------------

# the server's environment beyond ours (the offline engine's too): JAX takes GPU memory as it needs it
ENGINE_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def server_argv(args) -> list:
    """``m3_engine.server``'s command line (after ``python -m m3_engine.server``); the offline run reads
    its engine options from it too."""
    argv = [str(args.model), "--host", "127.0.0.1", "--port", "0", "--framework", args.framework,
            "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", "bench", "--no-access-log",
            "--max-queue", str(max(*args.num_requests, 1024))]
    for flag, value in (("--max-model-len", args.max_model_len), ("--dtype", args.dtype),
                        ("--kv-cache-dtype", args.kv_cache_dtype), ("--index-cache-dtype", args.index_cache_dtype),
                        ("--tensor-parallel-size", args.tensor_parallel_size), ("--device", args.device)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + shlex.split(args.server_args or "")


def start_server(args, log_path: Path, timeline: Path):
    """Start ``m3-serve`` (its output to ``log_path``, its engine core's step timeline to ``timeline``,
    with ``--profile-steps`` its steps' profile to ``timeline``'s folder, ``server.pstats``)
    -> (process, log file, its URL)."""
    cmd = [sys.executable, "-m", "m3_engine.server", *server_argv(args)]
    profile = {STEP_PROFILE: str(timeline.parent / "server.pstats")} if args.profile_steps else {}
    env = dict(os.environ, **ENGINE_ENV, **{STEP_TIMELINE: str(timeline)}, **profile,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log = open(log_path, "w")
    print("server:", " ".join(cmd), f"(log: {log_path})", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log_path.read_text())
        if m:
            return proc, log, f"http://127.0.0.1:{m.group(1)}/v1"
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start:\n{log_path.read_text()[-3000:]}")


def stop_server(proc, log, log_path: Path) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    log.close()
    if rc != 0:
        print(f"the server exited with {rc}:\n{log_path.read_text()[-3000:]}", flush=True)
    return rc


async def wait_healthy(ep: Endpoint, timeout: float, proc=None) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            status, body = await ep.json("GET", ep.root + "/health")
            if status == 200:
                return body
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise SystemExit(f"the server at {ep.host}:{ep.port} is not healthy after {timeout} s")


# -- offline: the same requests through the engine alone ----------------------------------------------

def offline_pass(llm, prompts: list, output_lens: list, concurrency: int, temperature: float) -> dict:
    """The requests through ``llm.engine`` as ``LLM.generate`` runs them (``add_request``, then
    ``engine.step()`` until they finish), at most ``concurrency`` in flight: a new one is added as
    soon as one finishes, as the load side's clients do (with ``concurrency >= max_num_seqs`` the
    engine runs them exactly as one ``LLM.generate`` call would).

    Each step's wall time is recorded with its decode batch: the number of requests that have their
    first token (each prefilled and running: the scheduler never preempts) when no other one can
    join the step (every request in flight has its first token, or ``max_num_seqs`` of them do: the
    step is decode-only at that batch), else 0. It is the engine's whole step seen from
    its caller: scheduling, the runner (its launches and the wait for the sampled tokens) and the
    output processor. Not meant for speculative decoding (a verify step emits several tokens).
    -> output tok/s over the pass, per-request TPOT (ms), per decode batch the count, median and
    mean of its steps (ms), and ``timing`` for the step timeline (:func:`timeline_summary`): the pass's
    ``window`` (``time.time()`` at its start and end) and ``requests``, ``(request id, added, first
    token, last token)`` in ``time.time()``, the times this loop saw them."""
    from m3_engine import SamplingParams

    engine, max_num_seqs = llm.engine, llm.scheduler_config.max_batch
    queue = list(zip(prompts, output_lens))[::-1]
    counts, first = {}, {}      # request in flight -> tokens so far; -> time of its first token
    walls = {}                  # request -> time.time() when added, of its first token, of its last
    steps, tpot, output_tokens = [], [], 0
    start, wall_start = time.perf_counter(), time.time()
    while queue or counts:
        while queue and len(counts) < concurrency:
            prompt, n = queue.pop()
            params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature)
            sent = time.time()
            request_id = engine.add_request(None, {"prompt_token_ids": prompt}, params)
            counts[request_id], walls[request_id] = 0, [sent, None, None]
        decoding = sum(1 for n in counts.values() if n)
        batch = decoding if decoding in (len(counts), max_num_seqs) else 0
        before = time.perf_counter()
        outputs = engine.step()
        now, wall = time.perf_counter(), time.time()
        steps.append((batch, now - before))
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            if n and not counts[out.request_id]:
                first[out.request_id] = now
                walls[out.request_id][1] = wall
            counts[out.request_id] = n
            walls[out.request_id][2] = wall
            if out.finished:
                del counts[out.request_id]
                output_tokens += n
                began = first.pop(out.request_id)
                if n > 1:
                    tpot.append((now - began) / (n - 1))
    duration, wall_end = time.perf_counter() - start, time.time()
    decode = []
    for batch in sorted({b for b, _ in steps if b}):
        ms = np.array([t for b, t in steps if b == batch]) * 1e3
        decode.append(dict(batch=batch, steps=len(ms), median_ms=float(np.median(ms)), mean_ms=float(ms.mean())))
    return dict(max_concurrency=concurrency, num_requests=len(prompts), duration_s=duration,
                output_tokens=output_tokens, output_throughput=output_tokens / duration, steps=len(steps),
                tpot_ms=_summary(tpot), decode_steps=decode,
                timing=dict(window=(wall_start, wall_end), requests=[(r, *w) for r, w in walls.items()]))


def run_offline(llm_class: str, model: str, options: dict, workloads: list, temperature: float,
                timeline: str, profile: Optional[str] = None) -> list:
    """``llm_class(model, **options)`` (``"m3_torch:LLM"``: the server's engine class, built with the
    server's options and environment, :data:`ENGINE_ENV`, set here first: run it in a process of its
    own), its engine core writing its step timeline to the file ``timeline``; then per workload
    ``(concurrency, prompts, output lengths)`` a warm-up pass of the same lengths (other token ids: the
    same step shapes compiled, no prefix-cache hits for what follows) and the measured pass. -> the
    measured passes (:func:`offline_pass`). ``profile``: a file for the steps' profile
    (``m3_engine.step_timeline.StepProfile``)."""
    os.environ.update(ENGINE_ENV, **{STEP_TIMELINE: timeline}, **({STEP_PROFILE: profile} if profile else {}))
    from m3_engine import load_class

    rng = np.random.default_rng(0)
    results = []
    with load_class(llm_class)(model, **options) as llm:
        for concurrency, prompts, output_lens in workloads:
            other = [rng.integers(3, llm.config.vocab_size, len(p)).tolist() for p in prompts]
            offline_pass(llm, other, output_lens, concurrency, temperature)
            results.append(offline_pass(llm, prompts, output_lens, concurrency, temperature))
    return results


def offline(llm_class: str, model: str, options: dict, workloads: list, temperature: float, timeline: str,
            profile: Optional[str] = None) -> list:
    """:func:`run_offline` in a spawned process: its GPU memory is gone when it returns (run it when
    no server holds the GPU)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_offline, llm_class, model, options, workloads, temperature, timeline,
                           profile).result()


# targets of the server against the offline engine, for rows at request rate inf: output tok/s at least
# this fraction of the offline engine's with concurrency >= max_num_seqs; TPOT p50 at most this many
# decode steps of the engine at that batch, with concurrency >= max_num_seqs and with concurrency 1
THROUGHPUT_RATIO_MIN = 0.9
TPOT_STEP_RATIO_MAX_FULL, TPOT_STEP_RATIO_MAX_ONE = 1.3, 1.2


def versus_offline(rows: list, offline_rows: list, max_num_seqs: int) -> list:
    """Per server row: the offline pass of its concurrency and request count, output tok/s of both
    and their ratio; its TPOT p50 against the engine's median decode step at batch
    ``min(concurrency, max_num_seqs)``; the targets where they apply (None elsewhere)."""
    by_workload = {(o["max_concurrency"], o["num_requests"]): o for o in offline_rows}
    out = []
    for r in rows:
        c, o = r["max_concurrency"], by_workload[r["max_concurrency"], r["num_requests"]]
        batch = min(c, max_num_seqs)
        step = next((d for d in o["decode_steps"] if d["batch"] == batch), None)
        tpot = r["tpot_ms"]["p50"]
        saturated = r["request_rate"] == "inf"
        out.append(dict(
            request_rate=r["request_rate"], max_concurrency=c, num_requests=r["num_requests"],
            offline_output_throughput=o["output_throughput"], server_output_throughput=r["output_throughput"],
            throughput_ratio=r["output_throughput"] / o["output_throughput"],
            throughput_ratio_min=THROUGHPUT_RATIO_MIN if saturated and c >= max_num_seqs else None,
            server_tpot_p50_ms=tpot, offline_tpot_p50_ms=o["tpot_ms"]["p50"], decode_batch=batch,
            decode_step_ms=step["median_ms"] if step else None, decode_steps=step["steps"] if step else 0,
            tpot_step_ratio=tpot / step["median_ms"] if step and tpot is not None else None,
            tpot_step_ratio_max=(TPOT_STEP_RATIO_MAX_ONE if c == 1 else TPOT_STEP_RATIO_MAX_FULL
                                 if c >= max_num_seqs else None) if saturated else None))
    return out


# -- the step profile: the host time of the steps' functions, server and offline ----------------------------

def profile_markdown(profiles: dict, top: int = 20) -> list:
    """The "Step profile" section from ``{name: (pstats file, steps it holds)}`` (``--profile-steps``; the
    steps are its engine's timeline lines, warm-up passes included): per function, its calls and its own
    time (cProfile's tottime) per call in microseconds, for the functions with the most own time in any
    of them. The engines ran different step mixes (the offline one warms up every row), so their time
    per step is not comparable; the time per call of the same function is."""
    import pstats

    found = {}
    for name, (path, steps) in profiles.items():
        if Path(path).is_file() and steps:
            found[name] = (steps, {f"{Path(f).name}:{line} {fn}": (v[1], v[2])
                                   for (f, line, fn), v in pstats.Stats(str(path)).stats.items()})
    if not found:
        return []
    names = list(found)
    keys = sorted({k for _, funcs in found.values() for k in funcs},
                  key=lambda k: -max(funcs.get(k, (0, 0.0))[1] for _, funcs in found.values()))[:top]
    lines = ["## Step profile", "", "cProfile over the engine cores' step calls (M3_STEP_PROFILE), warm-up "
             "passes included; its overhead included. Per function: calls per step, own time (tottime) per "
             "call in us.", "",
             "| function | " + " | ".join(f"{n}: calls / step | {n}: us / call" for n in names) + " |",
             "|---|" + "---|---|" * len(names),
             "| all (s, steps) | " + " | ".join(f"{found[n][0]} steps | {sum(t for _, t in found[n][1].values()):.2f} s"
                                             for n in names) + " |"]
    for k in keys:
        cells = []
        for n in names:
            steps, funcs = found[n]
            calls, seconds = funcs.get(k, (0, 0.0))
            cells.append(f"{calls / steps:.2f} | {seconds / calls * 1e6:.2f}" if calls else "0 | -")
        lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
    return lines


# -- the step timeline: where the time goes, server and offline --------------------------------------------

def timeline_summary(lines: list, timing: dict) -> dict:
    """One row's view of the engine core's step timeline (``m3_engine.step_timeline``): ``lines`` the
    file's steps, ``timing`` the row's (:func:`run_row`, :func:`offline_pass`): its ``window`` and, per
    request, ``(core request id, sent, first token, last token)`` as its client saw them. The row's
    steps are those that started in its window. Times in seconds, lags in ms:

    * ``generation_rows``: per step, on average (a batch that drains while requests change hands
      shows here);
    * ``busy_s``: the steps' wall time (``execute_step`` calls), ``longest_step_ms`` the longest (a
      compile or a CUDA graph capture on the request path shows here); ``device_wait_s`` the part of
      it waiting for the device; ``core_idle_s``: the window less ``busy_s`` (the core's caller at
      work, or waiting for requests); ``gaps_s``: the part of it between the row's steps;
    * ``first_arrival_ms``: the row's first request, sent -> added to the core; ``arrival_ms``:
      the same over all requests (p50, p99);
    * ``first_token_lag_ms`` / ``last_token_lag_ms``: the end of the step that made a request's
      first / last token -> its client had it (p50, p99)."""
    start, end = timing["window"]
    steps = [s for s in lines if start <= s["start"] <= end]
    prefill = [s for s in steps if s["prompt_tokens"]]
    added, first_done, last_done = {}, {}, {}
    for s in steps:
        added.update(s["added"])
        first_done.update((r, s["end"]) for r in s["first"])
        last_done.update((r, s["end"]) for r in s["finished"])
    requests = timing["requests"]
    busy = sum(s["end"] - s["start"] for s in steps)
    arrival = [added[r] - sent for r, sent, _, _ in requests if r in added]
    first_sent = min(requests, key=lambda x: x[1], default=None)
    return dict(
        wall_s=end - start, steps=len(steps), prefill_steps=len(prefill),
        generation_rows=sum(s["generation_rows"] for s in steps) / len(steps) if steps else None,
        prompt_tokens_per_prefill_step=sum(s["prompt_tokens"] for s in prefill) / len(prefill) if prefill else None,
        busy_s=busy, longest_step_ms=max((s["end"] - s["start"] for s in steps), default=0.0) * 1e3,
        device_wait_s=sum(s["device_wait"] for s in steps), core_idle_s=end - start - busy,
        gaps_s=sum(s["since_last"] for s in steps[1:]),
        first_arrival_ms=(added[first_sent[0]] - first_sent[1]) * 1e3 if first_sent and first_sent[0] in added
        else None,
        arrival_ms=_summary(arrival),
        first_token_lag_ms=_summary([t - first_done[r] for r, _, t, _ in requests if r in first_done]),
        last_token_lag_ms=_summary([t - last_done[r] for r, _, _, t in requests if r in last_done]))


# -- report ---------------------------------------------------------------------------------------------

def _fmt(v, spec="{:.1f}") -> str:
    return "-" if v is None else spec.format(v)


def markdown(result: dict) -> str:
    s = result["setup"]
    lines = [f"# m3-serve load test ({result['date']})", "",
             f"Server: {s['server']}. Model: {s['model']}. Requests per row: "
             f"{', '.join(map(str, s['num_requests']))} (per concurrency), prompt "
             f"{s['input_len']} and output {s['output_len']} tokens (range ratio {s['range_ratio']}), temperature "
             f"{s['temperature']}, streamed /v1/completions with ignore_eos. Command: `{result['command']}`.", "",
             *([f"GPU: {s['gpu']}; copy bandwidth (same run, before the server started): "
                f"{s['copy_tbps']:.2f} TB/s.", ""] if s.get("gpu") else []),
             "Times in ms: TTFT = request sent -> first token; TPOT = (last - first token) / (tokens - 1) per "
             "request; ITL = between token chunks; E2E = whole request.", "",
             "| rate (req/s) | concurrency | done / failed | req/s | out tok/s | total tok/s | TTFT p50 | TTFT p99 | "
             "TPOT p50 | TPOT p99 | ITL p50 | ITL p99 | E2E p50 | E2E p99 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['request_rate']} | {r['max_concurrency']} | {r['completed']} / {r['failed']} | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {r['total_token_throughput']:.1f} | "
            + " | ".join(_fmt(r[f"{k}_ms"][q]) for k in ("ttft", "tpot", "itl", "e2e") for q in ("p50", "p99"))
            + " |")
    problems = [f"- rate {r['request_rate']}, concurrency {r['max_concurrency']}: "
                + "; ".join(filter(None, [f"{r['failed']} failed ({'; '.join(r['errors'])})" if r["failed"] else "",
                                          f"{r['short_outputs']} outputs short" if r["short_outputs"] else "",
                                          "server not idle afterwards" if not r["server_idle_after"] else "",
                                          f"server counted {r['server_generation_tokens']:.0f} generated tokens"
                                          if r["server_generation_tokens"] and abs(
                                              r["server_generation_tokens"] - r["mean_output_len"] * r["completed"])
                                          > 0.5 else ""]))
                for r in result["rows"] if r["failed"] or r["short_outputs"] or not r["server_idle_after"]]
    if problems:
        lines += ["", "Problems:", *problems]
    if result.get("versus_offline"):
        lines += ["", "## Server vs offline", "",
                  f"Offline: {s['offline']}. Per row: offline out tok/s over the measured pass; the engine's "
                  "decode step = median wall time of `llm.engine.step()` over that pass's decode-only steps at "
                  "batch min(concurrency, max_num_seqs) (host work included: scheduling, the runner's launches "
                  "and its wait for the sampled tokens, the output processor); TPOT p50 in ms. Targets (rate inf "
                  f"rows): server / offline >= {THROUGHPUT_RATIO_MIN} with concurrency >= max_num_seqs; TPOT p50 "
                  f"<= {TPOT_STEP_RATIO_MAX_FULL} decode steps there and <= {TPOT_STEP_RATIO_MAX_ONE} at "
                  "concurrency 1.", "",
                  "| rate | concurrency | requests | offline out tok/s | server out tok/s | server / offline | "
                  "target | offline TPOT p50 | server TPOT p50 | decode step (batch: ms, steps) | server TPOT / step | "
                  "target |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for v in result["versus_offline"]:
            lines.append(
                f"| {v['request_rate']} | {v['max_concurrency']} | {v['num_requests']} | "
                f"{v['offline_output_throughput']:.1f} | {v['server_output_throughput']:.1f} | "
                f"{v['throughput_ratio']:.3f} | {_target(v['throughput_ratio'], v['throughput_ratio_min'], '>=')} | "
                f"{_fmt(v['offline_tpot_p50_ms'], '{:.2f}')} | {_fmt(v['server_tpot_p50_ms'], '{:.2f}')} | "
                f"{v['decode_batch']}: {_fmt(v['decode_step_ms'], '{:.2f}')}, {v['decode_steps']} | "
                f"{_fmt(v['tpot_step_ratio'], '{:.3f}')} | "
                f"{_target(v['tpot_step_ratio'], v['tpot_step_ratio_max'], '<=')} |")
    lines += timeline_markdown(result)
    return "\n".join(lines) + "\n"


# the step timeline table's lines: (label, the summary's key, its p50 / p99 or None, format)
TIMELINE_LINES = (("wall time of the row (s)", "wall_s", None, "{:.3f}"),
                  ("steps", "steps", None, "{}"),
                  ("generation rows / step (mean)", "generation_rows", None, "{:.1f}"),
                  ("steps with prefill", "prefill_steps", None, "{}"),
                  ("prompt tokens / prefill step", "prompt_tokens_per_prefill_step", None, "{:.0f}"),
                  ("busy: steps' wall time (s)", "busy_s", None, "{:.3f}"),
                  ("  of it waiting for the device (s)", "device_wait_s", None, "{:.3f}"),
                  ("longest step (ms)", "longest_step_ms", None, "{:.1f}"),
                  ("core idle: wall - busy (s)", "core_idle_s", None, "{:.3f}"),
                  ("  of it between the row's steps (s)", "gaps_s", None, "{:.3f}"),
                  ("first request: sent -> in the core (ms)", "first_arrival_ms", None, "{:.2f}"),
                  ("sent -> in the core, p50 (ms)", "arrival_ms", "p50", "{:.2f}"),
                  ("sent -> in the core, p99 (ms)", "arrival_ms", "p99", "{:.2f}"),
                  ("first token: step end -> client, p50 (ms)", "first_token_lag_ms", "p50", "{:.2f}"),
                  ("first token: step end -> client, p99 (ms)", "first_token_lag_ms", "p99", "{:.2f}"),
                  ("last token: step end -> client, p50 (ms)", "last_token_lag_ms", "p50", "{:.2f}"),
                  ("last token: step end -> client, p99 (ms)", "last_token_lag_ms", "p99", "{:.2f}"))


def timeline_markdown(result: dict) -> list:
    """The "Step timeline" section: per row, the server's and the offline engine's
    :func:`timeline_summary` side by side ([] when there is none)."""
    offline = {(o["max_concurrency"], o["num_requests"]): o for o in result.get("offline") or ()}
    columns = []   # (title, summary)
    for r in result["rows"]:
        o = offline.get((r["max_concurrency"], r["num_requests"]))
        label = f"rate {r['request_rate']}, c {r['max_concurrency']}"
        columns += [(f"server, {label}", r.get("timeline"))] + ([(f"offline, {label}", o.get("timeline"))] if o else [])
    if not any(summary for _, summary in columns):
        return []
    lines = ["", "## Step timeline", "",
             "The engine core's steps (m3_engine.step_timeline) in each row's window: a step is one "
             "`execute_step` call on the host; sent = the client sent the request (offline: `add_request`); "
             "client = its client had the token (offline: `engine.step()` returned it).", "",
             "| | " + " | ".join(title for title, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    for label, key, quantile, spec in TIMELINE_LINES:
        cells = []
        for _, summary in columns:
            value = None if summary is None else summary[key] if quantile is None else summary[key][quantile]
            cells.append(_fmt(value, spec))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _target(value, bound, relation: str) -> str:
    """``">= 0.9 met"`` / ``"<= 1.3 MISSED"``; ``-`` where no target applies."""
    if bound is None:
        return "-"
    met = value is not None and (value >= bound if relation == ">=" else value <= bound)
    return f"{relation} {bound} {'met' if met else 'MISSED'}"


def _floats(text: str) -> list:
    return [math.inf if x.strip() in ("inf", "Inf") else float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_argument_group("server")
    where.add_argument("--model", type=Path, default=None, help="model folder (the server is started here)")
    where.add_argument("--url", default=None, help="an already running server, e.g. http://127.0.0.1:8000/v1")
    where.add_argument("--api-key", default=os.environ.get("M3_API_KEY"))
    where.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny test model and a small load")
    where.add_argument("--e2e-model", action="store_true", help="write benchmarks.e2e's random M3-shaped model "
                       "into --model first (when it has no config.json)")
    where.add_argument("--framework", choices=("torch", "jax"), default="torch")
    where.add_argument("--max-num-seqs", type=int, default=64)
    where.add_argument("--max-model-len", type=int, default=None, help="default: the longest prompt + output")
    where.add_argument("--dtype", default=None)
    where.add_argument("--device", default=None)
    where.add_argument("--kv-cache-dtype", default=None)
    where.add_argument("--index-cache-dtype", default=None)
    where.add_argument("--tensor-parallel-size", type=int, default=None)
    where.add_argument("--server-args", default="", help="more m3-serve flags, e.g. \"--max-num-batched-tokens 8192\"")
    where.add_argument("--start-timeout", type=float, default=1800.0)
    load = ap.add_argument_group("load")
    load.add_argument("--num-requests", type=_ints, default=[256], help="requests per row; a comma list gives "
                      "one per --max-concurrency value (e.g. 128,16 with --max-concurrency 64,1)")
    load.add_argument("--request-rate", type=_floats, default=[math.inf], help="req/s, Poisson; a comma list "
                      "(inf = all at once; default inf)")
    load.add_argument("--max-concurrency", type=_ints, default=[64], help="in-flight limit; a comma list")
    load.add_argument("--input-len", type=int, default=1024)
    load.add_argument("--output-len", type=int, default=128)
    load.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in L*(1-r)..L*(1+r)")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--warmup", type=int, default=None, help="requests run before measuring, of --input-len "
                      "and --output-len tokens, at most the largest --max-concurrency in flight (default: one round "
                      "of max concurrency, at most 16)")
    load.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offline", action="store_true", help="after the server stopped: the same requests through "
                    "the engine alone (m3_<framework>.LLM with the server's engine options, in a process of its own) "
                    "and a server-vs-offline table")
    ap.add_argument("--profile-steps", action="store_true", help="the engine cores' steps under cProfile "
                    "(M3_STEP_PROFILE): the functions with the most host time per step, server and offline side by "
                    "side (steps-*.pstats with --out)")
    ap.add_argument("--out", default=None, help="write serve.json and serve.md here")
    return ap


def main(argv=None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    tmp = None
    if args.tiny:
        defaults = dict(num_requests=[8], input_len=16, output_len=4, max_num_seqs=8, max_model_len=512, device="cpu",
                        warmup=1)
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        for name, value in defaults.items():
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
        if args.request_rate == [math.inf] and "--max-concurrency" not in given:
            args.max_concurrency = [8]
        if args.model is None and args.url is None:
            from m3_engine.tiny_model import write_tiny_checkpoint
            tmp = tempfile.TemporaryDirectory()
            args.model = write_tiny_checkpoint(Path(tmp.name) / "tiny", seed=0)
    if (args.model is None) == (args.url is None):
        ap.error("expected one of --model DIR (start a server) or --url URL (use a running one)")
    if args.offline and args.url is not None:
        ap.error("--offline: needs --model (a server started here, whose engine options the offline engine takes)")
    if len(args.num_requests) not in (1, len(args.max_concurrency)):
        ap.error(f"--num-requests: expected one count or one per --max-concurrency value "
                 f"({len(args.max_concurrency)}), got {len(args.num_requests)}")
    args.num_requests = args.num_requests * len(args.max_concurrency) if len(args.num_requests) == 1 \
        else args.num_requests
    longest = int(args.input_len * (1 + args.range_ratio)) + int(args.output_len * (1 + args.range_ratio))
    if args.model is not None:
        if args.max_model_len is None:
            args.max_model_len = -(-longest // 128) * 128
        if args.e2e_model and not (args.model / "config.json").is_file():
            from benchmarks.e2e import M3_SHAPES, write_model
            print(f"writing benchmarks.e2e's model to {args.model} ...", flush=True)
            write_model(args.model, M3_SHAPES, max(args.max_model_len, 4096))
    args.gpu = args.copy_tbps = None
    if args.model is not None and args.device != "cpu":   # the server's GPU, measured here before it starts
        import torch
        if torch.cuda.is_available():
            from benchmarks.run import copy_bandwidth
            args.gpu, args.copy_tbps = torch.cuda.get_device_name(), copy_bandwidth() / 1e12
            torch.cuda.empty_cache()
    try:
        return asyncio.run(_main(args, argv, longest))
    finally:
        if tmp is not None:
            tmp.cleanup()


async def _main(args, argv, longest) -> dict:
    # the engine cores' step timelines (server.jsonl, offline.jsonl), removed whatever happens
    with tempfile.TemporaryDirectory(prefix="m3-timeline-") as timelines:
        return await _run(args, argv, longest, Path(timelines))


async def _run(args, argv, longest, timelines: Path) -> dict:
    proc = log = None
    log_path = Path(tempfile.mkstemp(prefix="m3-serve-", suffix=".log")[1])
    if args.url is None:
        proc, log, url = start_server(args, log_path, timelines / "server.jsonl")
    else:
        url = args.url
    ep = Endpoint(url, args.api_key)
    rc = None
    try:
        health = await wait_healthy(ep, args.start_timeout, proc)
        status, models = await ep.json("GET", ep.prefix + "/models")
        if status != 200:
            raise SystemExit(f"GET /v1/models: {status} {models}")
        card = models["data"][0]
        model, vocab = card["id"], card.get("vocab_size") or 32768
        if card.get("max_model_len") and longest > card["max_model_len"]:
            raise SystemExit(f"prompt + output up to {longest} tokens, more than the server's context "
                             f"({card['max_model_len']})")
        warm = args.warmup if args.warmup is not None else min(max(args.max_concurrency), 16)
        if warm:   # the rows' lengths and in-flight limit: their step shapes (decode batches too) compiled
            print(f"warm-up: {warm} requests ...", flush=True)
            rng = random.Random(args.seed + 1)
            gate = asyncio.Semaphore(max(args.max_concurrency))

            async def warm_up_request():
                async with gate:
                    return await one_request(ep, model, [rng.randrange(3, vocab) for _ in range(args.input_len)],
                                             args.output_len, args.temperature)

            records = await asyncio.gather(*[warm_up_request() for _ in range(warm)])
            errors = [r["error"] for r in records if r["error"]]
            if errors:
                raise SystemExit(f"warm-up failed: {errors[0]}")
        rows = []
        for rate in args.request_rate:
            for concurrency, num_requests in zip(args.max_concurrency, args.num_requests):
                print(f"rate {rate} req/s, concurrency {concurrency}: {num_requests} requests ...", flush=True)
                row = await run_row(ep, model, vocab, args, rate, concurrency, num_requests, args.seed)
                rows.append(row)
                print(f"  {row['completed']} done, {row['failed']} failed in {row['duration_s']:.1f} s: "
                      f"{row['request_throughput']:.2f} req/s, {row['output_throughput']:.1f} out tok/s, TTFT p50 "
                      f"{_fmt(row['ttft_ms']['p50'])} ms, TPOT p50 {_fmt(row['tpot_ms']['p50'], '{:.2f}')} ms",
                      flush=True)
    finally:
        if proc is not None:
            rc = stop_server(proc, log, log_path)
    offline_rows = versus = offline_setup = None
    if args.offline:   # the server has stopped: the GPU is the offline engine's
        from m3_engine.args import engine_options
        from m3_engine.server.cli import build_parser as server_parser

        options = engine_options(server_parser().parse_args(server_argv(args)))
        llm_class = f"m3_{args.framework}:LLM"
        workloads = [(c, *make_requests(random.Random(args.seed), args, n, vocab))
                     for c, n in dict.fromkeys(zip(args.max_concurrency, args.num_requests))]
        print(f"offline: {llm_class} with the server's engine options, concurrency "
              f"{', '.join(str(c) for c, *_ in workloads)} ...", flush=True)
        offline_rows = offline(llm_class, str(args.model), options, workloads, args.temperature,
                               str(timelines / "offline.jsonl"),
                               str(timelines / "offline.pstats") if args.profile_steps else None)
        versus = versus_offline(rows, offline_rows, options["max_num_seqs"])
        offline_setup = (f"`{llm_class}` with the server's engine options, in a process of its own after the "
                         "server stopped; per concurrency a warm-up pass (the same lengths, other token ids), then "
                         "the row's requests (the same prompt token ids and output lengths, ignore_eos) through "
                         "LLM.generate's loop with at most that many in flight")
    steps = {}   # the engine cores' timeline lines, by side
    for found, name in ((rows, "server"), (offline_rows or [], "offline")):
        lines = steps[name] = read_timeline(timelines / f"{name}.jsonl")   # none from a server elsewhere (--url)
        for r in found:
            timing = r.pop("timing")
            r["timeline"] = timeline_summary(lines, timing) if lines else None
    server = (f"m3-serve {args.framework}, max_num_seqs {args.max_num_seqs}, max_model_len {args.max_model_len}"
              + (f", tp {args.tensor_parallel_size}" if args.tensor_parallel_size else "")
              + (f", dtype {args.dtype}" if args.dtype else "")
              + (f", kv cache {args.kv_cache_dtype}" if args.kv_cache_dtype else "")
              + (f" {args.server_args}" if args.server_args else "")) if args.url is None else f"{url}"
    result = dict(date=time.strftime("%Y-%m-%d"), command="python3 -m benchmarks.serve " + " ".join(
        argv if argv is not None else sys.argv[1:]), setup=dict(
        server=server, model=str(args.model) if args.model else card.get("root"), health=health,
        num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, temperature=args.temperature, server_exit_status=rc, gpu=args.gpu,
        copy_tbps=args.copy_tbps, offline=offline_setup), rows=rows, offline=offline_rows, versus_offline=versus)
    text = markdown(result)
    if args.profile_steps:
        text += "\n" + "\n".join(profile_markdown({
            name: (timelines / f"{name}.pstats", len(steps[name]))
            for name in ("server", "offline")}))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "serve.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "serve.md"), "w") as f:
            f.write(text)
        for name in ("server", "offline"):
            if (timelines / f"{name}.jsonl").is_file():
                shutil.copy(timelines / f"{name}.jsonl", os.path.join(args.out, f"timeline-{name}.jsonl"))
            if (timelines / f"{name}.pstats").is_file():
                shutil.copy(timelines / f"{name}.pstats", os.path.join(args.out, f"steps-{name}.pstats"))
    print(text)
    if rc not in (None, 0):
        raise SystemExit(f"the server exited with {rc}")
    return result


if __name__ == "__main__":
    main()
