"""MiniMax-M3 text weights from safetensors, under one canonical naming.

Canonical names and shapes are those of transformers'
``MiniMaxM3VLForCausalLM.state_dict()`` (see :func:`expected_shapes`)::

    model.embed_tokens.weight                             [V, H]
    model.norm.weight                                     [H]
    lm_head.weight                                        [V, H]     (the embedding when tied)
    model.layers.{i}.input_layernorm.weight               [H]
    model.layers.{i}.post_attention_layernorm.weight      [H]
    model.layers.{i}.self_attn.q_proj.weight              [Hq * D, H]
    model.layers.{i}.self_attn.k_proj.weight              [Hk * D, H]
    model.layers.{i}.self_attn.v_proj.weight              [Hk * D, H]
    model.layers.{i}.self_attn.o_proj.weight              [H, Hq * D]
    model.layers.{i}.self_attn.q_norm.weight              [D]
    model.layers.{i}.self_attn.k_norm.weight              [D]
  sparse layers:
    model.layers.{i}.self_attn.indexer.q_proj.weight      [Hi * Di, H]
    model.layers.{i}.self_attn.indexer.k_proj.weight      [Di, H]
    model.layers.{i}.self_attn.indexer.q_norm.weight      [Di]
    model.layers.{i}.self_attn.indexer.k_norm.weight      [Di]
  dense MLP layers (gate rows first, then up rows):
    model.layers.{i}.mlp.gate_up_proj.weight              [2 * I_dense, H]
    model.layers.{i}.mlp.down_proj.weight                 [H, I_dense]
  MoE layers:
    model.layers.{i}.mlp.gate.weight                      [E, H]
    model.layers.{i}.mlp.gate.e_score_correction_bias     [E]
    model.layers.{i}.mlp.experts.gate_up_proj             [E, 2 * I, H]
    model.layers.{i}.mlp.experts.down_proj                [E, H, I]
    model.layers.{i}.mlp.shared_experts.gate_up_proj.weight  [2 * I_shared, H]
    model.layers.{i}.mlp.shared_experts.down_proj.weight     [H, I_shared]

Linear weights are ``[out, in]`` (``y = x @ W.T``). Accepted namings on disk:
that one (``save_pretrained`` of ``MiniMaxM3VLForCausalLM``), the original
MiniMax-M3 VL names of transformers' ``conversion_mapping.py`` entry
"minimax_m3_vl" (``language_model.model.*``, ``language_model.lm_head``,
``block_sparse_moe.{gate,e_score_correction_bias,shared_experts}``,
``block_sparse_moe.experts.{e}.w1/w3/w2``, ``self_attn.index_{q,k}_{proj,norm}``,
separate ``gate_proj``/``up_proj``), and the names of the VL model in
transformers (``model.language_model.*``). Vision tower, projector and MTP
tensors are skipped with one log line; any other unknown tensor, a missing
one or a wrong shape is a ``ValueError`` naming it.

Tensor parallelism: ``iter_weights(..., shard=TPPlan(config, tp).rank(r))``
yields rank ``r``'s part of every tensor (``m3_engine.tp``), read with
safetensors' ``get_slice`` from each stored piece (a packed gate/up slice
from the ``gate_proj``/``up_proj`` or ``w1``/``w3`` pieces it covers; under
expert parallelism only the rank's experts' pieces), so no process or device
ever holds a whole sharded tensor.

Framework-neutral: tensors are read by ``safetensors`` in the caller's
framework (``"pt"``: torch tensors, ``"numpy"``: numpy arrays, bfloat16 as
``ml_dtypes.bfloat16``) and merged with the caller's ``concatenate``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import numpy as np

from . import quantization
from .model_config import M3TextConfig, load_config, read_json
from .tp import RankShard, TensorSlice

__all__ = ["checkpoint_files", "checkpoint_index", "canonical_name", "expected_shapes", "iter_weights",
           "load_weights", "TensorReader", "SINGLE_FILE", "INDEX_FILE"]

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FRAMEWORKS = ("pt", "numpy")

# Tensors of a full VL checkpoint that the text model does not use.
_SKIPPED = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.|(^|\.)mtp\.")
# -> the prefix-free form "model.<rest>" / "lm_head.<rest>"
_PREFIXES = ((re.compile(r"^language_model\.model\."), "model."),
             (re.compile(r"^model\.language_model\."), "model."),
             (re.compile(r"^language_model\.lm_head\."), "lm_head."))
_RENAMES = ((re.compile(r"\.block_sparse_moe\.(experts|gate|shared_experts)\."), r".mlp.\1."),
            (re.compile(r"\.block_sparse_moe\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
            (re.compile(r"\.self_attn\.index_(q|k)_(proj|norm)\."), r".self_attn.indexer.\1_\2."))
# pieces merged into one canonical tensor (see canonical_name for their keys)
_EXPERT = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<w>w1|w2|w3)\.weight$")
_GATE_UP = re.compile(r"^(?P<base>.*)\.(?P<w>gate_proj|up_proj)\.weight$")


# -- files -----------------------------------------------------------------------------

def checkpoint_files(model_dir) -> list[Path]:
    """The safetensors files of a model directory: the shards listed in
    ``model.safetensors.index.json``, else ``model.safetensors``, else every
    ``*.safetensors`` (sorted)."""
    return sorted(set(checkpoint_index(model_dir).values()))


def checkpoint_index(model_dir) -> dict[str, Path]:
    """Tensor name (as stored) -> the file holding it."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: expected a non-empty 'weight_map' object")
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{index_path} lists shards that are not in {model_dir}: {missing}")
        return {name: model_dir / f for name, f in weight_map.items()}
    single = model_dir / SINGLE_FILE
    files = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_dir: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors in {model_dir}")
    index = {}
    for path in files:
        with _open_checked(path) as f:
            for name in f.keys():
                if name in index:
                    raise ValueError(f"tensor {name!r} is stored twice: in {index[name].name} and {path.name}")
                index[name] = path
    return index


