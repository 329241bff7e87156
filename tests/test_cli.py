"""m3-generate (m3_kernels.generate): argument errors, prompt encoding, output, progress, the real engines."""

import io
import re
import subprocess
import sys

import pytest
import torch

from m3_kernels import generate
from m3_kernels.tiny_model import EOS_ID, write_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


class FakeLLM:
    """Records how the CLI builds and calls the engine; generates prompt-derived ids."""
    calls = []

    def __init__(self, model_dir, *, dtype=None, device=None, **kwargs):
        self.calls.append(("init", model_dir, dtype, device, *(kwargs.items())))

    def close(self):
        self.calls.append(("close",))

    def generate(self, prompts, max_new_tokens=16, temperature=0.0, top_p=1.0, seed=None, *, progress=None):
        self.calls.append(("generate", prompts, max_new_tokens, temperature, top_p, seed))
        for _ in range(max_new_tokens):
            progress(1)
        return [[(prompts[0][-1] + i) % 300 + 3 for i in range(max_new_tokens)]]


@pytest.fixture
def fake_engine(monkeypatch):
    FakeLLM.calls = []
    frameworks = []

    def engine_class(framework):
        frameworks.append(framework)
        return FakeLLM
    monkeypatch.setattr(generate, "engine_class", engine_class)
    return frameworks


def test_prompt_ids_run(model_dir, fake_engine, capsys):
    assert generate.main(["--framework", "jax", "--model", str(model_dir), "--prompt-ids", "5, 6,7",
                          "--max-new-tokens", "4", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3",
                          "--dtype", "bfloat16", "--device", "cpu"]) == 0
    assert fake_engine == ["jax"]
    assert FakeLLM.calls == [("init", model_dir, "bfloat16", "cpu", ("kv_cache_dtype", "auto"),
                              ("index_cache_dtype", "auto")), ("generate", [[5, 6, 7]], 4, 0.7, 0.9, 3),
                             ("close",)]
    out = capsys.readouterr().out
    assert "prompt: 3 tokens; generated 4 tokens" in out
    assert "ids: 10 11 12 13" in out and "text:" in out


def test_text_prompt_uses_the_tokenizer(model_dir, fake_engine, capsys):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    generate.main(["--framework", "torch", "--model", str(model_dir), "--prompt", "The quick brown fox"])
    [_, (_, prompts, max_new, temperature, top_p, seed), _] = FakeLLM.calls
    assert prompts == [tok.encode("The quick brown fox").ids]
    assert (max_new, temperature, top_p, seed) == (16, 0, 1, None)
    new_ids = [(prompts[0][-1] + i) % 300 + 3 for i in range(16)]
    assert f"text: {tok.decode(new_ids)}\n" in capsys.readouterr().out


def test_tensor_parallel_size_reaches_the_engine(model_dir, fake_engine, capsys):
    generate.main(["--framework", "torch", "--model", str(model_dir), "--prompt-ids", "5", "--max-new-tokens", "1",
                   "--tensor-parallel-size", "2", "--kv-cache-dtype", "fp8"])
    assert FakeLLM.calls[0] == ("init", model_dir, None, None, ("kv_cache_dtype", "fp8"), ("index_cache_dtype", "auto"),
                                ("tensor_parallel_size", 2))
    assert FakeLLM.calls[-1] == ("close",)
    assert "tensor parallel 2" in capsys.readouterr().out


