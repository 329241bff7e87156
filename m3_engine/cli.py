"""``m3-generate``: complete prompts with a MiniMax-M3 checkpoint through the torch or the JAX engine.

    m3-generate --model DIR --prompt "The quick brown fox" --max-tokens 32
    m3-generate --model DIR --prompt "Hi" --prompt "Hello" --temperature 0 --json
    m3-generate --model DIR --chat --prompts-file questions.txt --temperature 0.7 --top-p 0.9 --sampling-seed 1
    m3-generate --model DIR --prompts-file batch.jsonl --logprobs 5 --json > out.jsonl
    cat prompts.txt | python -m m3_engine.cli --framework jax --model DIR --stop "\\n\\n"
    m3-generate --framework jax --model DIR --prompt-ids 1,2,3 -tp 2 --device cpu

Prompts, in command-line order: ``--prompt TEXT``, ``--prompt-ids 1,2,3``,
``--prompts-file PATH`` (``-`` is stdin), all repeatable; with none of them,
one prompt per line of stdin (when stdin is not a terminal). A prompts file is
text (one prompt per line; blank lines are skipped) or JSONL (a ``.jsonl``
name, or a first non-blank line that is a JSON string or object): each line a
JSON string, or an object with ``"prompt"`` (text), ``"prompt_token_ids"``
(ids) or ``"messages"`` (a conversation, rendered with the model's chat
template). ``--chat`` sends each text prompt as one user message through the
chat template.

Sampling follows ``SamplingParams`` (vLLM's meanings): an option left out
keeps its default there, which the model folder's ``generation_config.json``
may replace (temperature, top_p, top_k, min_p, max_new_tokens; ``do_sample:
false`` means greedy). So without ``--temperature`` the CLI SAMPLES at
temperature 1.0 unless the model says otherwise; ``--temperature 0`` is greedy.
``--sampling-seed N`` seeds every prompt's sampling: a prompt's tokens then
depend only on the prompt, the options and N, not on the other prompts;
without it they come from the engine's ``--seed`` (0) and the prompt's
position, so runs repeat too.

Engine flags (``--dtype``, ``--max-num-seqs``, ``--max-model-len``,
``-tp/--tensor-parallel-size``, ...): one per ``m3_engine.args.EngineArgs``
field, vLLM's names, with its default and help (``add_engine_flags``); the
same as ``m3-serve``'s.

Output: per prompt a header and the generated text (the ids when the model has
no tokenizer), then one summary line on stderr; ``--json``: one JSON object per
prompt on stdout instead (prompt, prompt_token_ids, text, token_ids,
finish_reason, stop_reason, and with ``--logprobs`` logprobs and
cumulative_logprob). A progress bar (tqdm) goes to stderr when it is a terminal.

Everything is checked before a framework is imported: the options (by
``m3_engine.args.EngineArgs`` and ``SamplingParams``, whose messages name the
option), the prompts (read, tokenized, rendered, checked against the
vocabulary and ``--max-model-len``). A user error -- a bad option, a missing
model folder, a bad prompt, a framework that cannot be imported, an engine
``ValueError``/``TypeError``/``FileNotFoundError`` -- is one ``error: ...``
line on stderr and exit status 2; another failure is one line and status 1
(130 for Ctrl-C). ``--debug`` adds the traceback.

JAX tensor parallelism on a CPU: with ``--framework jax --tensor-parallel-size
N`` (N > 1) on the CPU -- ``--device cpu``, or no ``--device`` and no GPU
visible (``CUDA_VISIBLE_DEVICES`` empty or ``-1``, ``JAX_PLATFORMS`` without
cuda/gpu, or no ``/dev/nvidia<N>``) -- the CLI adds
``--xla_force_host_platform_device_count=N`` to ``XLA_FLAGS`` (unless it
already names a count) and sets ``PJRT_NPROC=N+1`` (unless set) before JAX is
imported: N fake CPU devices, and a CPU thread more than devices for the
interpreted kernels' callbacks (``m3_jax.runner``).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

from . import engine_class
from .args import ArgumentParser, EngineArgs, UsageError, add_engine_flags, engine_flags, engine_options, flag_message
from .sampling_params import SamplingParams
from .tokenizer import check_messages, load_tokenizer

__all__ = ["main", "build_parser", "version"]

FRAMEWORKS = ("torch", "jax")
DISTRIBUTION = "m3-msa-kernels"

# the leading name of a SamplingParams / an engine message -> the option that sets it
_SAMPLING_OPTION_OF = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                       "top_k": "--top-k", "min_p": "--min-p", "seed": "--sampling-seed", "stop": "--stop",
                       "logprobs": "--logprobs"}
_ENGINE_OPTION_OF = {"model": "--model", "model_dir": "--model", **engine_flags()}


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return dist_version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed)"


class _AppendPrompt(argparse.Action):
    """--prompt / --prompt-ids / --prompts-file: one list of (kind, value) in command-line order."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), (self.const, values)])


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="m3-generate", allow_abbrev=False,
                       description="Complete prompts with a MiniMax-M3 checkpoint through the MSA kernels "
                       "(m3_torch.LLM or m3_jax.LLM, vLLM's API).",
                       epilog="Without --prompt/--prompt-ids/--prompts-file, prompts are read from stdin, one "
                       "per line. Sampling options left out keep SamplingParams' defaults (vLLM's), which the "
                       "model's generation_config.json may replace: without --temperature the CLI samples at "
                       "temperature 1.0 unless the model says otherwise; --temperature 0 is greedy. Errors: one "
                       "'error:' line on stderr, exit status 2.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--model", required=True, type=Path, metavar="DIR",
                   help="folder with config.json, *.safetensors (tokenizer.json for text prompts)")
    p.add_argument("--framework", default="torch", choices=FRAMEWORKS,
                   help="engine: m3_torch.LLM or m3_jax.LLM (default: torch)")

    g = p.add_argument_group("prompts (repeatable, kept in command-line order; none: stdin, one per line)")
    g.add_argument("--prompt", dest="sources", action=_AppendPrompt, const="text", metavar="TEXT",
                   help="a text prompt")
    g.add_argument("--prompt-ids", dest="sources", action=_AppendPrompt, const="ids", metavar="IDS",
                   help="a prompt of token ids, e.g. 1,2,3")
    g.add_argument("--prompts-file", dest="sources", action=_AppendPrompt, const="file", metavar="PATH",
                   help="text (a prompt per line) or JSONL (a JSON string or an object with 'prompt', "
                        "'prompt_token_ids' or 'messages' per line); - is stdin")
    g.add_argument("--chat", action="store_true",
                   help="send each text prompt as one user message through the model's chat template")

    g = p.add_argument_group("sampling (SamplingParams; left out: its default or generation_config.json's)")
    g.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, metavar="N",
                   help="tokens to generate at most per prompt (default: 16, or generation_config.json's)")
    g.add_argument("--temperature", type=float, metavar="T",
                   help="0 = greedy (default: 1.0, or generation_config.json's)")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus mass in (0, 1] (default: 1 = off)")
    g.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (default: -1 = off)")
    g.add_argument("--min-p", type=float, metavar="P", help="min probability relative to the top one, in [0, 1] "
                   "(default: 0 = off)")
    g.add_argument("--sampling-seed", type=int, metavar="N", help="every prompt samples with this seed "
                   "(default: derived from the engine's --seed and the prompt's position)")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop when the text contains TEXT (repeatable; "
                   "TEXT is cut from the output)")
    g.add_argument("--logprobs", type=int, metavar="N", help="per generated token, the logprobs of the N most "
                   "likely tokens and of the sampled one (N in [0, 20])")

    add_engine_flags(p)

    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    g.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