# -- names -----------------------------------------------------------------------------

def canonical_name(name: str) -> tuple[str, tuple] | None:
    """Stored tensor name -> ``(canonical name, piece key)``, or None for a skipped tensor.

    The piece key places a tensor inside a merged canonical tensor: ``()`` for
    a whole tensor, ``(half,)`` for ``gate_proj`` (0) / ``up_proj`` (1),
    ``(expert, half)`` for ``w1`` (0) / ``w3`` (1) and ``(expert,)`` for ``w2``.
    The name is returned as is when it matches no rule (the caller decides
    whether it is known). A quantized checkpoint's scale tensor (``<weight>_scale_inv``,
    ``<weight>_scale``: ``m3_engine.quantization``) maps as its weight does, its suffix kept.
    """
    if _SKIPPED.search(name):
        return None
    for suffix in quantization.SCALE_SUFFIXES.values():
        if name.endswith(".weight" + suffix):
            weight = canonical_name(name.removesuffix(suffix))
            return None if weight is None else (weight[0] + suffix, weight[1])
    for pattern, repl in _PREFIXES:
        name = pattern.sub(repl, name)
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    if m := _EXPERT.match(name):
        e = int(m["e"])
        if m["w"] == "w2":
            return f"{m['base']}.down_proj", (e,)
        return f"{m['base']}.gate_up_proj", (e, 0 if m["w"] == "w1" else 1)
    if m := _GATE_UP.match(name):
        return f"{m['base']}.gate_up_proj.weight", (0 if m["w"] == "gate_proj" else 1,)
    return name, ()


