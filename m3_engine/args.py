"""``EngineArgs``: every option of an engine, checked once for both frameworks.

``m3_torch.LLM(model, **options)`` and ``m3_jax.LLM(model, **options)`` take
the same keyword arguments and pass them here, so the same bad value raises
the same exception with the same message in both. What is framework-specific
(a ``torch.device`` or ``jax.Device`` object, a torch or jnp dtype object) is
turned into plain names first.

The fields of :class:`EngineArgs` are also the engine flags of both command
lines: :func:`add_engine_flags` adds ``--max-num-seqs`` etc. (each field's
default and help) to a parser, :func:`engine_options` reads them back, so
``m3-generate`` and ``m3-serve`` take the same engine flags with the same
defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from m3_kernels.planner import StepConfig
from m3_kernels.maps import PAGE_SIZE
from m3_kernels.pool import CACHE_DTYPE_ALIASES

from . import quantization as quant
from .checkpoint import expected_shapes
from .compile_cache import resolve_cache_dir
from .dummy_weights import LOAD_FORMATS, check_load_format
from .eagle3 import Eagle3Config
from .memory_plan import kv_budget_bytes, kv_pool_slots
from .model_config import M3TextConfig, load_config
from .quantization import SUPPORTED_QUANTIZATION
from .scheduler import SchedulerConfig
from .speculative import SpeculativeConfig
from .tp import TPPlan

__all__ = ["EngineArgs", "DTYPE_NAMES", "SUPPORTED_QUANTIZATION", "RENAMED_OPTIONS", "check_option_names",
           "parse_dtype", "parse_device", "check_gpu_device", "add_engine_flags", "engine_options", "engine_flags",
           "flag_of", "flag_message", "kv_cache_pages", "ArgumentParser", "UsageError"]

# vLLM's dtype names -> ours ("auto": the checkpoint's dtype)
DTYPE_NAMES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "half": "float16"}
CACHE_DTYPES = ("auto",) + tuple(CACHE_DTYPE_ALIASES)
# options that took vLLM's names: the old name -> the option (a TypeError names the new one)
RENAMED_OPTIONS = {"max_batch": "max_num_seqs", "max_context": "max_model_len", "max_cache_pages":
                   "num_gpu_blocks_override", "max_num_tokens": "max_num_batched_tokens"}


def parse_dtype(dtype) -> Optional[str]:
    """None, a name of :data:`DTYPE_NAMES`, or a torch / numpy / jnp float dtype -> "float32" | "bfloat16" |
    "float16", or None for the checkpoint's."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in DTYPE_NAMES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
        return DTYPE_NAMES[name]
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    name = str(name).removeprefix("torch.")
    if name in DTYPE_NAMES and name != "auto":
        return DTYPE_NAMES[name]
    raise TypeError(f"dtype: expected None, a dtype name ({', '.join(sorted(DTYPE_NAMES))}) or a float32/bfloat16/"
                    f"float16 dtype object, got {dtype!r}")


def parse_device(device) -> tuple:
    """None | "cpu" | "cuda[:N]" | "gpu[:N]" | a framework device object -> ``(platform, index, object)``:
    platform "cpu", "gpu" or None (the framework's default), index an int or None, object the
    framework device given (else None)."""
    if device is None:
        return None, None, None
    if not isinstance(device, str):
        return None, None, device
    platform, sep, index = device.strip().lower().partition(":")
    platform = {"cuda": "gpu"}.get(platform, platform)
    if platform not in ("cpu", "gpu") or (sep and not index.isdigit()) or (platform == "cpu" and index not in ("", "0")):
        raise ValueError(f"device: expected 'cpu', 'cuda', 'cuda:N', 'gpu' or 'gpu:N', got {device!r}")
    return platform, (int(index) if index else None), None


def check_gpu_device(device: str, index: Optional[int], count: int, tensor_parallel_size: int) -> int:
    """The first GPU index of an engine asked for by the string ``device``; ``count`` GPUs are visible."""
    if count == 0:
        raise ValueError(f"device: {device!r} asks for a GPU, but no GPU is visible here")
    first = index or 0
    if first + tensor_parallel_size > count:
        need = f"GPUs {first}..{first + tensor_parallel_size - 1}" if tensor_parallel_size > 1 else f"GPU {first}"
        raise ValueError(f"device: {device!r} with tensor_parallel_size={tensor_parallel_size} needs {need}, "
                         f"but {count} GPU(s) are visible here")
    return first


