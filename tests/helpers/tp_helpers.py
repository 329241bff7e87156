"""Functions the tensor-parallel tests run on every rank through ``LLM.collective_rpc``.

They live in a module of their own so that a worker process (spawned: it
imports them by name) imports only this and torch, not a test module.
"""

import numpy as np


def rank_info(runner) -> dict:
    """What a rank holds: its heads, its fused q/k/v(/index) rows per layer, its experts' and vocabulary
    rows, its pool's heads."""
    m = runner.model
    c = m.config
    return dict(rank=runner.rank, device=str(runner.device),
                heads=(c.num_attention_heads, c.num_key_value_heads, c.index_n_heads),
                qkv_rows=[layer.qkv.shape[0] for layer in m.layers],
                expert_rows=[None if layer.experts_gate_up is None else tuple(layer.experts_gate_up.shape)
                             for layer in m.layers],
                expert_start=m.expert_start, vocab=(m.vocab_start, tuple(m.embed.shape), tuple(m.lm_head.shape)),
                pool_kv_heads=sorted({s.num_kv_heads for s in runner.layout.layers}),
                graphs=sorted(runner.graphs.graphs) if runner.graphs is not None else None)


def layer_caches(runner, layer: int, slots) -> tuple:
    """A layer's K, V and index-K pages ``slots`` on this rank, as numpy float32 arrays."""
    cache = runner.caches[layer]

    def host(t):
        return None if t is None else t[list(slots)].float().cpu().numpy()

    return host(cache.k_cache), host(cache.v_cache), host(cache.index_k_cache)


def fail_in_next_step(runner, rank: int):
    """Make rank ``rank``'s next step raise."""
    if runner.rank == rank:
        def broken(*args, **kwargs):
            raise RuntimeError(f"injected fault on rank {rank}")
        runner.model.hidden_states = broken
    return runner.rank


def nothing(runner):
    return np.int64(runner.rank)
