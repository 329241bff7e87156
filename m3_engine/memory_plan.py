"""What each GPU of a MiniMax-M3 deployment holds: weights, KV pool, workspaces, and whether it fits.

    plan = plan_memory(m3_config(), tensor_parallel_size=4, weight_dtype="fp8", max_model_len=131072,
                       max_num_seqs=8, gpu_memory_bytes=139 << 30)
    print(plan.table())

    python -m m3_engine.memory_plan --m3 --tensor-parallel-size 4 --weight-dtype fp8 \\
        --max-model-len 131072 --max-num-seqs 8 --gpu-memory-gib 139

Every number is per GPU (per tensor-parallel rank), in bytes:

* **weights**: every tensor of ``checkpoint.expected_shapes`` at the shape one
  rank holds (``TPPlan.slice``: query heads, KV heads, ONE KV head replicated
  when ``tp > num_key_value_heads``, every expert split inside), summed by part.
  ``weight_dtype="fp8"``: the linear weights of attention, indexer, dense MLPs
  and experts are float8_e4m3fn with a float32 scale per 128 x 128 block (a
  rank's slice must start and end on a block); router, norms, embeddings and
  lm_head stay bfloat16. ``enable_expert_parallel`` (the engine option):
  each rank holds ``E / tp`` whole routed experts instead of a ``1 / tp``
  slice of every one (the same bytes). ``vocab_parallel`` (default True, what
  both engines do at ``tp > 1``): embeddings and lm_head split over the
  vocabulary, ``ceil(vocab_size / tp)`` rows a rank; False: both whole on
  every GPU (an engine that replicates them).
* **KV pool**: ``max_num_seqs`` requests of ``max_model_len`` tokens in pages
  of 128 tokens, laid out by ``m3_kernels.pool.PoolLayout`` for the rank's KV
  heads (K and V on every layer, the replicated index-K head on sparse layers).
* **workspaces** (an estimate; the basis of each line is in :data:`WORKSPACE_BASIS`).
* **budget**: with ``gpu_memory_bytes``, vLLM's ``gpu_memory_utilization``
  arithmetic: the KV pool gets ``gpu_memory_bytes * gpu_memory_utilization``
  less the weights and workspaces (:func:`kv_budget_bytes`), in whole pages
  (:func:`kv_pool_slots`); the plan fits when that holds the pages asked for.

Framework-neutral: pure Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

from m3_kernels.planner import PAGE_SIZE, StepConfig, StepPlanner
from m3_kernels.pool import ITEM_SIZE, PoolLayout

from .checkpoint import expected_shapes
from .model_config import DEFAULTS, M3TextConfig, load_config
from .scheduler import SchedulerConfig
from .tp import TPPlan

__all__ = ["MemoryPlan", "plan_memory", "kv_budget_bytes", "kv_pool_slots", "m3_config", "weight_part",
           "WEIGHT_PARTS", "WEIGHT_DTYPES", "WORKSPACE_BASIS", "main"]

WEIGHT_DTYPES = ("bfloat16", "fp8")
ACTIVATION_DTYPE = "bfloat16"   # activations and the "auto" caches, whatever the weights
FP8_BLOCK = 128                 # an FP8 weight has one float32 scale per FP8_BLOCK x FP8_BLOCK block
RUNTIME_BYTES = 1 << 30         # CUDA context, cuBLAS and NCCL buffers: an allowance, not derived

# canonical tensor name (layer prefix removed) -> the part of the weights it counts in
_PARTS = (
    (re.compile(r"^model\.embed_tokens\.weight$"), "embeddings"),
    (re.compile(r"^lm_head\.weight$"), "lm_head"),
    (re.compile(r"norm\.weight$"), "norms"),
    (re.compile(r"^self_attn\.indexer\.(q|k)_proj\.weight$"), "indexer"),
    (re.compile(r"^self_attn\.(q|k|v|o)_proj\.weight$"), "attention"),
    (re.compile(r"^mlp\.gate\.(weight|e_score_correction_bias)$"), "router"),
    (re.compile(r"^mlp\.experts\.(gate_up|down)_proj$"), "routed experts"),
    (re.compile(r"^mlp\.shared_experts\.(gate_up|down)_proj\.weight$"), "shared experts"),
    (re.compile(r"^mlp\.(gate_up|down)_proj\.weight$"), "dense MLPs"),
)
WEIGHT_PARTS = ("attention", "indexer", "dense MLPs", "routed experts", "shared experts", "router", "norms",
                "embeddings", "lm_head", "FP8 scales")
_FP8_PARTS = ("attention", "indexer", "dense MLPs", "routed experts", "shared experts")
_LAYER = re.compile(r"^model\.layers\.\d+\.")

WORKSPACE_BASIS = {
    "step arena": "StepPlanner.workspace_layout at max_num_seqs rows, max_num_batched_tokens tokens, max_model_len "
                  "(index scores, selected blocks, split-K partials): exact",
    "activations": "the largest tensors alive in one layer of an eager step of max_num_batched_tokens tokens (residual, "
                   "normed input, then the larger of attention's q/k/v/index/output and the MLP's: router "
                   "logits, fused_moe's act and float32 weighted rows for top_k + 1 experts a token); torch "
                   "frees a layer's temporaries before the next",
    "logits": "max_num_seqs rows x vocabulary in bfloat16 (one sampled row a request); vocab-parallel: plus "
              "the rank's own ceil(vocabulary / tp) columns before the all-gather",
    "CUDA graphs": "m3_torch's decode graphs, one per (batch in graph_batch_sizes, block bound 1, 2, 4 .. "
                   "max_model_len / 128): each keeps its output (the gathered logits, on every rank), and the "
                   "shared pool holds one layer's activations at the largest batch",
    "runtime": "CUDA context, cuBLAS and NCCL buffers: a fixed 1 GiB allowance, not derived (vLLM measures it)",
}


def weight_part(name: str) -> str:
    """Canonical tensor name -> its part of :data:`WEIGHT_PARTS` (``"FP8 scales"`` excepted)."""
    local = _LAYER.sub("", name)
    for pattern, part in _PARTS:
        if pattern.search(local):
            return part
    raise ValueError(f"name: {name!r} is not a tensor of the M3 text model")


def m3_config() -> M3TextConfig:
    """MiniMax-M3's text model as released: ``model_config.DEFAULTS`` (its sizes) with the
    release's layer pattern (layers 0-2 dense attention and a dense MLP, layers 3-59 MSA
    and MoE) and its 1M positions (``config.json`` of MiniMaxAI/MiniMax-M3)."""
    layers = DEFAULTS["num_hidden_layers"]
    moe = [0] * 3 + [1] * (layers - 3)
    return M3TextConfig.from_dict({"max_position_embeddings": 1 << 20, "dtype": "bfloat16",
                                   "moe_layer_freq": moe, "sparse_attention_config": {"sparse_attention_freq": moe}})


def kv_budget_bytes(gpu_memory_bytes: int, gpu_memory_utilization: float, used_bytes: int) -> int:
    """Bytes left for the KV pool: ``gpu_memory_bytes * gpu_memory_utilization`` less ``used_bytes``
    (weights and workspaces), vLLM's arithmetic; negative when those alone do not fit."""
    return int(gpu_memory_bytes * gpu_memory_utilization) - used_bytes