def parse_json(text: str):
    """An argparse type: a JSON value (``--speculative-config '{"method": "ngram", ...}'``)."""
    try:
        return json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected JSON, e.g. '{{\"method\": \"ngram\"}}', got {text!r}") from None


def parse_int_list(text: str) -> list:
    """An argparse type: ints separated by commas (``--graph-batch-sizes 1,2,4``)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ints separated by commas, got {text!r}") from None


def check_option_names(options: dict) -> None:
    """A TypeError for an option given by a name of :data:`RENAMED_OPTIONS`, naming its vLLM name."""
    for name in options:
        if name in RENAMED_OPTIONS:
            raise TypeError(f"{name}: renamed {RENAMED_OPTIONS[name]} (vLLM's name)")


def _option(default, help: str, *, type=None, choices=None, metavar=None, aliases=()):
    """An :class:`EngineArgs` field with its command-line flag: ``--field-name`` (and ``aliases``),
    ``help``, the argparse ``type`` / ``choices`` / ``metavar``. A bool field is a switch."""
    return dataclasses.field(default=default, metadata=dict(help=help, type=type, choices=choices, metavar=metavar,
                                                            aliases=tuple(aliases)))


@dataclasses.dataclass
class EngineArgs:
    """The options of ``LLM`` (both frameworks) and the engine flags of ``m3-generate`` and
    ``m3-serve``: each field's default, flag and help are written once, below; vLLM's names.
    :meth:`check` checks them. ``model`` is a folder with config.json + *.safetensors
    (transformers ``save_pretrained`` form or the original MiniMax-M3 VL names) and
    tokenizer.json for text; ``dtype`` and ``device`` also take the framework's dtype and
    device objects.
    """
    model: Any
    dtype: Any = _option("auto", "weights, activations and KV cache: auto (the checkpoint's), bfloat16, "
                         "float16/half, float32/float", choices=tuple(DTYPE_NAMES))
    device: Any = _option(None, "cpu, cuda[:N] or gpu[:N] (default: a GPU when there is one, else the CPU); "
                          "with tensor parallelism the first one")
    max_num_seqs: int = _option(8, "requests per step", type=int, metavar="N")
    max_model_len: Optional[int] = _option(None, "KV tokens per request, prompt + generated (default: "
                                           "min(8192, the model's max_position_embeddings))", type=int, metavar="N")
    num_gpu_blocks_override: Optional[int] = _option(
        None, "KV pool pages of 128 tokens (default: on a GPU what gpu_memory_utilization leaves after the "
        "weights, on a CPU max_num_seqs requests of max_model_len)", type=int, metavar="N")
    max_num_batched_tokens: Optional[int] = _option(None, "query tokens per step (default: max(2048, "
                                                    "max_num_seqs))", type=int, metavar="N")
    prefill_chunk: Optional[int] = _option(None, "prompt tokens per request per step (default: "
                                           "max_num_batched_tokens)", type=int, metavar="N")
    graph_batch_sizes: Optional[Sequence[int]] = _option(
        None, "decode batch sizes replayed from CUDA graphs (torch) or compiled (JAX) (default: 1, 2, 4, 8, "
        "then multiples of 16 up to max_num_seqs and max_num_batched_tokens)", type=parse_int_list, metavar="B1,B2,...")
    gpu_memory_utilization: float = _option(
        0.9, "fraction of a GPU's memory the engine may use, in (0, 1]: without num_gpu_blocks_override "
        "the KV pool gets what it leaves after the weights (under tensor parallelism the fewest pages of "
        "any rank); ignored on a CPU (there max_num_seqs requests of max_model_len)", type=float, metavar="F")
    tensor_parallel_size: int = _option(1, "ranks the model is split over (torch: N processes, jax: a mesh of "
                                        "N devices)", type=int, metavar="N", aliases=("-tp",))
    enable_expert_parallel: bool = _option(False, "each rank holds num_experts / tensor_parallel_size whole "
                                           "MoE experts instead of a slice of every expert (needs "
                                           "tensor_parallel_size > 1 dividing the experts)")
    quantization: Optional[str] = _option(
        None, "weight quantization: fp8 (e4m3 linear weights, a float32 scale per 128x128 block; an unquantized "
        "checkpoint is quantized at load); unset: as the checkpoint's quantization_config says", metavar="NAME")
    kv_cache_dtype: str = _option("auto", "K/V cache: auto (the model's dtype) or fp8 (float8_e4m3fn)",
                                  choices=CACHE_DTYPES)
    index_cache_dtype: str = _option("auto", "index-K cache: auto (the model's dtype) or fp8 (float8_e4m3fn)",
                                     choices=CACHE_DTYPES)
    seed: int = _option(0, "the engine's seed, from which requests without their own seed draw", type=int,
                        metavar="N")
    enforce_eager: bool = _option(False, "torch: never capture CUDA graphs (JAX always runs jitted steps: "
                                  "an error there)")
    enable_prefix_caching: bool = _option(False, "reuse the K/V/index-K pages of full 128-token blocks that an "
                                          "earlier request computed for the same token prefix")
    load_format: str = _option("auto", "auto: read the checkpoint's safetensors; dummy: random weights made on "
                               "the device from the seed (the folder needs only config.json)", choices=LOAD_FORMATS)
    speculative_config: Optional[dict] = _option(
        None, 'speculative decoding, vLLM\'s speculative_config, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' or \'{"method": "eagle3", "model": DRAFT_DIR, '
        '"num_speculative_tokens": 3}\' (eagle3: tensor_parallel_size 1)', type=parse_json, metavar="JSON")
    async_scheduling: bool = _option(False, "schedule and submit each step while the previous one runs on the "
                                     "device (same tokens; not with speculative_config; "
                                     "tensor_parallel_size 1)")

    precompile: Optional[bool] = _option(
        None, "compile (JAX) or capture (torch's CUDA graphs) every step program at start, before the engine "
        "is ready (default: on a GPU; --no-precompile: compile on first use)", type=bool)
    compile_cache_dir: Optional[str] = _option(
        None, "folder of the persistent JAX and Triton compile caches (default: $M3_CACHE_DIR, else "
        "$XDG_CACHE_HOME/m3-msa/compile or ~/.cache/m3-msa/compile)", metavar="DIR")

    def check(self) -> "CheckedArgs":
        """Every option checked and resolved, before any framework work."""
        if not isinstance(self.model, (str, Path)):
            raise TypeError(f"model: expected a path to a model folder, got {type(self.model).__name__}")
        model_dir = Path(self.model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model: {model_dir} is not a folder")
        config = load_config(model_dir)
        load_format = check_load_format(self.load_format)
        dtype = parse_dtype(self.dtype)
        platform, index, device_object = parse_device(self.device)
        tp = TPPlan(config, self.tensor_parallel_size, expert_parallel=self.enable_expert_parallel)
        for name in ("kv_cache_dtype", "index_cache_dtype"):
            value = getattr(self, name)
            if value not in CACHE_DTYPES:
                raise ValueError(f"{name}: expected one of {CACHE_DTYPES}, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed: expected an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.enforce_eager, bool):
            raise TypeError(f"enforce_eager: expected a bool, got {self.enforce_eager!r}")
        if self.precompile is not None and not isinstance(self.precompile, bool):
            raise TypeError(f"precompile: expected None (on a GPU only) or a bool, got {self.precompile!r}")
        compile_cache_dir = resolve_cache_dir(self.compile_cache_dir)
        if not isinstance(self.async_scheduling, bool):
            raise TypeError(f"async_scheduling: expected a bool, got {self.async_scheduling!r}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: expected a number in (0, 1], got {utilization!r}")
        checkpoint_quantization = quant.checkpoint_quantization(model_dir)
        weight_quantization = quant.resolve_quantization(self.quantization, checkpoint_quantization)
        if load_format == "dummy":
            checkpoint_quantization = None   # random weights, quantized as they are made when the model is FP8
        if weight_quantization is not None:
            quant.check_fp8_shapes(tp, expected_shapes(config))
        speculative = SpeculativeConfig.from_dict(self.speculative_config)
        draft = _draft_config(speculative, config, tp) if speculative is not None else None
        if self.async_scheduling and speculative is not None:
            raise ValueError(f"async_scheduling: not with speculative decoding (speculative_config method "
                             f"{speculative.method!r}): expected async_scheduling=False")
        if self.async_scheduling and tp.size > 1:   # the other ranks would need rank 0's sampled tokens
            raise ValueError(f"async_scheduling: needs tensor_parallel_size=1, got {tp.size} "
                             f"(use async_scheduling=False)")
        scheduler = SchedulerConfig.from_engine_args(
            config, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            max_num_batched_tokens=self.max_num_batched_tokens, prefill_chunk=self.prefill_chunk,
            graph_batch_sizes=self.graph_batch_sizes, enable_prefix_caching=self.enable_prefix_caching)
        return CheckedArgs(model_dir=model_dir, config=config, tp=tp, dtype=dtype, platform=platform,
                           device_index=index, device_object=device_object, device=self.device,
                           scheduler=scheduler, kv_cache_dtype=self.kv_cache_dtype,
                           index_cache_dtype=self.index_cache_dtype, seed=self.seed,
                           enforce_eager=self.enforce_eager, load_format=load_format, speculative=speculative,
                           draft=draft, gpu_memory_utilization=float(utilization), precompile=self.precompile,
                           compile_cache_dir=compile_cache_dir, quantization=weight_quantization,
                           checkpoint_quantization=checkpoint_quantization, async_scheduling=self.async_scheduling,
                           num_gpu_blocks_override=self.num_gpu_blocks_override)


def _draft_config(speculative: SpeculativeConfig, config: M3TextConfig, tp: TPPlan) -> Optional[Eagle3Config]:
    """The EAGLE-3 draft's config, read and checked against the target (None for "ngram")."""
    if speculative.method != "eagle3":
        return None
    if tp.size > 1:
        raise ValueError(f"speculative_config: the 'eagle3' draft head runs on one device, without tensor "
                         f"parallelism; got tensor_parallel_size={tp.size} (use 1, or the 'ngram' method)")
    draft_dir = Path(speculative.model)
    if not draft_dir.is_dir():
        raise FileNotFoundError(f"speculative_config.model: {draft_dir} is not a folder (the EAGLE-3 draft's "
                                f"config.json and safetensors)")
    return Eagle3Config.from_dir(draft_dir, config)


