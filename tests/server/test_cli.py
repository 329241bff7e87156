"""m3-generate (m3_engine.cli): prompts in, outputs out, errors, and the real torch / JAX engines.

Most tests run ``main(argv)`` in this process. The real engines are built once per module and
framework (``real`` below hands the same LLM to every CLI run with the same options; the CLI's
``close()`` of it is a no-op); ``fake`` is an LLM that records what the CLI asks. Subprocesses
only where the process matters: stdin through a pipe, the exit status, which modules load.
"""

import dataclasses
import importlib.metadata
import io
import json
import math
import os
import re
import subprocess
import sys

import pytest

import m3_engine
from m3_engine import cli
from m3_engine.args import EngineArgs
from m3_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from m3_engine.sampling_params import SamplingParams
from m3_engine.tiny_model import BOS_ID, write_tiny_checkpoint
from m3_engine.tokenizer import Tokenizer

CTX = ["--max-model-len", "256"]   # every real-engine run: the same options, so one engine per framework


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


def run(capsys, *argv):
    """-> (exit status, stdout, stderr) of ``main(argv)``."""
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def json_lines(out):
    return [json.loads(line) for line in out.splitlines()]


# -- a fake engine: what the CLI asks of LLM ------------------------------------------------------

class FakeLLM:
    """Records how the CLI builds and calls the engine; generates ids derived from the prompt."""
    instances = []
    refuse = None   # an exception that __init__ raises
    fail = None     # an exception that generate() raises

    def __init__(self, model, **options):
        if FakeLLM.refuse is not None:
            raise FakeLLM.refuse
        self.model, self.options, self.calls, self.closed = model, options, [], False
        FakeLLM.instances.append(self)

    def generate(self, prompts, params, *, use_tqdm=True):
        self.calls.append((prompts, params, use_tqdm))
        if FakeLLM.fail is not None:
            raise FakeLLM.fail
        outputs = []
        for i, p in enumerate(prompts):
            ids = p["prompt_token_ids"]
            new = [(ids[-1] + k) % 500 + 3 for k in range(params.max_tokens)]
            outputs.append(RequestOutput(str(i), p.get("prompt"), list(ids), [CompletionOutput(
                0, f"<out {i}>", new, None, None, "length")], True, RequestMetrics(0.0)))
        return outputs

    def close(self):
        self.closed = True


@pytest.fixture
def fake(monkeypatch):
    FakeLLM.instances, FakeLLM.refuse, FakeLLM.fail = [], None, None
    frameworks = []

    def engine_class(framework):
        frameworks.append(framework)
        return FakeLLM
    monkeypatch.setattr(cli, "engine_class", engine_class)
    return frameworks


@pytest.fixture
def no_engine(monkeypatch):
    """The CLI must fail before it asks for an engine."""
    asked = []
    monkeypatch.setattr(cli, "engine_class", lambda framework: asked.append(framework))
    yield
    assert asked == [], "an engine was imported for a bad command line"


def test_options_reach_the_engine_and_sampling_params(model_dir, tok, fake, capsys):
    rc, out, err = run(capsys, "--framework", "jax", "--model", model_dir, "--prompt", "The fox", "--max-tokens", 3,
                       "--temperature", 0.5, "--top-p", 0.9, "--top-k", 7, "--min-p", 0.05, "--sampling-seed", 11,
                       "--stop", "ab", "--stop", "\n", "--logprobs", 2, "--dtype", "bfloat16", "--device", "cpu",
                       "--max-num-seqs", 4, "--max-model-len", 300, "--kv-cache-dtype", "fp8")
    assert rc == 0, err
    assert fake == ["jax"]
    [llm] = FakeLLM.instances
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs) if f.name != "model"}
    assert llm.options == {**defaults, "dtype": "bfloat16", "device": "cpu", "max_num_seqs": 4, "max_model_len": 300,
                           "kv_cache_dtype": "fp8"}   # every engine option, EngineArgs' defaults where not given
    [(prompts, params, use_tqdm)] = llm.calls
    assert prompts == [{"prompt": "The fox", "prompt_token_ids": tok.encode("The fox")}] and use_tqdm
    assert params == SamplingParams(max_tokens=3, temperature=0.5, top_p=0.9, top_k=7, min_p=0.05, seed=11,
                                    stop=["ab", "\n"], logprobs=2)
    assert llm.closed
    # no sampling option: SamplingParams' own defaults, which the model's generation_config.json may replace
    FakeLLM.instances = []
    assert run(capsys, "--model", model_dir, "--prompt", "x")[0] == 0
    assert FakeLLM.instances[0].calls[0][1] == SamplingParams()
    assert fake == ["jax", "torch"]   # --framework defaults to torch
    assert run(capsys, "--model", model_dir, "--prompt", "x", "--max-new-tokens", 5)[0] == 0   # the old name
    assert FakeLLM.instances[-1].calls[0][1].max_tokens == 5


