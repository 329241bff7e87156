"""Constants and tiny @triton.jit helpers shared by the kernel files."""

import triton
import triton.language as tl

# Tokens per sparse block and per KV page. Fixed by the model; see SPEC.md.
PAGE_SIZE = tl.constexpr(128)

# Triton 3.6-3.9's interpreter computes tl.dot on two bf16 operands wrongly on
# CPU. This module is loaded once per mode (see __init__.py), so the flag is
# True exactly in the interpreted copy, where dot operands are widened to fp32.
WIDEN_DOT_OPERANDS = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def mma(a, b):
    """a @ b with float32 accumulation.

    float32 operands use 3xTF32 (near-fp32 accuracy: SPEC asks fp32 inputs to
    land under 1e-3, which plain TF32 misses after two chained products).
    """
    if WIDEN_DOT_OPERANDS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="tf32x3")
    else:
        out = tl.dot(a, b)
    return out
