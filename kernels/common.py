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
def dot_operand(x):
    if WIDEN_DOT_OPERANDS:
        x = x.to(tl.float32)
    return x
