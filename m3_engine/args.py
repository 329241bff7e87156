"""``EngineArgs``: every option of an engine, checked once for both frameworks.

``m3_torch.LLM(model, **options)`` and ``m3_jax.LLM(model, **options)`` take
the same keyword arguments and pass them here, so the same bad value raises
the same exception with the same message in both. What is framework-specific
(a ``torch.device`` or ``jax.Device`` object, a torch or jnp dtype object) is
turned into plain names first.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional, Sequence

from m3_kernels.planner import StepConfig
from m3_kernels.pool import CACHE_DTYPE_ALIASES

from .dummy_weights import LOAD_FORMATS, check_load_format
from .eagle3 import Eagle3Config
from .model_config import M3TextConfig, load_config
from .scheduler import SchedulerConfig
from .speculative import SpeculativeConfig
from .tp import TPPlan

__all__ = ["EngineArgs", "DTYPE_NAMES", "parse_dtype", "parse_device", "check_gpu_device"]

# vLLM's dtype names -> ours ("auto": the checkpoint's dtype)
DTYPE_NAMES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "half": "float16"}
CACHE_DTYPES = ("auto",) + tuple(CACHE_DTYPE_ALIASES)


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


@dataclasses.dataclass
class EngineArgs:
    """The options of ``LLM`` (both frameworks); :meth:`create` checks them.

    model:           folder with config.json + *.safetensors (transformers ``save_pretrained``
                     form or the original MiniMax-M3 VL names), tokenizer.json for text.
    dtype:           weights, activations, KV cache: "auto"/None (the checkpoint's),
                     "bfloat16", "float16"/"half", "float32"/"float", or a dtype object.
    device:          None (a GPU when there is one, else the CPU), "cpu", "cuda[:N]"/"gpu[:N]",
                     or the framework's device object; with tensor parallelism, the first one.
    max_num_seqs:    requests per step.
    max_model_len:   KV tokens per request, prompt + generated (default min(8192, the model's
                     max_position_embeddings)).
    num_gpu_blocks_override: pool pages of 128 tokens (default: max_num_seqs requests of
                     max_model_len).
    max_num_batched_tokens: query tokens per step (default max(2048, max_num_seqs)).
    prefill_chunk:   prompt tokens per request per step (default max_num_batched_tokens).
    graph_batch_sizes: decode batch sizes replayed from CUDA graphs (torch) or compiled (JAX);
                     default 1, 2, 4, 8, then multiples of 16 up to max_num_seqs.
    tensor_parallel_size: ranks the model is split over.
    kv_cache_dtype, index_cache_dtype: "auto" (the model's dtype) or "fp8" (float8_e4m3fn).
    seed:            the engine's seed, from which requests without their own seed draw.
    enforce_eager:   torch: never capture CUDA graphs. JAX always runs jitted steps:
                     True there is a ValueError.
    enable_prefix_caching: reuse the K/V/index-K pages of full 128-token blocks that an
                     earlier request computed for the same token prefix (``m3_engine.block_manager``).
    load_format:     "auto" (read the checkpoint's safetensors) or "dummy" (vLLM's: random weights
                     made on the device from ``seed``, ``config.json`` alone is needed;
                     ``m3_engine.dummy_weights``).
    speculative_config: None, or speculative decoding as a dict with vLLM's names, e.g.
                     ``{"method": "ngram", "num_speculative_tokens": 4}`` or ``{"method": "eagle3",
                     "model": DRAFT_DIR, "num_speculative_tokens": 3}``
                     (``m3_engine.speculative.SpeculativeConfig``; eagle3: tensor_parallel_size 1).
    """
    model: Any
    dtype: Any = None
    device: Any = None
    max_num_seqs: int = 8
    max_model_len: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    prefill_chunk: Optional[int] = None
    graph_batch_sizes: Optional[Sequence[int]] = None
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    index_cache_dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    enable_prefix_caching: bool = False
    load_format: str = "auto"
    speculative_config: Optional[dict] = None

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
        tp = TPPlan(config, self.tensor_parallel_size)
        for name in ("kv_cache_dtype", "index_cache_dtype"):
            value = getattr(self, name)
            if value not in CACHE_DTYPES:
                raise ValueError(f"{name}: expected one of {CACHE_DTYPES}, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed: expected an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.enforce_eager, bool):
            raise TypeError(f"enforce_eager: expected a bool, got {self.enforce_eager!r}")
        speculative = SpeculativeConfig.from_dict(self.speculative_config)
        draft = _draft_config(speculative, config, tp) if speculative is not None else None
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
                           draft=draft)


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

    def step_config(self) -> StepConfig:
        """The step planner's config of the engine: one rank's heads, the scheduler's limits."""
        sc = self.scheduler
        return StepConfig(num_q_heads=self.tp.num_q_heads, num_kv_heads=self.tp.num_kv_heads,
                          head_dim=self.config.head_dim, max_batch=sc.max_batch, max_num_tokens=sc.max_num_tokens,
                          max_blocks=sc.max_blocks, topk=self.config.index_topk_blocks,
                          graph_batch_sizes=sc.graph_batch_sizes)