def test_prompts_in_command_line_order_from_options_and_files(model_dir, tok, fake, capsys, tmp_path):
    text_file = tmp_path / "prompts.txt"
    text_file.write_text("first line\n\n   \nsecond line\r\n")
    jsonl_file = tmp_path / "batch.data"   # no .jsonl suffix: recognised by its first line
    jsonl_file.write_text('"a json string"\n{"prompt": "an object"}\n\n{"prompt_token_ids": [5, 6, 7]}\n'
                          '{"messages": [{"role": "system", "content": "be brief"}, '
                          '{"role": "user", "content": "hi"}]}\n')
    rc, out, err = run(capsys, "--model", model_dir, "--prompt-ids", "9, 8", "--prompts-file", text_file,
                       "--prompt", "last", "--prompts-file", jsonl_file)
    assert rc == 0, err
    [(prompts, _, _)] = FakeLLM.instances[0].calls
    chat = "<s>system: be brief</s>\nuser: hi</s>\nassistant:"
    assert prompts == [{"prompt_token_ids": [9, 8]}] + [
        {"prompt": t, "prompt_token_ids": tok.encode(t)} for t in ("first line", "second line", "last",
                                                                   "a json string", "an object")] + [
        {"prompt_token_ids": [5, 6, 7]},
        {"prompt": chat, "prompt_token_ids": tok.encode(chat, add_special_tokens=False)}]
    assert prompts[-1]["prompt_token_ids"].count(BOS_ID) == 1   # the template writes <s>; encoding adds none
    headers = [line for line in out.splitlines() if line.startswith("=== ")]
    assert len(headers) == 8 and headers[0].startswith("=== [1/8] 'ids 9,8' (2 tokens) -> 16 tokens, length")
    assert headers[7].startswith("=== [8/8] 'hi' ") and "<out 7>" in out
    assert re.fullmatch(r"8 prompts: \d+ prompt tokens, 128 generated tokens in [\d.]+ s \([\d.]+ tok/s; torch, "
                        r"model loaded in [\d.]+ s\)\n", err), err


def test_chat_renders_text_prompts_and_json_names_the_messages(model_dir, tok, fake, capsys, tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "from a file"}\n')
    rc, out, err = run(capsys, "--model", model_dir, "--chat", "--prompt", "hello", "--prompts-file", jsonl, "--json")
    assert rc == 0, err
    records = json_lines(out)
    assert [r["prompt"] for r in records] == ["<s>user: hello</s>\nassistant:", "<s>user: from a file</s>\nassistant:"]
    assert records[0]["messages"] == [{"role": "user", "content": "hello"}]
    assert records[0]["prompt_token_ids"] == tok.encode(records[0]["prompt"], add_special_tokens=False)
    assert set(records[0]) == {"prompt", "prompt_token_ids", "text", "token_ids", "finish_reason", "stop_reason",
                               "messages"}   # no logprobs unless asked


