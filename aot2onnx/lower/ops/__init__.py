"""aot2onnx's own lowering rules, for ops torch_lib does not lower (mostly backward ops).

Importing this package registers every rule in it.
"""

from aot2onnx.lower.ops import (  # noqa: F401
    adaptive_pool,
    complex,
    conv,
    core,
    distance,
    factory,
    fft,
    fused,
    fused_kernels,
    indexing,
    linalg,
    loss,
    matmul,
    norm,
    padding,
    pointwise,
    pool,
    random,
    reductions,
    resize,
    scans,
    special,
    views,
)
