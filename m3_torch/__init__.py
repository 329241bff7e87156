"""PyTorch API of the MiniMax-M3 MSA kernels (custom ops in the ``m3`` namespace).

See SPEC.md / README.md for what each op computes. CUDA tensors run the
compiled Triton kernels; CPU tensors run the same kernels in Triton's
interpreter.
"""

from . import reference
from .decode import dense_decode, index_scores, msa_decode, select_blocks, sparse_decode

__all__ = ["index_scores", "select_blocks", "sparse_decode", "dense_decode", "msa_decode", "reference"]