def test_stdin_one_prompt_per_line(model_dir, tok, fake, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("The fox\n\nhello world\n"))
    rc, out, err = run(capsys, "--model", model_dir, "--json")
    assert rc == 0, err
    assert [r["prompt"] for r in json_lines(out)] == ["The fox", "hello world"]
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"prompt_token_ids": [3, 4]}\n'))   # JSONL on stdin too
    rc, out, err = run(capsys, "--model", model_dir, "--json")
    assert rc == 0 and json_lines(out)[0]["prompt_token_ids"] == [3, 4] and json_lines(out)[0]["prompt"] is None
    monkeypatch.setattr(sys, "stdin", io.StringIO("ignored\n"))   # a prompt option: stdin is not read
    rc, out, err = run(capsys, "--model", model_dir, "--prompt", "given", "--json")
    assert [r["prompt"] for r in json_lines(out)] == ["given"]


def test_a_model_without_tokenizer_takes_and_prints_ids(tmp_path, fake, capsys):
    write_tiny_checkpoint(tmp_path, seed=0)
    (tmp_path / "tokenizer.json").unlink()
    rc, out, err = run(capsys, "--model", tmp_path, "--prompt-ids", "5,6", "--max-tokens", 2)
    assert rc == 0, err
    assert "ids: 9 10\n" in out
    rc, out, err = run(capsys, "--model", tmp_path, "--prompt", "hi")
    assert rc == 2 and "--prompt 1: the model folder has no tokenizer.json" in err