def kv_pool_slots(free_bytes: int, bytes_per_slot: int) -> int:
    """Whole pool slots (pages of 128 tokens, every layer) in ``free_bytes``; 0 when nothing is free.
    ``bytes_per_slot``: ``PoolLayout.slot_nbytes`` of the rank's layout (``MemoryPlan.kv_slot_bytes``)."""
    if isinstance(bytes_per_slot, bool) or not isinstance(bytes_per_slot, int) or bytes_per_slot < 1:
        raise ValueError(f"bytes_per_slot: expected an int >= 1, got {bytes_per_slot!r}")
    return max(0, free_bytes) // bytes_per_slot


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """One GPU's memory in a deployment (:func:`plan_memory` builds it; every number in bytes)."""
    config: M3TextConfig
    tp: TPPlan
    weight_dtype: str
    kv_cache_dtype: str           # resolved ("bfloat16", "float8_e4m3fn")
    index_cache_dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_expert_parallel: bool
    vocab_parallel: bool
    weights: dict                 # part of WEIGHT_PARTS -> bytes
    num_slots: int                # pool pages asked for: max_num_seqs requests of max_model_len tokens
    kv_slot_parts: dict           # "K/V", "index-K" -> bytes of one page (every layer)
    workspaces: dict              # line of WORKSPACE_BASIS -> bytes
    num_parameters: int           # of the whole model (every rank's share counted once)
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def kv_slot_bytes(self) -> int:
        """Bytes of one pool slot (a page of 128 tokens in every layer): what :func:`kv_pool_slots` takes."""
        return sum(self.kv_slot_parts.values())

    @property
    def kv_bytes(self) -> int:
        """The KV pool asked for."""
        return self.num_slots * self.kv_slot_bytes

    @property
    def workspace_bytes(self) -> int:
        return sum(self.workspaces.values())

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.workspace_bytes

    @property
    def kv_free_bytes(self) -> int | None:
        """What ``gpu_memory_utilization`` leaves for the KV pool after weights and workspaces."""
        if self.gpu_memory_bytes is None:
            return None
        return kv_budget_bytes(self.gpu_memory_bytes, self.gpu_memory_utilization,
                               self.weight_bytes + self.workspace_bytes)

    @property
    def kv_slots_fit(self) -> int | None:
        """Pool slots that fit in :attr:`kv_free_bytes`."""
        free = self.kv_free_bytes
        return None if free is None else kv_pool_slots(free, self.kv_slot_bytes)

    @property
    def fits(self) -> bool | None:
        """True when the pool asked for fits beside the weights and workspaces (None without a GPU size)."""
        slots = self.kv_slots_fit
        return None if slots is None else slots >= self.num_slots

    def table(self) -> str:
        """The plan as readable text."""
        c, tp = self.config, self.tp
        experts = (f"{c.num_local_experts // tp.size} whole routed experts a rank (expert parallel: the same "
                   f"bytes as splitting every expert inside)" if self.enable_expert_parallel else
                   f"every routed expert split inside ({c.intermediate_size // tp.size} of "
                   f"{c.intermediate_size} rows a rank)")
        vocab = ("embeddings and lm_head split over the vocabulary (the engines' split)" if self.vocab_parallel
                 else "embeddings and lm_head replicated")
        kv_heads = f"{tp.num_kv_heads} KV head{'s' * (tp.num_kv_heads > 1)} a rank" + (
            f", each replicated on {tp.kv_replicas} ranks" if tp.kv_replicas > 1 else "")
        num_sparse = sum(c.sparse_layers)
        weights_name = "FP8 (e4m3, 128x128 float32 scales)" if self.weight_dtype == "fp8" else "bfloat16"

        def row(label, nbytes):
            return f"  {label:<60}{_gib(nbytes):>10}"

        lines = [
            f"MiniMax-M3 memory per GPU: tensor_parallel_size={tp.size}, weights {weights_name}, "
            f"KV cache {self.kv_cache_dtype}, index-K cache {self.index_cache_dtype}",
            f"max_model_len {self.max_model_len}, max_num_seqs {self.max_num_seqs}, "
            f"max_num_batched_tokens {self.max_num_batched_tokens}",
            f"{experts}; {vocab}",
            f"parameters: {self.num_parameters / 1e9:.2f} B (text model; the vision tower, projectors and MTP "
            f"module of the release are not loaded)",
            "",
            f"{'weights':<62}{'GiB':>10}",
        ]
        lines += [row(part, b) for part, b in self.weights.items() if b or part != "FP8 scales"]
        lines += [row("total", self.weight_bytes), ""]
        lines += [
            f"KV pool: {self.max_num_seqs} requests x {self.max_model_len} tokens = {self.num_slots} pages of "
            f"{PAGE_SIZE} tokens, {self.kv_slot_bytes / 2 ** 20:.2f} MiB a page",
            row(f"K/V ({kv_heads}, {c.num_hidden_layers} layers)", self.num_slots * self.kv_slot_parts["K/V"]),
            row(f"index-K (1 head on every rank, {num_sparse} sparse layers)",
                self.num_slots * self.kv_slot_parts["index-K"]),
            row("total", self.kv_bytes),
            "",
            f"{'workspaces (estimate)':<62}{'GiB':>10}",
        ]
        lines += [row(name, b) for name, b in self.workspaces.items()]
        lines += [row("total", self.workspace_bytes), "", f"{'total':<62}{_gib(self.total_bytes):>10}"]
        if self.gpu_memory_bytes is not None:
            budget = int(self.gpu_memory_bytes * self.gpu_memory_utilization)
            free, slots = self.kv_free_bytes, self.kv_slots_fit
            requests = slots // -(-self.max_model_len // PAGE_SIZE)
            lines += [
                "",
                f"GPU {_gib(self.gpu_memory_bytes)} GiB x gpu_memory_utilization {self.gpu_memory_utilization} = "
                f"{_gib(budget)} GiB; after weights and workspaces {_gib(free)} GiB for KV: {slots} pages = "
                f"{slots * PAGE_SIZE} tokens = {requests} requests of {self.max_model_len} tokens",
            ]
            if self.fits:
                lines.append(f"verdict: fits ({_gib(free - self.kv_bytes)} GiB to spare)")
            else:
                lines.append(f"verdict: does NOT fit: needs {_gib(self.kv_bytes - free)} GiB more "
                             f"(max_num_seqs <= {requests} at this max_model_len)")
        return "\n".join(lines)


