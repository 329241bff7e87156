"""``m3-generate``: generate tokens from a MiniMax-M3 checkpoint with the torch or the JAX engine.

    m3-generate --framework torch --model DIR --prompt "The quick brown fox" --max-new-tokens 32
    python -m m3_kernels.generate --framework jax --model DIR --prompt-ids 1,2,3 --max-new-tokens 8
    m3-generate --framework torch --model DIR --prompt "..." --tensor-parallel-size 2   # 2 GPUs (or 2 CPU processes)

Text prompts are encoded with ``DIR/tokenizer.json`` (the ``tokenizers``
package); ``--prompt-ids`` takes token ids as they are. Prints the new token
ids and, when the model has a tokenizer, their text. A progress line (tokens
done, tokens/s) goes to stderr on runs longer than a couple of seconds.

Arguments are checked before any framework is imported; the engine
(``m3_torch.LLM`` / ``m3_jax.LLM``) is imported only once they are good.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .model_config import load_config
from .tp import TPPlan

__all__ = ["main", "build_parser", "Progress"]

FRAMEWORKS = ("torch", "jax")
DTYPES = ("float32", "bfloat16", "float16")
TOKENIZER_FILE = "tokenizer.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m3-generate", description="Generate tokens with a MiniMax-M3 checkpoint "
                                "(transformers format) through the MSA kernels.")
    p.add_argument("--framework", required=True, choices=FRAMEWORKS, help="engine: m3_torch.LLM or m3_jax.LLM")
    p.add_argument("--model", required=True, type=Path, metavar="DIR",
                   help="directory with config.json, *.safetensors (and tokenizer.json for --prompt)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="text prompt, encoded with DIR/tokenizer.json")
    prompt.add_argument("--prompt-ids", type=_token_ids, metavar="IDS", help="token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=_positive_int, default=16, metavar="N", help="default: 16")
    p.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: the checkpoint's dtype")
    p.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: the engine's choice); with "
                   "--tensor-parallel-size, rank 0's (torch) or the platform (jax: cpu, gpu)")
    p.add_argument("--tensor-parallel-size", "--tp", type=_positive_int, default=1, metavar="N",
                   help="split the model over N ranks (torch: N processes, jax: a mesh of N devices); default: 1")
    for cache in ("kv", "index"):
        p.add_argument(f"--{cache}-cache-dtype", choices=("auto", "fp8"), default="auto",
                       help=f"{'K/V' if cache == 'kv' else 'index-K'} cache: the model's dtype (auto, default) "
                            "or float8_e4m3fn (fp8)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model_dir = args.model
    if not (model_dir / "config.json").is_file():
        parser.error(f"--model: {model_dir} has no config.json (expected a transformers-format checkpoint)")
    try:
        config = load_config(model_dir)
    except (ValueError, TypeError) as e:
        parser.error(f"--model: bad config.json in {model_dir}: {e}")
    vocab_size = config.vocab_size
    try:
        TPPlan(config, args.tensor_parallel_size)
    except ValueError as e:
        parser.error(f"--tensor-parallel-size: {e}")
    tokenizer = _tokenizer(model_dir)
    if args.prompt is not None:
        if tokenizer is None:
            parser.error(f"--prompt: {model_dir} has no {TOKENIZER_FILE}; pass token ids with --prompt-ids")
        prompt_ids = tokenizer.encode(args.prompt).ids
        if not prompt_ids:
            parser.error("--prompt: the text encodes to no tokens")
    else:
        prompt_ids = args.prompt_ids
    if max(prompt_ids) >= vocab_size:
        parser.error(f"{'--prompt' if args.prompt is not None else '--prompt-ids'}: token id {max(prompt_ids)} "
                     f"is outside the vocabulary [0, {vocab_size})")

    kwargs = dict(kv_cache_dtype=args.kv_cache_dtype, index_cache_dtype=args.index_cache_dtype)
    if args.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    llm = engine_class(args.framework)(model_dir, dtype=args.dtype, device=args.device, **kwargs)
    try:
        progress = Progress(args.max_new_tokens)
        start = time.perf_counter()
        [new_ids] = llm.generate([prompt_ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_p=args.top_p, seed=args.seed, progress=progress)
        seconds = time.perf_counter() - start
        progress.close()
    finally:
        llm.close()   # tensor parallelism: ends the worker processes

    tp = f", tensor parallel {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    print(f"prompt: {len(prompt_ids)} tokens; generated {len(new_ids)} tokens in {seconds:.2f} s "
          f"({len(new_ids) / max(seconds, 1e-9):.1f} tok/s, {args.framework}{tp})")
    print("ids:", " ".join(map(str, new_ids)))
    if tokenizer is not None:
        print("text:", tokenizer.decode(new_ids))
    return 0


def engine_class(framework: str):
    """The engine class of a framework, imported on first use."""
    if framework == "torch":
        from m3_torch import LLM
    else:
        from m3_jax import LLM
    return LLM


class Progress:
    """``progress(n)`` after each engine step (``n`` new tokens in that step): a
    ``tokens done/total, tok/s`` line on stderr, redrawn at most twice a second
    and only once the run has lasted ``delay`` seconds."""

    def __init__(self, total: int, *, delay: float = 2.0, stream=None):
        self.total, self.delay = total, delay
        self.stream = sys.stderr if stream is None else stream
        self.done, self.start, self.last, self.shown = 0, time.perf_counter(), 0.0, False

    def __call__(self, num_new_tokens: int):
        self.done += int(num_new_tokens)
        now = time.perf_counter()
        if now - self.start >= self.delay and now - self.last >= 0.5:
            rate = self.done / (now - self.start)
            self.stream.write(f"\r{self.done}/{self.total} tokens, {rate:.1f} tok/s")
            self.stream.flush()
            self.last, self.shown = now, True

    def close(self):
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


# -- argument types --------------------------------------------------------------------

def _tokenizer(model_dir: Path):
    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {min(ids)}")
    return ids


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _top_p(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