@dataclasses.dataclass(frozen=True)
class CheckedArgs:
    """:class:`EngineArgs` after :meth:`EngineArgs.check`: what a runner is built from."""
    model_dir: Path
    config: M3TextConfig
    tp: TPPlan
    dtype: Optional[str]          # None: the checkpoint's
    platform: Optional[str]       # "cpu" | "gpu" | None (the framework's default)
    device_index: Optional[int]
    device_object: Any            # a framework device object given by the caller, else None
    device: Any                   # as given (for messages)
    scheduler: SchedulerConfig
    kv_cache_dtype: str
    index_cache_dtype: str
    seed: int
    enforce_eager: bool
    load_format: str = "auto"     # "auto" | "dummy"
    speculative: Optional[SpeculativeConfig] = None
    draft: Optional[Eagle3Config] = None   # speculative method "eagle3": the draft head's config
    gpu_memory_utilization: float = 0.9   # a GPU runner's memory budget (kv_cache_pages); unused on a CPU
    precompile: Optional[bool] = None     # None: on a GPU (the runner knows its device)
    compile_cache_dir: Optional[Path] = None   # m3_engine.compile_cache; None: the runners set no cache
    quantization: Optional[str] = None    # the weights the engine runs: None or "fp8" (m3_engine.quantization)
    checkpoint_quantization: Optional[str] = None   # the stored weights': None (or dummy), "fp8", "mxfp8" (converted)
    async_scheduling: bool = False        # the engine core schedules each step while the previous one runs
    num_gpu_blocks_override: Optional[int] = None   # None: a GPU runner sizes the pool (scheduler.num_slots: a CPU's)

    def precompile_on(self, on_gpu: bool) -> bool:
        """Whether the runner compiles its step programs at start (``precompile``, None: on a GPU)."""
        return on_gpu if self.precompile is None else self.precompile

    def step_config(self) -> StepConfig:
        """The step planner's config of the engine: one rank's heads, the scheduler's limits."""
        sc = self.scheduler
        return StepConfig(num_q_heads=self.tp.num_q_heads, num_kv_heads=self.tp.num_kv_heads,
                          head_dim=self.config.head_dim, max_batch=sc.max_batch, max_num_tokens=sc.max_num_tokens,
                          max_blocks=sc.max_blocks, topk=self.config.index_topk_blocks,
                          graph_batch_sizes=sc.graph_batch_sizes)