def plan_memory(config: M3TextConfig, *, tensor_parallel_size: int, weight_dtype: str = "bfloat16",
                kv_cache_dtype: str = "auto", index_cache_dtype: str = "auto", max_model_len: int,
                max_num_seqs: int, max_num_batched_tokens: int | None = None, enable_expert_parallel: bool = False,
                vocab_parallel: bool = True, gpu_memory_bytes: int | None = None,
                gpu_memory_utilization: float = 0.9) -> MemoryPlan:
    """The memory of one GPU of ``config`` served at ``tensor_parallel_size`` (see the module docstring).

    kv_cache_dtype, index_cache_dtype: "auto" (bfloat16) or "fp8", as the engine's options.
    max_model_len, max_num_seqs, max_num_batched_tokens: the engine options of these names
        (``max_num_batched_tokens`` default ``max(2048, max_num_seqs)``, the engine's).
    gpu_memory_bytes: the GPU's memory; None: no budget, no verdict.
    """
    if not isinstance(config, M3TextConfig):
        raise TypeError(f"config: expected an M3TextConfig, got {type(config).__name__}")
    tp = TPPlan(config, tensor_parallel_size)
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype: expected one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    for name, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len: expected <= max_position_embeddings={config.max_position_embeddings} "
                         f"of the model, got {max_model_len}")
    for name, value in (("enable_expert_parallel", enable_expert_parallel), ("vocab_parallel", vocab_parallel)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {value!r}")
    if gpu_memory_bytes is not None and (isinstance(gpu_memory_bytes, bool) or not isinstance(gpu_memory_bytes, int)
                                         or gpu_memory_bytes < 1):
        raise ValueError(f"gpu_memory_bytes: expected None or an int >= 1, got {gpu_memory_bytes!r}")
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) or \
            not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization: expected a number in (0, 1], got {gpu_memory_utilization!r}")
    # the engine's own limits: pool slots, max_num_batched_tokens default, graph batch sizes
    limits = SchedulerConfig.from_engine_args(config, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                              num_gpu_blocks_override=None,
                                              max_num_batched_tokens=max_num_batched_tokens)

    layout = PoolLayout.create(limits.num_slots, sparse=config.sparse_layers, num_kv_heads=tp.num_kv_heads,
                               head_dim=config.head_dim, index_head_dim=config.index_head_dim,
                               dtype=ACTIVATION_DTYPE, kv_cache_dtype=kv_cache_dtype,
                               index_cache_dtype=index_cache_dtype)
    kv_page = sum(2 * _page_nbytes(view.k) for view in layout.views())
    return MemoryPlan(
        config=config, tp=tp, weight_dtype=weight_dtype, kv_cache_dtype=layout.kv_cache_dtype,
        index_cache_dtype=layout.index_cache_dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=limits.max_num_tokens, enable_expert_parallel=enable_expert_parallel,
        vocab_parallel=vocab_parallel,
        weights=_weights(tp, weight_dtype, enable_expert_parallel=enable_expert_parallel,
                         vocab_parallel=vocab_parallel),
        num_slots=limits.num_slots, kv_slot_parts={"K/V": kv_page, "index-K": layout.slot_nbytes - kv_page},
        workspaces=_workspaces(tp, limits, vocab_parallel=vocab_parallel),
        num_parameters=sum(math.prod(s) for n, s in expected_shapes(config).items()
                           if not (n == "lm_head.weight" and config.tie_word_embeddings)),
        gpu_memory_bytes=gpu_memory_bytes, gpu_memory_utilization=gpu_memory_utilization)