def test_prompt_without_tokenizer_fails_clearly(tmp_path, fake_engine, capsys):
    write_tiny_checkpoint(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(SystemExit) as e:
        generate.main(["--framework", "torch", "--model", str(tmp_path), "--prompt", "hi"])
    assert e.value.code == 2
    assert "has no tokenizer.json; pass token ids with --prompt-ids" in capsys.readouterr().err
    assert not fake_engine  # nothing imported
    generate.main(["--framework", "torch", "--model", str(tmp_path), "--prompt-ids", "1,2"])  # ids still work
    assert "text:" not in capsys.readouterr().out


@pytest.mark.parametrize("args, words", [
    ([], "the following arguments are required: --framework, --model"),
    (["--framework", "tf", "--model", "{m}", "--prompt-ids", "1"], "invalid choice: 'tf'"),
    (["--framework", "torch", "--model", "{m}"], "one of the arguments --prompt --prompt-ids is required"),
    (["--framework", "torch", "--model", "{m}", "--prompt", "a", "--prompt-ids", "1"], "not allowed with argument"),
    (["--framework", "torch", "--model", "{m}", "--prompt-ids", "1,x"], "expected comma-separated token ids"),
    (["--framework", "torch", "--model", "{m}", "--prompt-ids", ","], "expected at least one token id"),
    (["--framework", "torch", "--model", "{m}", "--prompt-ids", "1,-2"], "token ids must be >= 0"),
    (["--framework", "torch", "--model", "{m}", "--prompt-ids", "1,512"], "token id 512 is outside the vocabulary"),
    (["--framework", "torch", "--model", "{m}", "--prompt-ids", "1", "--max-new-tokens", "0"], "expected an int >= 1"),
    (["--framework", "torch", "--model", "{m}", "--prompt-ids", "1", "--max-new-tokens", "2.5"], "expected an int"),
    (["--framework", "torch", "--model", "{m}", "--prompt-ids", "1", "--temperature", "-1"], "expected a number >= 0"),
    (["--framework", "torch", "--model", "{m}", "--prompt-ids", "1", "--top-p", "0"], r"in \(0, 1\]"),
    (["--framework", "torch", "--model", "{m}", "--prompt-ids", "1", "--top-p", "1.5"], r"in \(0, 1\]"),
    (["--framework", "torch", "--model", "{m}", "--prompt-ids", "1", "--dtype", "float64"], "invalid choice"),
    (["--framework", "torch", "--model", "/nonexistent/m3", "--prompt-ids", "1"], "has no config.json"),
    (["--framework", "torch", "--model", "{m}", "--prompt-ids", "1", "--tensor-parallel-size", "0"],
     "expected an int >= 1"),
    (["--framework", "jax", "--model", "{m}", "--prompt-ids", "1", "--tp", "3"],  # tiny: 4 query, 2 KV heads
     r"--tensor-parallel-size: tensor_parallel_size=3 does not divide num_attention_heads=4"),
])
def test_argument_errors(model_dir, fake_engine, capsys, args, words):
    with pytest.raises(SystemExit) as e:
        generate.main([a.replace("{m}", str(model_dir)) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(words, err), err
    assert not fake_engine  # argument errors come before any engine import


def test_bad_config_is_an_argument_error(tmp_path, fake_engine, capsys):
    write_tiny_checkpoint(tmp_path)
    text = (tmp_path / "config.json").read_text().replace('"rotary_dim": 16', '"rotary_dim": 8')
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(SystemExit):
        generate.main(["--framework", "torch", "--model", str(tmp_path), "--prompt-ids", "1"])
    err = capsys.readouterr().err
    assert "bad config.json" in err and "rotary_dim=8 disagrees" in err


def test_progress_line():
    stream = io.StringIO()
    progress = generate.Progress(10, delay=0.0, stream=stream)
    progress(4)
    progress.last = 0.0  # allow the next redraw at once
    progress(3)
    progress.close()
    lines = stream.getvalue()
    assert lines.startswith("\r4/10 tokens, ") and "\r7/10 tokens, " in lines and lines.endswith(" tok/s\n")
    quiet = io.StringIO()
    short = generate.Progress(10, stream=quiet)  # runs shorter than the delay print nothing
    short(10)
    short.close()
    assert quiet.getvalue() == ""


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "m3_kernels.generate", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--prompt-ids" in result.stdout and result.stdout.startswith("usage: m3-generate")


# -- the real engines (once m3_torch.LLM / m3_jax.LLM exist) ------------------------------------

def engine_or_skip(framework):
    try:
        return generate.engine_class(framework)
    except ImportError as e:
        pytest.skip(f"{framework} engine not available: {e}")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_cli_generates_with_the_engine(model_dir, framework, capsys):
    """The CLI end to end (CPU: a short prompt, two tokens; the model tests check the tokens themselves)."""
    engine_or_skip(framework)
    assert generate.main(["--framework", framework, "--model", str(model_dir), "--prompt", "The fox",
                          "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    ids = [int(t) for t in out.split("ids:")[1].split("\n")[0].split()]
    assert 1 <= len(ids) <= 2 and all(0 <= t < 512 for t in ids) and (len(ids) == 2 or ids[-1] == EOS_ID)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_cli_on_the_gpu(model_dir, framework, capsys):
    engine_or_skip(framework)
    assert torch.cuda.is_available()
    generate.main(["--framework", framework, "--model", str(model_dir), "--prompt-ids", ",".join(["7"] * 700),
                   "--max-new-tokens", "32", "--device", "cuda:0" if framework == "torch" else "gpu:0"])
    assert "generated" in capsys.readouterr().out