# -- prompts -----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Prompt:
    """One prompt as given: exactly one of text, ids, messages."""
    where: str                       # for messages: "--prompt 2", "a.jsonl line 3", "<stdin> line 1"
    text: Optional[str] = None
    ids: Optional[list] = None
    messages: Optional[list] = None


def _read_prompts(sources: list, stdin) -> list:
    prompts, counts = [], {}
    for kind, value in sources:
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "text":
            prompts.append(_Prompt(f"--prompt {counts[kind]}", text=value))
        elif kind == "ids":
            prompts.append(_Prompt(f"--prompt-ids {counts[kind]}", ids=_token_ids(value, f"--prompt-ids {value!r}")))
        elif value == "-":
            try:
                lines = stdin.read().splitlines()
            except UnicodeDecodeError as e:
                raise UsageError(f"<stdin>: {e}") from None
            prompts += _prompts_of_lines(lines, "<stdin>", jsonl=None)
        else:
            path = Path(value)
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"--prompts-file {value}: {e.strerror if isinstance(e, OSError) else e}") from None
            prompts += _prompts_of_lines(lines, value, jsonl=True if path.suffix == ".jsonl" else None)
    return prompts


def _prompts_of_lines(lines: list, name: str, *, jsonl: Optional[bool]) -> list:
    """Text (a prompt per non-blank line) or JSONL lines -> prompts. ``jsonl`` None: JSONL when
    the first non-blank line is a JSON string or object."""
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if jsonl is None:
        jsonl = bool(numbered) and isinstance(_json_or_none(numbered[0][1]), (str, dict))
    if not jsonl:
        return [_Prompt(f"{name} line {n}", text=line) for n, line in numbered]
    prompts = []
    for n, line in numbered:
        where = f"{name} line {n}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not JSON ({e.msg} at column {e.colno}); a JSONL prompts file has a JSON "
                             f"string or object on every line") from None
        if isinstance(value, str):
            prompts.append(_Prompt(where, text=value))
            continue
        keys = sorted(value) if isinstance(value, dict) else []
        if len(keys) != 1 or keys[0] not in ("prompt", "prompt_token_ids", "messages"):
            raise UsageError(f"{where}: expected a JSON string or an object with one of 'prompt', "
                             f"'prompt_token_ids', 'messages', got {_short(line)}")
        [key], item = keys, value[keys[0]]
        if key == "prompt":
            if not isinstance(item, str):
                raise UsageError(f"{where}: 'prompt' must be a string, got {type(item).__name__}")
            prompts.append(_Prompt(where, text=item))
        elif key == "prompt_token_ids":
            if not isinstance(item, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in item):
                raise UsageError(f"{where}: 'prompt_token_ids' must be a list of ints, got {_short(item)}")
            prompts.append(_Prompt(where, ids=item))
        else:
            prompts.append(_Prompt(where, messages=item))
    return prompts