def expected_shapes(config: M3TextConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape, for every tensor the model needs (``lm_head.weight`` included)."""
    c = config
    H, D, Di = c.hidden_size, c.head_dim, c.index_head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,),
              "lm_head.weight": (c.vocab_size, H)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (c.num_attention_heads * D, H),
            p + "self_attn.k_proj.weight": (c.num_key_value_heads * D, H),
            p + "self_attn.v_proj.weight": (c.num_key_value_heads * D, H),
            p + "self_attn.o_proj.weight": (H, c.num_attention_heads * D),
            p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
        })
        if c.sparse_layers[i]:
            shapes.update({
                p + "self_attn.indexer.q_proj.weight": (c.index_n_heads * Di, H),
                p + "self_attn.indexer.k_proj.weight": (Di, H),
                p + "self_attn.indexer.q_norm.weight": (Di,), p + "self_attn.indexer.k_norm.weight": (Di,),
            })
        if c.moe_layers[i]:
            E, I, Is = c.num_local_experts, c.intermediate_size, c.shared_intermediate_size
            shapes.update({
                p + "mlp.gate.weight": (E, H), p + "mlp.gate.e_score_correction_bias": (E,),
                p + "mlp.experts.gate_up_proj": (E, 2 * I, H), p + "mlp.experts.down_proj": (E, H, I),
                p + "mlp.shared_experts.gate_up_proj.weight": (2 * Is, H),
                p + "mlp.shared_experts.down_proj.weight": (H, Is),
            })
        else:
            I = c.dense_intermediate_size
            shapes.update({p + "mlp.gate_up_proj.weight": (2 * I, H), p + "mlp.down_proj.weight": (H, I)})
    return shapes


# -- loading ---------------------------------------------------------------------------

def iter_weights(model_dir, config: M3TextConfig | None = None, *, framework: str = "numpy",
                 concatenate: Callable | None = None, device: str = "cpu", shard: RankShard | None = None,
                 skip: Collection[str] = ()) -> Iterator[tuple[str, Any]]:
    """Yield ``(canonical name, tensor)`` for every tensor of :func:`expected_shapes`.

    model_dir:   a directory with config.json and safetensors (single file or sharded).
    config:      the model config (default: ``load_config(model_dir)``).
    framework:   ``"pt"`` (torch tensors) or ``"numpy"`` (numpy arrays; bfloat16
                 as ``ml_dtypes.bfloat16``: ``jnp.asarray`` takes them as is).
    concatenate: ``concatenate(list_of_tensors, axis)`` of the framework, used to
                 merge pieces (experts, gate/up): ``torch.cat`` for ``"pt"``;
                 ``np.concatenate`` by default for ``"numpy"``.
    device:      ``"pt"`` only: where safetensors puts the tensors (``"cuda:0"``, ...).
    shard:       one tensor-parallel rank (``m3_engine.tp.TPPlan(config, tp).rank(r)``):
                 yield that rank's part of each tensor, read with safetensors'
                 ``get_slice`` (never the whole tensor); None: whole tensors.
    skip:        canonical names not to read nor yield (e.g. ``"lm_head.weight"`` on a
                 rank that does not compute logits).

    A quantized checkpoint (``config.json``'s ``quantization_config``: ``m3_engine.quantization``)
    also yields each quantized weight's scale tensor right after the weight (a rank's slice: the
    blocks of its rows / columns). Tensors keep the checkpoint's dtype. Everything is checked before the first
    tensor is read: an unknown, missing or duplicated tensor raises
    ``ValueError`` naming it, skipped ones (vision, projector, ``mtp.*``) are
    logged once. Shapes are checked against the files' headers before a tensor
    is read (the whole tensor's shape, also when only a slice is read).
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework: expected one of {FRAMEWORKS}, got {framework!r}")
    if concatenate is None:
        if framework != "numpy":
            raise ValueError('concatenate: required for framework="pt" (pass torch.cat)')
        concatenate = np.concatenate
    config = load_config(model_dir) if config is None else config
    if shard is not None and shard.plan.config != config:
        raise ValueError("shard: its TPPlan was made for another model config")
    shapes = expected_shapes(config)
    method = quantization.checkpoint_quantization(model_dir)
    if method is not None:
        if shard is not None:
            quantization.check_fp8_shapes(shard.plan, shapes)
        with_scales = {}
        for name, shape in shapes.items():   # each scale right after its weight: the order they are yielded in
            with_scales[name] = shape
            if quantization.is_quantized(name):
                with_scales[quantization.scale_name(name, method)] = quantization.scale_shape(shape, method)
        shapes = with_scales
    plan = _plan(checkpoint_index(model_dir), shapes, config)
    reader = TensorReader(framework, device)
    try:
        for name, pieces in plan.items():
            if name in skip:
                continue
            full = _stored_shape(name, pieces, reader)
            if full != shapes[name]:
                raise ValueError(f"tensor {name!r} (from {_sources(pieces)}): expected shape {shapes[name]}, "
                                 f"got {full}")
            cut = None if shard is None else shard.slice(quantization.weight_name(name))
            if cut is not None and quantization.is_scale(name):
                cut = quantization.scale_slice(cut, len(full), method)
            tensor = _assemble(name, pieces, reader, concatenate, cut)
            want = shapes[name] if cut is None else cut.shape(shapes[name])
            if tuple(tensor.shape) != want:   # pieces of inconsistent shapes
                raise ValueError(f"tensor {name!r} (from {_sources(pieces)}): expected shape {want}, "
                                 f"got {tuple(tensor.shape)}")
            yield name, tensor
            if name == "model.embed_tokens.weight" and config.tie_word_embeddings and "lm_head.weight" not in skip:
                yield "lm_head.weight", tensor
    finally:
        reader.close()


def load_weights(model_dir, config: M3TextConfig | None = None, *, framework: str = "numpy",
                 concatenate: Callable | None = None, device: str = "cpu", shard: RankShard | None = None,
                 skip: Collection[str] = ()) -> dict[str, Any]:
    """``dict(iter_weights(...))``: canonical name -> tensor."""
    return dict(iter_weights(model_dir, config, framework=framework, concatenate=concatenate, device=device,
                             shard=shard, skip=skip))


# -- internals -------------------------------------------------------------------------

def _plan(index: dict[str, Path], shapes: dict, config: M3TextConfig) -> dict[str, dict]:
    """canonical name -> {piece key: (file, stored name)}, validated against ``shapes``."""
    plan, skipped, unknown = {}, [], []
    tied = config.tie_word_embeddings
    for stored in sorted(index):
        mapped = canonical_name(stored)
        if mapped is None:
            skipped.append(stored)
            continue
        name, key = mapped
        if name == "lm_head.weight" and tied:
            continue  # tied: the embedding is the head (transformers does the same)
        if name not in shapes:
            unknown.append(stored)
            continue
        pieces = plan.setdefault(name, {})
        if key in pieces:
            raise ValueError(f"tensor {name!r} is stored twice: as {pieces[key][1]!r} and {stored!r}")
        pieces[key] = (index[stored], stored)
    if skipped:
        logger.info("checkpoint: skipped %d tensors of the vision tower, projector and MTP head (e.g. %s)",
                    len(skipped), skipped[0])
    if unknown:
        raise ValueError(f"checkpoint has {len(unknown)} unknown tensor(s) for this config, e.g. {unknown[:3]}")
    wanted = [n for n in shapes if not (n == "lm_head.weight" and tied)]
    missing = [n for n in wanted if n not in plan]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    for name in wanted:
        _check_pieces(name, plan[name], config)
    return {n: plan[n] for n in wanted}


def _check_pieces(name, pieces: dict, config: M3TextConfig):
    """A merged tensor must have all its pieces and nothing else."""
    keys, name = set(pieces), quantization.weight_name(name)
    if keys == {()}:
        return
    if () in keys:
        raise ValueError(f"tensor {name!r} is stored both whole ({pieces[()][1]!r}) and in pieces")
    experts = range(config.num_local_experts)
    if name.endswith(".mlp.experts.gate_up_proj"):
        want = {(e, h): f"experts.{e}.{('w1', 'w3')[h]}.weight" for e in experts for h in (0, 1)}
    elif name.endswith(".mlp.experts.down_proj"):
        want = {(e,): f"experts.{e}.w2.weight" for e in experts}
    else:
        want = {(0,): "gate_proj.weight", (1,): "up_proj.weight"}
    extra = [pieces[k][1] for k in sorted(keys - set(want))]
    if extra:
        raise ValueError(f"tensor {name!r}: unexpected pieces {extra[:3]} (config has "
                         f"{config.num_local_experts} experts)")
    missing = [want[k] for k in sorted(set(want) - keys)]
    if missing:
        raise ValueError(f"tensor {name!r}: {len(missing)} piece(s) missing, e.g. {missing[:3]}")


def _sources(pieces: dict) -> str:
    names = [stored for _, stored in pieces.values()]
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"


# How a canonical tensor is made of its stored pieces (piece keys: see canonical_name):
#   ()             the whole tensor
#   (half,)        gate_proj / up_proj [I, H] -> gate_up_proj.weight [2I, H] (concatenated on axis 0)
#   (expert,)      experts.{e}.w2 [H, I] -> experts.down_proj [E, H, I] (stacked)
#   (expert, half) experts.{e}.w1 / w3 [I, H] -> experts.gate_up_proj [E, 2I, H] (stacked, halves on axis 1)

def _groups(name, pieces: dict):
    """-> (stacked, [[piece, ...] per stacked entry]): each entry is its pieces concatenated on
    axis 0 (of the piece); ``stacked``: entries stacked on a new axis 0 (experts)."""
    keys = sorted(pieces)
    if keys == [()]:
        return False, [[pieces[()]]]
    if len(keys[0]) == 1 and quantization.weight_name(name).endswith(".down_proj"):
        return True, [[pieces[k]] for k in keys]
    if len(keys[0]) == 1:
        return False, [[pieces[k] for k in keys]]
    experts = sorted({k[0] for k in keys})
    return True, [[pieces[(e, 0)], pieces[(e, 1)]] for e in experts]


def _stored_shape(name, pieces: dict, reader: TensorReader) -> tuple:
    """The canonical tensor's whole shape, from the files' headers (nothing read); a piece
    that does not fit the others gives a shape no config expects."""
    stacked, groups = _groups(name, pieces)
    shapes = []
    for group in groups:
        parts = [reader.shape(*p) for p in group]
        if any(len(s) != len(parts[0]) or s[1:] != parts[0][1:] for s in parts):
            return tuple(parts[0]) + ("inconsistent pieces",)
        shapes.append((sum(s[0] for s in parts),) + tuple(parts[0][1:]))
    if not stacked:
        return shapes[0]
    if any(s != shapes[0] for s in shapes):
        return (len(shapes),) + shapes[0] + ("inconsistent pieces",)
    return (len(shapes),) + shapes[0]


def _assemble(name, pieces: dict, reader: TensorReader, concatenate, cut: TensorSlice | None = None):
    """The canonical tensor (``cut``: only that part of it), reading no more of the files than it needs."""
    stacked, groups = _groups(name, pieces)
    if stacked and cut is not None and cut.dim == 0:   # expert parallel: the whole pieces of the rank's experts
        groups = [groups[e] for start, stop in cut.ranges for e in range(start, stop)]
        cut = None
    dim = None if cut is None else cut.dim - int(stacked)   # in the pieces' axes
    entries = [_read_concatenated(group, dim, None if cut is None else cut.ranges, reader, concatenate)
               for group in groups]
    if not stacked:
        return entries[0]
    return concatenate([e[None] for e in entries], 0)


def _read_concatenated(parts, dim, ranges, reader: TensorReader, concatenate):
    """``concatenate(parts, 0)`` (parts: ``(file, stored name)``), cut to ``ranges`` along ``dim``
    when ``dim`` is not None; only the needed slices are read."""
    if dim is None:
        arrays = [reader.get(*p) for p in parts]
    elif dim != 0:
        arrays = []
        for p in parts:
            cuts = [reader.get(*p, dim, start, stop) for start, stop in ranges]
            arrays.append(cuts[0] if len(cuts) == 1 else concatenate(cuts, dim))
    else:   # cut along the concatenation axis: map each range onto the parts it covers
        arrays, offset = [], 0
        for p in parts:
            n = reader.shape(*p)[0]
            for start, stop in ranges:
                lo, hi = max(start, offset), min(stop, offset + n)
                if lo < hi:
                    arrays.append(reader.get(*p, 0, lo - offset, hi - offset))
            offset += n
    return arrays[0] if len(arrays) == 1 else concatenate(arrays, 0)


def _open_checked(path: Path, **kwargs):
    """``safe_open(path)``; a truncated or corrupt file is a ``ValueError`` naming it."""
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(path, **{"framework": "numpy", **kwargs})
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


class TensorReader:
    """Open safetensors files once each; read tensors, or slices of them, in the caller's framework."""

    def __init__(self, framework, device):
        self.framework, self.device = framework, device
        self.files = {}

    def _file(self, path: Path):
        if path not in self.files:
            kwargs = {"device": self.device} if self.framework == "pt" else {}
            self.files[path] = _open_checked(path, framework=self.framework, **kwargs)
        return self.files[path]

    def shape(self, path: Path, stored: str) -> tuple:
        return tuple(self._file(path).get_slice(stored).get_shape())

    def get(self, path: Path, stored: str, dim: int | None = None, start: int = 0, stop: int = 0):
        """The tensor, or its index range ``[start, stop)`` along ``dim``."""
        f = self._file(path)
        index = None if dim is None else (slice(None),) * dim + (slice(start, stop),)
        try:
            return f.get_tensor(stored) if index is None else f.get_slice(stored)[index]
        except (TypeError, AttributeError):  # numpy cannot name bfloat16 / float8: the raw bytes through ml_dtypes
            return _read_raw(path, stored, index)

    def close(self):
        for f in self.files.values():
            exit_ = getattr(f, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self.files.clear()


_RAW_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _read_raw(path: Path, stored: str, index: tuple | None = None) -> np.ndarray:
    """One tensor (or ``tensor[index]``) of a safetensors file as a numpy array of an ``ml_dtypes`` dtype.

    The format: an 8-byte little-endian header size, a JSON header
    (``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``), the data.
    The file is memory-mapped: a slice reads only the pages it touches.
    """
    import ml_dtypes  # installed with JAX (not a dependency of the package); only bf16 / fp8 need it
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(header_size))[stored]
    dtype = _RAW_DTYPES.get(info["dtype"])
    if dtype is None:
        raise TypeError(f"tensor {stored!r} in {path.name}: unsupported dtype {info['dtype']}")
    begin, end = info["data_offsets"]
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_size + begin, shape=(end - begin,))
    array = data.view(getattr(ml_dtypes, dtype)).reshape(info["shape"])
    return np.array(array if index is None else array[index])