# -- weights -----------------------------------------------------------------------------

def _weights(tp: TPPlan, weight_dtype: str, *, enable_expert_parallel: bool, vocab_parallel: bool) -> dict:
    """Part -> bytes of the weights one rank holds."""
    c = tp.config
    if enable_expert_parallel and c.num_local_experts % tp.size:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size={tp.size} does not divide "
                         f"num_local_experts={c.num_local_experts} (each rank holds E / tp whole experts)")
    parts = dict.fromkeys(WEIGHT_PARTS, 0)
    for name, shape in expected_shapes(c).items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue   # the embedding is the head
        part = weight_part(name)
        if part == "routed experts" and enable_expert_parallel:
            local = (shape[0] // tp.size,) + shape[1:]
        elif part in ("embeddings", "lm_head") and not vocab_parallel:
            local = shape
        else:   # the loader's slice (vocabulary tensors padded); every rank's has rank 0's shape
            local = tp.rank(0).shape(name, shape)
        if weight_dtype == "fp8" and part in _FP8_PARTS:
            _check_fp8_slice(tp, name, shape)
            parts[part] += math.prod(local)
            rows, cols = local[-2:]
            parts["FP8 scales"] += 4 * math.prod(local[:-2]) * -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)
        else:
            parts[part] += ITEM_SIZE[ACTIVATION_DTYPE] * math.prod(local)
    return parts