class TTY(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("args, words", [
    (["--model", "/nonexistent/m3", "--prompt", "x"], r"^error: --model: /nonexistent/m3 is not a folder$"),
    ([], r"^error: the following arguments are required: --model$"),
    (["--model", "{m}", "--prompt", "x", "--top-p", "1.5"],
     r"^error: --top-p: expected a number in \(0, 1\], got 1.5$"),
    (["--model", "{m}", "--prompt", "x", "--temperature", "hot"],
     r"^error: argument --temperature: invalid float value: 'hot'$"),
    (["--model", "{m}", "--prompt", "x", "--max-tokens", "0"], r"--max-tokens: expected an int >= 1, got 0"),
    (["--model", "{m}", "--prompt", "x", "--logprobs", "21"], r"--logprobs: expected an int in \[0, 20\]"),
    (["--model", "{m}", "--framework", "tf", "--prompt", "x"], r"argument --framework: invalid choice: 'tf'"),
    (["--model", "{m}", "--prompt", "x", "--dtype", "float64"], r"argument --dtype: invalid choice: 'float64'"),
    (["--model", "{m}", "--prompt", "x", "--device", "tpu"], r"^error: --device: expected 'cpu', 'cuda'"),
    (["--model", "{m}", "--prompt", "x", "--max-model-len", "9000"], r"--max-model-len: expected <= max_position_emb"),
    (["--model", "{m}", "--prompt", "x", "-tp", "3"],   # tiny: 4 query, 2 KV heads
     r"--tensor-parallel-size: tensor_parallel_size=3 does not divide num_attention_heads=4"),
    (["--model", "{m}", "--prompt", "x", "--graph-batch-sizes", "0"],
     r"^error: --graph-batch-sizes: expected an int >= 1, got 0$"),
    (["--model", "{m}", "--prompt", "x", "--max-num-batched-tokens", "4", "--graph-batch-sizes", "8"],
     r"^error: --graph-batch-sizes: expected sizes <= max_num_seqs=8 and <= max_num_batched_tokens=4, got \(8,\)$"),
    (["--model", "{m}", "--max-model-len", "256", "--prompt", "x", "--prompt-ids", ",".join(["5"] * 300)],
     r"^error: --prompt-ids 1: 300 tokens, longer than --max-model-len 256"),
    (["--model", "{m}", "--prompt-ids", "1,512"], r"--prompt-ids 1: token id 512 is outside the vocabulary \[0, 512\)"),
    (["--model", "{m}", "--prompt-ids", "1,x"], r"--prompt-ids '1,x': expected comma-separated token ids"),
    (["--model", "{m}", "--prompt-ids", ","], r"--prompt-ids 1: empty prompt"),
    (["--model", "{m}", "--chat", "--prompt-ids", "1,2"], r"--prompt-ids 1: --chat needs text prompts"),
    (["--model", "{m}", "--prompts-file", "/nonexistent/p.txt"], r"--prompts-file /nonexistent/p.txt: No such file"),
    (["--model", "{m}", "--prompts-file", "{bad_jsonl}"], r"p.jsonl line 3: expected a JSON string or an object "
                                                          r"with one of 'prompt', 'prompt_token_ids', 'messages'"),
    (["--model", "{m}", "--prompts-file", "{bad_chat}"], r"c.jsonl line 1: unknown role: robot"),
    (["--model", "{m}"], r"^error: no prompt: give --prompt, --prompt-ids or --prompts-file, or pipe prompts"),
])
def test_user_errors_are_one_line_and_status_2(model_dir, no_engine, capsys, monkeypatch, tmp_path, args, words):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n\n{"promt": "b"}\n')
    (tmp_path / "c.jsonl").write_text('{"messages": [{"role": "robot", "content": "beep"}]}\n')
    monkeypatch.setattr(sys, "stdin", TTY())   # a terminal: no prompt from stdin
    rc, out, err = run(capsys, *[a.replace("{m}", str(model_dir)).replace("{bad_jsonl}", str(tmp_path / "p.jsonl"))
                                 .replace("{bad_chat}", str(tmp_path / "c.jsonl")) for a in args])
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert re.search(words, err, re.M), err


def test_engine_errors(model_dir, fake, capsys):
    """An engine ValueError names the option (status 2); another failure is one line too (status 1)."""
    FakeLLM.refuse = ValueError("device: 'cuda' asks for a GPU, but no GPU is visible here")
    rc, out, err = run(capsys, "--model", model_dir, "--prompt", "x", "--device", "cuda")
    FakeLLM.refuse = None
    assert (rc, err) == (2, "error: --device: 'cuda' asks for a GPU, but no GPU is visible here\n")
    FakeLLM.fail = RuntimeError("a tensor-parallel rank failed")
    rc, out, err = run(capsys, "--model", model_dir, "--prompt", "x")
    assert rc == 1 and err == "error: RuntimeError: a tensor-parallel rank failed (--debug shows the traceback)\n"
    assert FakeLLM.instances[-1].closed   # closed on the way out


def test_a_framework_that_does_not_import(model_dir, capsys, monkeypatch):
    def engine_class(framework):
        raise ModuleNotFoundError("No module named 'jax'")
    monkeypatch.setattr(cli, "engine_class", engine_class)
    rc, out, err = run(capsys, "--framework", "jax", "--model", model_dir, "--prompt", "x")
    assert (rc, err) == (2, "error: --framework jax: cannot import m3_jax (No module named 'jax')\n")


def test_debug_shows_the_traceback(capsys):
    rc, out, err = run(capsys, "--model", "/nonexistent/m3", "--prompt", "x", "--debug")
    assert rc == 2
    assert err.startswith("Traceback (most recent call last):") and "FileNotFoundError" in err
    assert err.endswith("error: --model: /nonexistent/m3 is not a folder\n")


def test_version(capsys):
    rc, out, err = run(capsys, "--version")
    assert rc == 0 and out == f"m3-generate {importlib.metadata.version('m3-msa-kernels')}\n"


def test_jax_cpu_devices_for_tensor_parallelism(model_dir, fake, capsys, monkeypatch):
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert cli.prepare_jax_cpu_devices("jax", 2, "cpu", env)
    assert env == {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2", "PJRT_NPROC": "3"}
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PJRT_NPROC": "8"}   # the user's win
    assert cli.prepare_jax_cpu_devices("jax", 2, "cpu", env) and env == {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PJRT_NPROC": "8"}
    env = {"CUDA_VISIBLE_DEVICES": ""}   # no --device, no GPU visible
    assert cli.prepare_jax_cpu_devices("jax", 4, None, env) and env["PJRT_NPROC"] == "5"
    for args in (("torch", 2, "cpu"), ("jax", 1, "cpu"), ("jax", 2, "cuda:0"), ("jax", 2, "gpu")):
        env = {}
        assert not cli.prepare_jax_cpu_devices(*args, env) and env == {}
    # main sets them before it asks for the engine
    for name in ("XLA_FLAGS", "PJRT_NPROC"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    seen = []
    monkeypatch.setattr(cli, "engine_class", lambda fw: seen.append(
        (fw, os.environ.get("XLA_FLAGS"), os.environ.get("PJRT_NPROC"))) or FakeLLM)
    rc, out, err = run(capsys, "--framework", "jax", "--model", model_dir, "--prompt", "x", "-tp", 2,
                       "--device", "cpu")
    assert rc == 0, err
    assert seen == [("jax", "--xla_force_host_platform_device_count=2", "3")]


# -- the real engines -------------------------------------------------------------------------

class _Shared:
    """One module-wide engine behind the CLI: its close() is the module's."""

    def __init__(self, llm):
        self.llm = llm

    def generate(self, *args, **kwargs):
        return self.llm.generate(*args, **kwargs)

    def close(self):
        pass


@pytest.fixture(scope="module")
def engines():
    cache = {}
    yield cache
    for llm in cache.values():
        llm.close()


@pytest.fixture
def real(monkeypatch, engines):
    def engine_class(framework):
        llm_class = m3_engine.engine_class(framework)

        def make(model, **options):
            key = (framework, model, tuple(sorted(options.items())))
            if key not in engines:
                engines[key] = llm_class(model, **options)
            return _Shared(engines[key])
        return make
    monkeypatch.setattr(cli, "engine_class", engine_class)


@pytest.mark.long
def test_torch_and_jax_agree_greedily(model_dir, tok, real, capsys):
    records = {}
    for framework in ("torch", "jax"):
        rc, out, err = run(capsys, "--framework", framework, "--model", model_dir, *CTX, "--prompt", "The fox",
                           "--max-tokens", 3, "--temperature", 0, "--json")
        assert rc == 0, err
        [records[framework]] = json_lines(out)
        assert f"1 prompt: 3 prompt tokens, {len(records[framework]['token_ids'])} generated tokens" in err
        assert "\r" not in err   # no progress bar: stderr is not a terminal
    torch_record, jax_record = records["torch"], records["jax"]
    assert torch_record["prompt"] == "The fox" and torch_record["prompt_token_ids"] == tok.encode("The fox")
    assert 1 <= len(torch_record["token_ids"]) <= 3 and torch_record["finish_reason"] in ("length", "stop")
    assert torch_record["text"] == tok.decode(torch_record["token_ids"])
    assert jax_record == torch_record


def test_repeated_prompts_human_output(model_dir, tok, real, capsys):
    rc, out, err = run(capsys, "--model", model_dir, *CTX, "--prompt", "The fox", "--prompt", "hello",
                       "--prompt-ids", "5,6,7", "--max-tokens", 1, "--temperature", 0)
    assert rc == 0, err
    headers = [line for line in out.splitlines() if line.startswith("=== [")]
    assert out.startswith("=== [1/3] 'The fox' (3 tokens) -> ") and len(headers) == 3
    assert headers[1].startswith("=== [2/3] 'hello' (4 tokens) -> ")
    assert headers[2].startswith("=== [3/3] 'ids 5,6,7' (3 tokens) -> ")
    assert re.fullmatch(r"3 prompts: 10 prompt tokens, 3 generated tokens in [\d.]+ s \([\d.]+ tok/s; torch, "
                        r"model loaded in [\d.]+ s\)\n", err), err


def test_progress_bar_only_on_a_terminal(model_dir, real, capsys, monkeypatch):
    terminal = TTY()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["--model", str(model_dir), *CTX, "--prompt", "x", "--max-tokens", "1"]) == 0
    assert "Processed prompts" in terminal.getvalue() and "\r" in terminal.getvalue()
    # not a terminal: no bar (test_torch_and_jax_agree_greedily, test_stdin_pipe_end_to_end)


@pytest.mark.long
def test_chat_stop_and_logprobs(model_dir, tok, real, capsys):
    common = ["--model", model_dir, *CTX, "--chat", "--prompt", "hi", "--max-tokens", 4, "--temperature", 0, "--json"]
    rc, out, err = run(capsys, *common, "--logprobs", 2)
    assert rc == 0, err
    [full] = json_lines(out)
    assert full["prompt"] == "<s>user: hi</s>\nassistant:" and full["messages"] == [{"role": "user", "content": "hi"}]
    n = len(full["token_ids"])
    assert len(full["logprobs"]) == n and full["text"] == tok.decode(full["token_ids"])
    for token, entry in zip(full["token_ids"], full["logprobs"]):
        assert entry["token_id"] == token and entry["rank"] == 1   # greedy: the most likely token
        assert [t["rank"] for t in entry["top_logprobs"]] == [1, 2] and entry["top_logprobs"][0]["token_id"] == token
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert entry["token"] == tok.token_text(token)
    assert math.isclose(full["cumulative_logprob"], sum(e["logprob"] for e in full["logprobs"]), rel_tol=1e-5)
    # a stop string from the middle of that text: the same greedy tokens, cut there
    text = full["text"]
    if len(text) < 2:
        pytest.skip(f"the greedy text {text!r} is too short to hold a stop string")
    stop = text[len(text) // 2:][:2]
    rc, out, err = run(capsys, *common, "--stop", stop, "--stop", "never here")
    assert rc == 0, err
    [cut] = json_lines(out)
    assert (cut["finish_reason"], cut["stop_reason"], cut["text"]) == ("stop", stop, text[:text.find(stop)])
    assert cut["token_ids"] == full["token_ids"][:len(cut["token_ids"])] and "logprobs" not in cut


@pytest.mark.long
def test_seed_makes_sampling_repeat(model_dir, real, capsys):
    def sample(seed, copies=1):
        rc, out, err = run(capsys, "--model", model_dir, *CTX, *["--prompt", "The fox"] * copies,
                           "--max-tokens", 2, "--temperature", 1.0, "--sampling-seed", seed,
                           "--json")
        assert rc == 0, err
        return [r["token_ids"] for r in json_lines(out)]
    first, second = sample(7, copies=2)
    assert first == second           # a prompt's tokens depend on the prompt and the seed only
    assert sample(7) == [first]      # again (the same engine: its seed and arrival count do not matter)
    assert sample(8) != [first]      # 2 tokens drawn from ~512 near-equal ones: a clash is ~impossible


# -- processes: stdin through a pipe, exit statuses, nothing imported before the checks ----------

def _subprocess(args, stdin="", env=None):
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=300,
                          env=env)


def test_errors_come_before_any_framework_import(model_dir, tok):
    long_line = "word " * 300
    script = ("import sys; from m3_engine.cli import main\n"
              "codes = [main(['--model', '/nonexistent/m3', '--prompt', 'x']),\n"
              f"         main(['--model', {str(model_dir)!r}, '--max-model-len', '256', '--framework', 'jax'])]\n"
              "print(codes, sorted(m for m in ('torch', 'jax', 'triton') if m in sys.modules))")
    result = _subprocess(["-c", script], stdin="fine\n" + long_line + "\n")   # line 2: too long
    assert result.stdout == "[2, 2] []\n", result.stderr
    assert result.stderr == ("error: --model: /nonexistent/m3 is not a folder\nerror: <stdin> line 2: "
                             f"{len(tok.encode(long_line))} tokens, longer than --max-model-len 256 (the KV tokens per "
                             "request, prompt + generated)\n")
    result = _subprocess(["-m", "m3_engine.cli", "--model", "/nonexistent/m3", "--prompt", "x"])
    assert (result.returncode, result.stdout, result.stderr) == (2, "", "error: --model: /nonexistent/m3 is not a "
                                                                        "folder\n")


@pytest.mark.long
def test_stdin_pipe_end_to_end(model_dir):
    """``python -m m3_engine.cli`` with prompts piped in and stdout/stderr pipes: JSON lines out,
    exit status 0, and on stderr only the summary line (no progress-bar carriage returns)."""
    result = _subprocess(["-m", "m3_engine.cli", "--model", str(model_dir), *CTX, "--max-tokens", "1",
                          "--temperature", "0", "--json"], stdin="The fox\n\nhello\n")
    assert result.returncode == 0, result.stderr
    assert [r["prompt"] for r in json_lines(result.stdout)] == ["The fox", "hello"]
    assert re.fullmatch(r"2 prompts: 7 prompt tokens, 2 generated tokens in [\d.]+ s \([^)]*\)\n", result.stderr)