# -- the engine flags of both command lines ----------------------------------------------------------

class UsageError(Exception):
    """A bad command line or input: the command prints one ``error: ...`` line and exits with status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors raise :class:`UsageError` (argparse's own prints the whole
    usage block, then the message, and exits)."""

    def error(self, message):
        raise UsageError(message)


def flag_of(name: str) -> str:
    """The command-line flag of an :class:`EngineArgs` field: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + name.replace("_", "-")


def engine_flags() -> dict:
    """Every :class:`EngineArgs` field but ``model`` -> its flag."""
    return {field.name: flag_of(field.name) for field in dataclasses.fields(EngineArgs) if field.name != "model"}


def flag_message(message: str, flags: dict) -> str:
    """An error message that starts with a name of ``flags`` (``"max_num_seqs: expected ..."`` or
    ``"tensor_parallel_size=3 does not ..."``) -> the same naming the flag (``"--max-num-seqs:
    expected ..."``, ``"--tensor-parallel-size: tensor_parallel_size=3 does not ..."``)."""
    m = re.match(r"([a-z_]+)(:|=)", message)
    if not m or m.group(1) not in flags:
        return message
    flag = flags[m.group(1)]
    return flag + message[m.end(1):] if m.group(2) == ":" else f"{flag}: {message}"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag for every :class:`EngineArgs` field but ``model`` (its default and help from the
    field), in one group "engine options"."""
    group = parser.add_argument_group("engine options (m3_engine.args.EngineArgs; vLLM's names)")
    for field in dataclasses.fields(EngineArgs):
        if field.name == "model":
            continue
        meta, default = field.metadata, field.default
        flags = [flag_of(field.name), *meta["aliases"]]
        if isinstance(default, bool):
            group.add_argument(*flags, dest=field.name, action="store_true", help=meta["help"])
            continue
        if meta["type"] is bool:   # None (decided later), or --flag / --no-flag
            group.add_argument(*flags, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                               help=meta["help"])
            continue
        help_ = meta["help"] if default is None else f"{meta['help']} (default: {default})"
        group.add_argument(*flags, dest=field.name, default=default, type=meta["type"], choices=meta["choices"],
                           metavar=meta["metavar"], help=help_)


def engine_options(args: argparse.Namespace) -> dict:
    """The ``LLM(model, **options)`` keyword arguments of the flags :func:`add_engine_flags` added."""
    return {field.name: getattr(args, field.name) for field in dataclasses.fields(EngineArgs)
            if field.name != "model"}


# -- the KV pool from the memory left ------------------------------------------------------------------

def kv_cache_pages(*, total_bytes: int, used_bytes: int, gpu_memory_utilization: float, page_bytes: int,
                   max_model_len: int, free_bytes: Optional[int] = None) -> int:
    """The KV pool pages (128 tokens each, every layer) a GPU can hold, as vLLM sizes its KV cache:
    the engine may use ``gpu_memory_utilization * total_bytes``; what is left of it after
    ``used_bytes`` (the runners measure it after loading the weights; CUDA graphs and the step's
    activations come out of the ``1 - gpu_memory_utilization`` left over) holds
    ``floor(left / page_bytes)`` pages (``memory_plan.kv_budget_bytes`` / ``kv_pool_slots``), and no
    more than ``free_bytes`` (the device's free memory now, when given: other processes' memory is
    not this engine's to count, but neither can the pool take it). Fewer pages than one request of
    ``max_model_len`` tokens needs is a ValueError naming the numbers."""
    left = kv_budget_bytes(total_bytes, gpu_memory_utilization, used_bytes)
    if free_bytes is not None:
        left = min(left, free_bytes)
    pages = kv_pool_slots(left, page_bytes)
    need = -(-max_model_len // PAGE_SIZE)
    if pages < need:
        gib = 1 << 30
        raise ValueError(f"gpu_memory_utilization: {gpu_memory_utilization} of {total_bytes / gib:.1f} GiB "
                         f"leaves {max(left, 0) / gib:.2f} GiB after {used_bytes / gib:.1f} GiB of "
                         f"weights and activations: {pages} KV pages of {page_bytes} bytes, but one request of "
                         f"max_model_len={max_model_len} tokens needs {need}; raise gpu_memory_utilization or "
                         f"lower max_model_len")
    return pages