def _json_or_none(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _token_ids(text: str, where: str) -> list:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UsageError(f"{where}: expected comma-separated token ids like 1,2,3") from None
    return ids


@dataclasses.dataclass
class _Encoded:
    """A prompt ready for ``LLM.generate``, and what the output shows of it."""
    request: dict                    # {"prompt": text, "prompt_token_ids": ids} or {"prompt_token_ids": ids}
    label: str                       # the human header's view of the prompt
    messages: Optional[list] = None


def _encode(prompts: list, tokenizer, *, vocab_size: int, max_model_len: int, chat: bool) -> list:
    """Tokenize (and render chats) here, before any framework is imported; check every prompt."""
    encoded = []
    for p in prompts:
        text, ids, messages = p.text, p.ids, p.messages
        if chat and text is not None:
            messages, text = [{"role": "user", "content": text}], None
        if chat and ids is not None:
            raise UsageError(f"{p.where}: --chat needs text prompts, got token ids")
        if (text is not None or messages is not None) and tokenizer is None:
            raise UsageError(f"{p.where}: the model folder has no tokenizer.json: give token ids (--prompt-ids, "
                             f"or 'prompt_token_ids' in a JSONL file)")
        if messages is not None:
            try:
                check_messages(messages)
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except Exception as e:   # TypeError/ValueError of the checks, a jinja2 error of the template
                raise UsageError(f"{p.where}: {_message(e)}") from None
            ids = tokenizer.encode(text, add_special_tokens=False)   # the template writes the special tokens
            label = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), None) or text
        elif text is not None:
            ids = tokenizer.encode(text)
            label = text
        else:
            label = "ids " + ",".join(map(str, ids[:16])) + (",..." if len(ids) > 16 else "")
        if not ids:
            raise UsageError(f"{p.where}: empty prompt" + (f" ({text!r} encodes to no tokens)" if text else ""))
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise UsageError(f"{p.where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if len(ids) > max_model_len:
            raise UsageError(f"{p.where}: {len(ids)} tokens, longer than --max-model-len {max_model_len} (the KV "
                             f"tokens per request, prompt + generated)")
        request = {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}
        encoded.append(_Encoded(request, label, messages))
    return encoded


# -- JAX on CPU devices --------------------------------------------------------------------------

def _gpu_visible(environ) -> bool:
    """A guess, without importing a framework: is a GPU there for JAX to use?"""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(name in platforms for name in ("cuda", "gpu", "rocm")):
        return False
    if environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def prepare_jax_cpu_devices(framework: str, tensor_parallel_size: int, device: Optional[str],
                            environ=None) -> bool:
    """For JAX tensor parallelism on the CPU, N fake CPU devices and N+1 CPU threads (set in
    ``environ`` before JAX initialises); -> whether this applied."""
    environ = os.environ if environ is None else environ
    n = tensor_parallel_size
    if framework != "jax" or n <= 1:
        return False
    platform = None if device is None else device.strip().lower().partition(":")[0]
    if platform not in ("cpu", None) or platform is None and _gpu_visible(environ):
        return False
    flags = environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    environ.setdefault("PJRT_NPROC", str(n + 1))
    return True


# -- main ----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    """Run the CLI; -> the exit status (0 done, 2 a user error, 1 another failure, 130 interrupted)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    debug = "--debug" in argv
    try:
        return _run(build_parser().parse_args(argv))
    except SystemExit as e:   # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        _error("interrupted", debug)
        return 130
    except UsageError as e:
        _error(str(e), debug)
        return 2
    except BrokenPipeError:   # stdout closed early (| head): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 1
    except Exception as e:
        _error(f"{type(e).__name__}: {_message(e)} (--debug shows the traceback)", debug)
        return 1


def _error(message: str, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()


def _message(e: BaseException) -> str:
    """An exception's message (a KeyError's without its quotes)."""
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def _user_error(e: BaseException, option_of: dict = _ENGINE_OPTION_OF) -> UsageError:
    """An engine (or, with ``_SAMPLING_OPTION_OF``, a SamplingParams) error -> a UsageError naming
    the CLI option."""
    return UsageError(flag_message(_message(e), option_of))


_USER_ERRORS = (ValueError, TypeError, FileNotFoundError, KeyError)


def _run(args) -> int:
    # 1. everything checked, nothing framework-specific imported
    options = engine_options(args)
    try:
        checked = EngineArgs(args.model, **options).check()
    except _USER_ERRORS as e:
        raise _user_error(e) from e
    sampling = {name: value for name, value in (
        ("max_tokens", args.max_tokens), ("temperature", args.temperature), ("top_p", args.top_p),
        ("top_k", args.top_k), ("min_p", args.min_p), ("seed", args.sampling_seed),
        ("stop", args.stop), ("logprobs", args.logprobs)) if value is not None}
    try:
        params = SamplingParams(**sampling)
    except _USER_ERRORS as e:
        raise _user_error(e, _SAMPLING_OPTION_OF) from e

    sources = args.sources or []
    if not sources:
        stdin = sys.stdin
        if stdin is None or _isatty(stdin):
            raise UsageError("no prompt: give --prompt, --prompt-ids or --prompts-file, or pipe prompts (one per "
                             "line) to stdin")
        sources = [("file", "-")]
    prompts = _read_prompts(sources, sys.stdin)
    if not prompts:
        raise UsageError("no prompt: the prompts file(s) or stdin had no non-blank line")
    try:
        tokenizer = load_tokenizer(checked.model_dir)
    except _USER_ERRORS as e:
        raise _user_error(e) from e
    encoded = _encode(prompts, tokenizer, vocab_size=checked.config.vocab_size,
                      max_model_len=checked.scheduler.max_context, chat=args.chat)

    # 2. the engine
    prepare_jax_cpu_devices(args.framework, args.tensor_parallel_size, args.device)
    try:
        llm_class = engine_class(args.framework)
    except ImportError as e:
        raise UsageError(f"--framework {args.framework}: cannot import m3_{args.framework} ({e})") from e
    start = time.perf_counter()
    try:
        llm = llm_class(str(checked.model_dir), **options)
    except _USER_ERRORS as e:
        raise _user_error(e) from e
    try:
        load_seconds = time.perf_counter() - start
        start = time.perf_counter()
        try:
            outputs = llm.generate([e.request for e in encoded], params, use_tqdm=True)
        except _USER_ERRORS as e:
            raise _user_error(e) from e
        seconds = time.perf_counter() - start
    finally:
        llm.close()   # tensor parallelism: ends the worker processes

    # 3. output
    for i, (e, out) in enumerate(zip(encoded, outputs)):
        if args.json:
            print(json.dumps(_json_record(e, out, args.logprobs)), flush=False)
        else:
            _print_human(i, len(encoded), e, out, args.logprobs, has_text=tokenizer is not None)
    sys.stdout.flush()
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    new_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    tp = f", tensor parallel {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    print(f"{len(outputs)} prompt{'s' * (len(outputs) != 1)}: {prompt_tokens} prompt tokens, {new_tokens} generated "
          f"tokens in {seconds:.2f} s ({new_tokens / max(seconds, 1e-9):.1f} tok/s; {args.framework}{tp}, "
          f"model loaded in {load_seconds:.1f} s)", file=sys.stderr, flush=True)
    return 0


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _json_record(e: _Encoded, out, num_logprobs: Optional[int]) -> dict:
    c = out.outputs[0]
    record = {"prompt": out.prompt, "prompt_token_ids": list(out.prompt_token_ids), "text": c.text,
              "token_ids": list(c.token_ids), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if e.messages is not None:
        record["messages"] = e.messages
    if num_logprobs is not None and c.logprobs is not None:
        record["logprobs"] = [_token_logprobs(token, entry, num_logprobs) for token, entry in zip(c.token_ids,
                                                                                                 c.logprobs)]
        record["cumulative_logprob"] = c.cumulative_logprob
    return record


def _token_logprobs(token: int, entry: dict, n: int) -> dict:
    """One generated token's logprobs: the sampled token's, and the top ``n`` by rank."""
    def item(t, lp):
        return {"token_id": int(t), "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank}

    top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n), key=lambda x: x[1].rank)
    return {**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in top]}


def _print_human(i: int, n: int, e: _Encoded, out, num_logprobs: Optional[int], *, has_text: bool) -> None:
    c = out.outputs[0]
    stop = f" {c.stop_reason!r}" if c.stop_reason is not None else ""
    print(f"=== [{i + 1}/{n}] {_short(e.label)} ({len(out.prompt_token_ids)} tokens) -> {len(c.token_ids)} tokens, "
          f"{c.finish_reason}{stop}")
    if has_text:
        print(c.text)
    else:
        print("ids:", " ".join(map(str, c.token_ids)))
    if num_logprobs is not None and c.logprobs:
        shown = [f"{entry[t].decoded_token!r}:{entry[t].logprob:.3f}" if entry[t].decoded_token is not None
                 else f"{t}:{entry[t].logprob:.3f}" for t, entry in zip(c.token_ids, c.logprobs)]
        print(f"logprobs (sum {c.cumulative_logprob:.3f}):", " ".join(shown))


def _short(value, limit: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    text = repr(text) if isinstance(value, str) else text
    return text if len(text) <= limit else text[:limit - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
