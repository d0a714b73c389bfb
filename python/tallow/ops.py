"""The core ops, as functions over tallow.Tensor (see cpp/ops/*.h for each contract), and the kernel
tuning struct (cpp/core/tuning.h: kernel_tuning(), set_kernel_tuning(**fields), and
kernel_tuning_override(**fields) for a block of code)."""
from contextlib import contextmanager

from tallow._core import (  # noqa: F401
    add,
    apply_penalties,
    apply_token_bitmask_,
    argmax,
    attention,
    cast,
    dequantize,
    embedding,
    fill_from_previous_,
    fill_uniform_,
    fused_add_rms_norm,
    gated_linear,
    gelu_and_mul,
    kernel_tuning,
    kernel_tuning_fields,
    layer_norm,
    linear,
    logprobs,
    matmul,
    mul,
    paged_attention,
    quant_linear,
    quant_linear_parts,
    quantize,
    reshape_and_cache,
    rms_norm,
    rope_and_cache,
    rotary_embedding,
    sample_tokens,
    scale,
    set_kernel_tuning,
    silu_and_mul,
    softmax,
    topk,
)


@contextmanager
def kernel_tuning_override(**fields):
    """Set kernel tuning fields (see kernel_tuning()) for the block, restoring them at its end, e.g.
    ``with ops.kernel_tuning_override(decode_splits=8): ...``. For tests and benchmarks: the fields
    are read by kernels at launch, not synchronised with ops running on other threads."""
    previous = set_kernel_tuning(**fields)
    try:
        yield
    finally:
        set_kernel_tuning(**previous)
