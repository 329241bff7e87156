"""A tiny random MiniMax-M3 checkpoint in the Hugging Face format, for tests and the demo.

:func:`write_tiny_checkpoint` writes a directory that looks like a (very
small) MiniMax-M3 VL release:

* ``config.json``: the VL config (``model_type: "minimax_m3_vl"``) with the
  text model under ``text_config`` in the checkpoint's legacy form
  (``sparse_attention_config``, ``moe_layer_freq``), both ``rotary_dim`` and
  ``rope_parameters.partial_rotary_factor`` (consistent), and a tiny
  ``vision_config``;
* ``model.safetensors`` (or shards + ``model.safetensors.index.json``) with the
  ORIGINAL tensor names (``language_model.model.*``, ``language_model.lm_head``,
  ``block_sparse_moe.experts.{e}.w1/w2/w3``, ``self_attn.index_q_proj``, ...)
  plus a few projector, vision and ``mtp.*`` tensors that a text engine skips;
* ``tokenizer.json``: a byte-level BPE trained on a short built-in text (so any
  text encodes), padded with unused special tokens to ``vocab_size``;
  ``<pad>`` = 0, ``<s>`` = 1 (bos, added in front of every encoded text by the
  post-processor), ``</s>`` = 2 (eos);
* ``tokenizer_config.json`` with a chat template (:data:`CHAT_TEMPLATE`) and
  ``generation_config.json`` with the bos / eos ids.

From the command line: ``python -m m3_engine.tiny_model DIR`` writes it to DIR.

``form="text"`` writes instead what ``save_pretrained`` of transformers'
``MiniMaxM3VLForCausalLM`` writes: a flat text config and the canonical names
of ``m3_engine.checkpoint``.

Default shapes (CPU tests through Triton's interpreter): 4 layers (layer 0
dense attention + dense MLP, layers 1-3 MSA + MoE), hidden 128, 4 query / 2 KV
heads of 32, 2 index heads of 32, top-2 blocks of 128 (selection matters from
384 tokens on), 4 experts (top 2) of 32, vocabulary 512.

Framework-neutral: numpy, safetensors and tokenizers only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .quantization import CHECKPOINT_METHODS, FP8_BLOCK, MX_BLOCK, SCALE_SUFFIXES, is_quantized, scale_name

__all__ = ["write_tiny_checkpoint", "tiny_text_config", "tiny_fp8_config", "PAD_ID", "BOS_ID", "EOS_ID",
           "CHAT_TEMPLATE", "main"]

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIALS = ("<pad>", "<s>", "</s>")
# A ChatML-like template written with the tiny tokenizer's own special tokens ("role: content</s>\n"),
# whose tool and thinking parts are MiniMax-M3's (its chat_template.jinja, which wraps each message in
# "]~b]role\n" ... "[e~[\n" instead):
# * tools: listed after the system message's text in M3's words (M3 puts them in its developer
#   message; "You are a helpful assistant." when the conversation has no system message);
# * an assistant turn: "<mm:think>reasoning_content</mm:think>", or a bare "</mm:think>" without
#   reasoning, then its content, then its tool calls as M3 markup (m3_engine.tool_parser); written
#   right after "assistant:", where generation starts, so the model's own output looks the same;
# * a run of tool results: one "tool" message of "\n<response>...</response>" each;
# * the generation prompt: "assistant:" and, by thinking_mode, "<mm:think>" ("enabled") or
#   "</mm:think>" ("disabled"), nothing otherwise (M3's default, "adaptive").
# Tool-call arguments must be dicts (transformers' convention; m3_engine.tokenizer parses OpenAI's
# JSON strings).
CHAT_TEMPLATE = r"""
{%- set NS = ']<]minimax[>[' -%}
{%- macro to_xml(value) -%}
    {%- if value is mapping -%}
        {%- for key, item in value.items() if item is not none -%}
            {{ NS }}<{{ key }}>{{ to_xml(item) }}{{ NS }}</{{ key }}>
        {%- endfor -%}
    {%- elif value is string -%}
        {{ value }}
    {%- elif value is sequence -%}
        {%- for item in value -%}
            {{ NS }}<item>{{ to_xml(item) }}{{ NS }}</item>
        {%- endfor -%}
    {%- elif value is boolean -%}
        {{ 'true' if value else 'false' }}
    {%- elif value is not none -%}
        {{ value }}
    {%- endif -%}
{%- endmacro -%}
{%- macro tools_section() -%}
    {{ '\n\n# Tools\nYou may call one or more tools to assist with the user query.\n'
       'Here are the tools available in JSONSchema format:\n\n<tools>\n' }}
    {%- for tool in tools -%}
        <tool>{{ (tool.function if tool.function is defined else tool) | tojson }}</tool>{{ '\n' }}
    {%- endfor -%}
    </tools>{{ '\n\nTo call tools, wrap all invocations in a single ' }}
    {{- NS }}<tool_call>{{ NS }}</tool_call>{{ ' block. Parameter values containing nested objects or arrays '
       'are recursively expanded into XML elements. Example:\n\n' }}
    {{- NS }}<tool_call>{{ '\n' }}
    {{- NS }}<invoke name="tool-name-1">{{ NS }}<param-1>value-1{{ NS }}</param-1>{{ NS }}<param-2>
    {{- NS }}<item>{{ NS }}<key-a>val-a{{ NS }}</key-a>{{ NS }}<key-b>val-b{{ NS }}</key-b>{{ NS }}</item>
    {{- NS }}</param-2>{{ NS }}</invoke>{{ '\n' }}
    {{- NS }}<invoke name="tool-name-2">{{ NS }}<param-1>value-1{{ NS }}</param-1>{{ NS }}</invoke>{{ '\n' }}
    {{- NS }}</tool_call>
{%- endmacro -%}
{{ bos_token }}
{%- if tools and messages[0]['role'] != 'system' -%}
    system: You are a helpful assistant.{{ tools_section() }}{{ eos_token }}{{ '\n' }}
{%- endif -%}
{%- for message in messages -%}
    {%- set content = message['content'] if message['content'] is not none else '' -%}
    {%- if message['role'] not in ('system', 'user', 'assistant', 'tool') -%}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {%- elif message['role'] == 'tool' -%}
        {%- if loop.first or loop.previtem['role'] != 'tool' -%}tool:{%- endif -%}
        {{ '\n' }}<response>{{ content }}</response>
        {%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{ eos_token }}{{ '\n' }}{%- endif -%}
    {%- elif message['role'] == 'assistant' -%}
        assistant:{% if message['reasoning_content'] -%}
            <mm:think>{{ message['reasoning_content'] }}</mm:think>
        {%- else -%}
            </mm:think>
        {%- endif -%}
        {{ content }}
        {%- if message['tool_calls'] -%}
            {{ NS }}<tool_call>{{ '\n' }}
            {%- for call in message['tool_calls'] -%}
                {%- set function = call['function'] if call['function'] is defined else call -%}
                {{ NS }}<invoke name="{{ function['name'] }}">
                {%- for key, value in function['arguments'].items() if value is not none -%}
                    {{ NS }}<{{ key }}>{{ to_xml(value) }}{{ NS }}</{{ key }}>
                {%- endfor -%}
                {{ NS }}</invoke>{{ '\n' }}
            {%- endfor -%}
            {{ NS }}</tool_call>
        {%- endif -%}
        {{ eos_token }}{{ '\n' }}
    {%- else -%}
        {{ message['role'] }}: {{ content }}
        {%- if loop.first and message['role'] == 'system' and tools -%}{{ tools_section() }}{%- endif -%}
        {{ eos_token }}{{ '\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    assistant:
    {%- if thinking_mode == 'enabled' -%}<mm:think>{%- elif thinking_mode == 'disabled' -%}</mm:think>{%- endif -%}
{%- endif -%}
"""
_CORPUS = """\
MiniMax M3 reads long documents with sparse attention: a light indexer scores every block of one hundred
and twenty eight cached tokens, keeps the best sixteen blocks and the local one, and the main attention
then runs exactly over the tokens of those blocks. The first layers stay dense. Each request owns a few
slots of the paged cache; when it finishes, the slots go back to the pool and the next request reuses them.
A prompt is split into chunks; the scheduler puts the context rows first and the generation rows last.
The quick brown fox jumps over the lazy dog while the model writes one token after another, greedy or
sampled with a temperature and a nucleus of top p, until it meets the end of sequence or its budget.
"""


def tiny_text_config(*, vocab_size=512, hidden_size=128, num_hidden_layers=4, num_dense_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16, rope_theta=10000.0,
                     index_head_dim=32, index_topk_blocks=2, index_local_blocks=1, num_local_experts=4,
                     num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=32,
                     dense_intermediate_size=64, dtype="float32") -> dict:
    """The ``text_config`` dict of the tiny model, in the checkpoint's legacy form.

    The first ``num_dense_layers`` layers use dense attention and a dense MLP,
    the rest MSA and MoE.
    """
    dense = [i < num_dense_layers for i in range(num_hidden_layers)]
    return {
        "model_type": "minimax_m3_vl_text",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
        "rotary_dim": rotary_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta,
                            "partial_rotary_factor": rotary_dim / head_dim},
        "sparse_attention_config": {
            "sparse_attention_freq": [0 if d else 1 for d in dense],
            "sparse_num_index_heads": num_key_value_heads, "sparse_index_dim": index_head_dim,
            "sparse_block_size": 128, "sparse_topk_blocks": index_topk_blocks,
            "sparse_local_block": index_local_blocks,
        },
        "moe_layer_freq": [0 if d else 1 for d in dense],
        "intermediate_size": intermediate_size, "shared_intermediate_size": shared_intermediate_size,
        "dense_intermediate_size": dense_intermediate_size, "num_local_experts": num_local_experts,
        "num_experts_per_tok": num_experts_per_tok, "routed_scaling_factor": 2.0,
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "hidden_act": "swigluoai",
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "tie_word_embeddings": False, "dtype": dtype,
    }


def tiny_fp8_config() -> dict:
    """Keyword arguments of :func:`tiny_text_config` (and :func:`write_tiny_checkpoint`) for a tiny model
    whose quantized weights are whole 128 x 128 blocks (the FP8 kernels' unit): 2 layers (layer 0 dense
    attention + dense MLP, layer 1 MSA + MoE), hidden 128, 2 query / 1 KV heads of 128, 1 index head of
    128, 4 experts (top 2) of 128, shared expert and dense MLP of 128."""
    return dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                index_head_dim=128, intermediate_size=128, shared_intermediate_size=128, dense_intermediate_size=128)


def write_tiny_checkpoint(path, *, seed: int = 0, dtype: str = "float32", form: str = "vl", num_shards: int = 1,
                          quantization: str | None = None, **config_overrides) -> Path:
    """Write a tiny random M3 checkpoint to directory ``path`` (created); -> ``Path(path)``.

    seed:       weights are a function of the seed (and the shapes) only.
    dtype:      "float32" | "bfloat16" | "float16", of every tensor.
    form:       "vl" (nested config, original tensor names, plus vision/projector/mtp
                tensors) or "text" (flat config, transformers' text-model names).
    num_shards: > 1 writes ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``.
    quantization: None, "fp8" or "mxfp8": the linear weights of ``m3_engine.quantization.is_quantized``
                as a quantized checkpoint stores them (the same random weights, rounded to ``dtype``,
                then quantized), with config.json's ``quantization_config``: "fp8": e4m3 +
                ``weight_scale_inv`` float32 per 128 x 128 block (DeepSeek-V3's format; quantized as
                ``m3_torch.fp8.quantize_weight`` does, bit for bit); "mxfp8": e4m3 + ``weight_scale``
                uint8 UE8M0 exponents per 1 x 32 block along K. Every dimension of those weights must
                then be a multiple of 128 (see :func:`tiny_fp8_config`).
    config_overrides: keyword arguments of :func:`tiny_text_config` (``hidden_size=64``, ...).
    """
    from safetensors.numpy import save_file

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: expected 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if form not in ("vl", "text"):
        raise ValueError(f"form: expected 'vl' or 'text', got {form!r}")
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards: expected an int >= 1, got {num_shards!r}")
    if quantization not in (None,) + CHECKPOINT_METHODS:
        raise ValueError(f"quantization: expected None or one of {CHECKPOINT_METHODS}, got {quantization!r}")
    text = tiny_text_config(dtype=dtype, **config_overrides)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    np_dtype = {"float32": np.float32, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        import ml_dtypes  # installed with JAX (not a dependency of the package); only bfloat16 needs it
        np_dtype = ml_dtypes.bfloat16
    tensors = _random_weights(text, np.random.default_rng(seed))
    stored = set()   # quantized tensors and scales: kept as they are
    if quantization is not None:
        quantize = _quantize_fp8 if quantization == "fp8" else _quantize_mxfp8
        for name in [n for n in tensors if is_quantized(n)]:
            codes, scale = quantize(tensors[name].astype(np_dtype).astype(np.float32))
            tensors[name], tensors[scale_name(name, quantization)] = codes, scale
            stored |= {name, scale_name(name, quantization)}
    if form == "vl":
        config = _vl_config(text)
        stored = {_original_name(n) for n in stored}
        tensors = _split_merged({_original_name(n): t for n, t in tensors.items()}, stored)
        tensors.update(_extra_vl_tensors(config, np.random.default_rng(seed + 1)))
    else:
        config = _flat_config(text)
    if quantization is not None:
        config["quantization_config"] = (
            {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
            if quantization == "fp8" else {"quant_method": "mxfp8"})
    tensors = {n: np.ascontiguousarray(t if n in stored else t.astype(np_dtype)) for n, t in sorted(tensors.items())}

    for old in list(path.glob("*.safetensors")) + [path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(tensors, path / "model.safetensors", metadata=metadata)
    else:
        names = list(tensors)
        weight_map = {}
        for i, chunk in enumerate(np.array_split(np.arange(len(names)), num_shards)):
            shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
            save_file({names[j]: tensors[names[j]] for j in chunk}, path / shard, metadata=metadata)
            weight_map.update({names[j]: shard for j in chunk})
        total = sum(t.nbytes for t in tensors.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer(text["vocab_size"]).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE}, indent=2))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, indent=2))
    return path


# -- weights ---------------------------------------------------------------------------

def _random_weights(text: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Canonical (transformers text-model) names -> float64 arrays. Linear weights
    ~ N(0, 1/fan_in); norm weights ~ N(0, 0.1) (the norms scale by 1 + weight)."""
    H, V = text["hidden_size"], text["vocab_size"]
    Hq, Hk, D = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    sparse = text["sparse_attention_config"]
    Hi, Di = sparse["sparse_num_index_heads"], sparse["sparse_index_dim"]
    E = text["num_local_experts"]
    I, Is, Id = text["intermediate_size"], text["shared_intermediate_size"], text["dense_intermediate_size"]

    def linear(*shape):
        return rng.standard_normal(shape) / np.sqrt(shape[-1])

    def norm(n):
        return 0.1 * rng.standard_normal(n)

    w = {"model.embed_tokens.weight": rng.standard_normal((V, H))}
    for i in range(text["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                  p + "self_attn.q_proj.weight": linear(Hq * D, H), p + "self_attn.k_proj.weight": linear(Hk * D, H),
                  p + "self_attn.v_proj.weight": linear(Hk * D, H), p + "self_attn.o_proj.weight": linear(H, Hq * D),
                  p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D)})
        if sparse["sparse_attention_freq"][i]:
            w.update({p + "self_attn.indexer.q_proj.weight": linear(Hi * Di, H),
                      p + "self_attn.indexer.k_proj.weight": linear(Di, H),
                      p + "self_attn.indexer.q_norm.weight": norm(Di),
                      p + "self_attn.indexer.k_norm.weight": norm(Di)})
        if text["moe_layer_freq"][i]:
            w.update({p + "mlp.gate.weight": linear(E, H),
                      p + "mlp.gate.e_score_correction_bias": 0.1 * rng.standard_normal(E),
                      p + "mlp.experts.gate_up_proj": linear(E, 2 * I, H),
                      p + "mlp.experts.down_proj": linear(E, H, I),
                      p + "mlp.shared_experts.gate_up_proj.weight": linear(2 * Is, H),
                      p + "mlp.shared_experts.down_proj.weight": linear(H, Is)})
        else:
            w.update({p + "mlp.gate_up_proj.weight": linear(2 * Id, H), p + "mlp.down_proj.weight": linear(H, Id)})
    w["model.norm.weight"] = norm(H)
    w["lm_head.weight"] = linear(V, H)
    return w


def _original_name(name: str) -> str:
    """Canonical name -> the MiniMax-M3 VL checkpoint's name (before splitting merged tensors)."""
    if name.startswith("lm_head."):
        return "language_model." + name
    name = "language_model." + name
    for new, old in ((".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"),
                     (".mlp.gate.", ".block_sparse_moe.gate."), (".mlp.experts.", ".block_sparse_moe.experts."),
                     (".mlp.shared_experts.", ".block_sparse_moe.shared_experts."),
                     (".self_attn.indexer.q_", ".self_attn.index_q_"),
                     (".self_attn.indexer.k_", ".self_attn.index_k_")):
        name = name.replace(new, old)
    return name


def _split_merged(tensors: dict, stored: set) -> dict:
    """Merged tensors -> the original per-expert / gate-up pieces (a quantized weight's scales split as the
    weight does; the pieces of a name in ``stored`` are added to it)."""
    out = {}
    for name, t in tensors.items():
        suffix = next((s for s in SCALE_SUFFIXES.values() if name.endswith(s)), "")   # a scale's, or none
        merged = name.removesuffix(suffix) if suffix else name
        pieces = {}
        if merged.endswith(".experts.gate_up_proj"):
            base, half = merged.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                pieces[f"{base}.{e}.w1.weight{suffix}"] = t[e, :half]
                pieces[f"{base}.{e}.w3.weight{suffix}"] = t[e, half:]
        elif merged.endswith(".experts.down_proj"):
            base = merged.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                pieces[f"{base}.{e}.w2.weight{suffix}"] = t[e]
        elif merged.endswith(".gate_up_proj.weight"):
            base, half = merged.removesuffix(".gate_up_proj.weight"), t.shape[0] // 2
            pieces[f"{base}.gate_proj.weight{suffix}"], pieces[f"{base}.up_proj.weight{suffix}"] = t[:half], t[half:]
        else:
            pieces[name] = t
        if name in stored:
            stored |= set(pieces)
        out.update(pieces)
    return out


def _quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[..., N, K]`` -> (e4m3 codes, float32 scales ``[..., ceil(N / 128), ceil(K / 128)]``):
    ``m3_torch.fp8.quantize_weight``'s formula in float32 numpy (the same bits)."""
    import ml_dtypes
    *lead, n, k = w.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = np.zeros((*lead, nb * FP8_BLOCK, kb * FP8_BLOCK), np.float32)
    padded[..., :n, :k] = w
    blocks = padded.reshape(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    scale = np.maximum(np.abs(blocks).max(axis=(-3, -1)), np.float32(1e-12)) / np.float32(448.0)
    codes = np.clip(blocks / scale[..., :, None, :, None], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return codes.reshape(padded.shape)[..., :n, :k], scale


def _quantize_mxfp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[..., N, K]`` (K a multiple of 32) -> (e4m3 codes, uint8 UE8M0 scales ``[..., N, K / 32]``):
    per 1 x 32 block the smallest power of two ``2 ** e`` with ``amax / 2 ** e <= 448``, stored as ``e + 127``."""
    import ml_dtypes
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    exponent = np.clip(np.ceil(np.log2(np.maximum(amax, np.float32(2.0 ** -126)) / np.float32(448.0))), -127, 127)
    codes = np.clip(blocks / np.exp2(exponent)[..., None], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return codes.reshape(w.shape), (exponent + 127).astype(np.uint8)


def _extra_vl_tensors(config: dict, rng: np.random.Generator) -> dict:
    """Projector, vision and MTP tensors a text engine must skip (shapes as transformers builds them)."""
    vision, text = config["vision_config"], config["text_config"]
    P, Hv, H = config["projector_hidden_size"], vision["hidden_size"], text["hidden_size"]
    merged = H * vision["spatial_merge_size"] ** 2
    shapes = {"multi_modal_projector.linear_1.weight": (P, Hv), "multi_modal_projector.linear_1.bias": (P,),
              "multi_modal_projector.linear_2.weight": (H, P), "multi_modal_projector.linear_2.bias": (H,),
              "patch_merge_mlp.linear_1.weight": (P, merged), "patch_merge_mlp.linear_1.bias": (P,),
              "patch_merge_mlp.linear_2.weight": (H, P), "patch_merge_mlp.linear_2.bias": (H,),
              "vision_tower.vision_model.pre_layrnorm.weight": (Hv,),
              "vision_tower.vision_model.pre_layrnorm.bias": (Hv,),
              "mtp.layers.0.eh_proj.weight": (H, 2 * H), "mtp.layers.0.enorm.weight": (H,)}
    return {n: 0.02 * rng.standard_normal(s) for n, s in shapes.items()}


# -- configs and tokenizer -------------------------------------------------------------

def _vl_config(text: dict) -> dict:
    vision = {"model_type": "minimax_m3_vl_vision", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_channels": 3, "image_size": 56,
              "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2}
    return {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
            "text_config": text, "vision_config": vision, "projector_hidden_size": 64,
            "image_token_index": 3, "video_token_index": 4, "tie_word_embeddings": False, "dtype": text["dtype"]}


def _flat_config(text: dict) -> dict:
    """The text config as ``MiniMaxM3VLTextConfig.save_pretrained`` would write it (flat keys)."""
    config = {k: v for k, v in text.items() if k not in ("sparse_attention_config", "moe_layer_freq")}
    sparse = text["sparse_attention_config"]
    config.update({
        "architectures": ["MiniMaxM3VLForCausalLM"],
        "layer_types": ["minimax_m3_sparse" if f else "full_attention" for f in sparse["sparse_attention_freq"]],
        "mlp_layer_types": ["sparse" if f else "dense" for f in text["moe_layer_freq"]],
        "index_n_heads": sparse["sparse_num_index_heads"], "index_head_dim": sparse["sparse_index_dim"],
        "index_block_size": sparse["sparse_block_size"], "index_topk_blocks": sparse["sparse_topk_blocks"],
        "index_local_blocks": sparse["sparse_local_block"], "hidden_act": "silu",
    })
    return config


def _tokenizer(vocab_size: int):
    """Byte-level BPE trained on ``_CORPUS``, padded with ``<|unused_i|>`` to ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size: expected >= {tok.get_vocab_size()} (the byte alphabet and specials), "
                         f"got {vocab_size}")
    tok.add_special_tokens([f"<|unused_{i}|>" for i in range(vocab_size - tok.get_vocab_size())])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS_ID)])
    return tok


def main(argv=None) -> int:
    """``python -m m3_engine.tiny_model DIR [--form text|vl] [--dtype ...] [--seed N]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m m3_engine.tiny_model",
                                     description="Write a tiny random MiniMax-M3 checkpoint (config, safetensors, "
                                                 "tokenizer, chat template) to try the engine, the CLI and the server.")
    parser.add_argument("dir", type=Path, help="folder to write (created)")
    parser.add_argument("--form", choices=("vl", "text"), default="vl",
                        help="vl: the original VL release layout (default); text: transformers' save_pretrained")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_tiny_checkpoint(args.dir, seed=args.seed, dtype=args.dtype, form=args.form)
    print(f"wrote a tiny random MiniMax-M3 checkpoint to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