def _check_fp8_slice(tp: TPPlan, name: str, shape: tuple):
    """A rank's slice of an FP8 weight must start and end on a scale block (vLLM's rule too)."""
    cut = tp.slice(name, 0)
    if cut is None:
        return
    for rank in range(tp.size):
        for start, stop in tp.slice(name, rank).ranges:
            if start % FP8_BLOCK or (stop % FP8_BLOCK and stop != shape[cut.dim]):
                raise ValueError(f"weight_dtype='fp8': tensor_parallel_size={tp.size} gives rank {rank} rows "
                                 f"[{start}, {stop}) of {name} (axis {cut.dim}), not whole {FP8_BLOCK}-row "
                                 f"blocks of its scales")


# -- KV pool and workspaces --------------------------------------------------------------------

def _page_nbytes(view) -> int:
    """Bytes of one slot of a pool view (its logical shape past the slot axis)."""
    return math.prod(view.shape[1:]) * ITEM_SIZE[view.dtype]


def _workspaces(tp: TPPlan, limits: SchedulerConfig, *, vocab_parallel: bool) -> dict:
    """Line of :data:`WORKSPACE_BASIS` -> bytes (an estimate, per rank)."""
    c, local = tp.config, tp.local_config
    item = ITEM_SIZE[ACTIVATION_DTYPE]
    # the whole logits rows (vocab-parallel: gathered from every rank's slice, which is also alive)
    vocab = c.vocab_size + (tp.vocab_rows if vocab_parallel and tp.size > 1 else 0)
    arena = StepPlanner.workspace_layout(StepConfig(
        num_q_heads=tp.num_q_heads, num_kv_heads=tp.num_kv_heads, head_dim=c.head_dim,
        max_batch=limits.max_batch, max_num_tokens=limits.max_num_tokens, max_blocks=limits.max_blocks,
        topk=c.index_topk_blocks))
    bounds = {min(1 << i, limits.max_blocks) for i in range(limits.max_blocks.bit_length() + 1)}
    graph_rows = sum(limits.graph_batch_sizes) * len(bounds)
    graph_outputs = graph_rows * vocab * item   # every rank's graphs end with the gathered logits
    largest_graph = max(limits.graph_batch_sizes, default=0)
    return {
        "step arena": arena.nbytes,
        "activations": _layer_activation_bytes(local, limits.max_num_tokens, item),
        "logits": limits.max_batch * vocab * item,
        "CUDA graphs": graph_outputs + (_layer_activation_bytes(local, largest_graph, item) if largest_graph else 0),
        "runtime": RUNTIME_BYTES,
    }


