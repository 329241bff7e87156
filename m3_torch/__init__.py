"""PyTorch API of the MiniMax-M3 MSA kernels (custom ops in the ``m3`` namespace).

See SPEC.md / README.md for what each op computes. CUDA tensors run the
compiled Triton kernels; CPU tensors run the same kernels in Triton's
interpreter.
"""

from . import cache, reference
from .cache import allocate_pool, layer_caches, write_cache
from .decode import dense_decode, index_scores, msa_decode, select_blocks, sparse_decode
from .prefill import dense_prefill, index_scores_prefill, msa_prefill, select_blocks_prefill, sparse_prefill
from .step import msa_attention_step

__all__ = ["index_scores", "select_blocks", "sparse_decode", "dense_decode", "msa_decode", "reference",
           "cache", "allocate_pool", "layer_caches", "write_cache",
           "index_scores_prefill", "select_blocks_prefill", "sparse_prefill", "dense_prefill", "msa_prefill",
           "msa_attention_step"]