def _layer_activation_bytes(local: M3TextConfig, tokens: int, item: int) -> int:
    """The largest tensors alive at once in one layer of a step of ``tokens`` tokens (one rank's
    ``local`` config): the residual stream and the normed input, then the larger of the attention
    (q/k/v and index projections, attention output, o_proj output) and the MLP."""
    h, d = local.hidden_size, local.head_dim
    stream = 2 * tokens * h * item
    attention = tokens * item * ((local.num_attention_heads + 2 * local.num_key_value_heads) * d
                                 + local.index_n_heads * local.index_head_dim + local.index_head_dim
                                 + local.num_attention_heads * d + h)
    mlp = 0
    if not all(local.moe_layers):   # gate/up output, SwiGLU output, down output
        mlp = tokens * item * (3 * local.dense_intermediate_size + h)
    if any(local.moe_layers):       # router logits (float32), fused_moe's act and float32 weighted rows, output
        pairs = tokens * (local.num_experts_per_tok + 1)
        mlp = max(mlp, tokens * local.num_local_experts * 4 + pairs * local.intermediate_size * item
                  + pairs * h * 4 + tokens * h * item)
    return stream + max(attention, mlp)


# -- command line ------------------------------------------------------------------------------

def _gib(nbytes: int) -> str:
    return f"{nbytes / 2 ** 30:.2f}"


def main(argv=None) -> int:
    """``python -m m3_engine.memory_plan (--model DIR | --m3) --tensor-parallel-size N ...``: print the table."""
    parser = argparse.ArgumentParser(prog="python -m m3_engine.memory_plan",
                                     description="What each GPU of a MiniMax-M3 deployment holds, and whether "
                                                 "it fits.")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="model folder (its config.json is read; no weights)")
    model.add_argument("--m3", action="store_true", help="MiniMax-M3 as released (m3_config())")
    parser.add_argument("--tensor-parallel-size", type=int, required=True)
    parser.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (bfloat16) or fp8")
    parser.add_argument("--index-cache-dtype", default="auto", help="auto (bfloat16) or fp8")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default max(2048, max-num-seqs)")
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--vocab-parallel", action=argparse.BooleanOptionalAction, default=True,
                        help="split embeddings and lm_head over the vocabulary (default: yes, as the engines do; "
                             "--no-vocab-parallel: replicated)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="the GPU's memory, GiB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args(argv)
    try:
        config = m3_config() if args.m3 else load_config(args.model)
        plan = plan_memory(
            config, tensor_parallel_size=args.tensor_parallel_size, weight_dtype=args.weight_dtype,
            kv_cache_dtype=args.kv_cache_dtype, index_cache_dtype=args.index_cache_dtype,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_expert_parallel=args.enable_expert_parallel, vocab_parallel=args.vocab_parallel,
            gpu_memory_bytes=None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * 2 ** 30),
            gpu_memory_utilization=args.gpu_memory_utilization)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.error(str(e))
    print(plan.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
