"""Cross-runtime parity: where ONNX Runtime and eager PyTorch part, forward and backward, down to the node.

::

    report = aot2onnx.parity.compare(model, (x,), loss_fn=F.cross_entropy, targets=y)
    report.ok                                  # every output, gradient and buffer within tolerance, no divergent node
    node = report.first_divergence("forward")  # or "backward": None, or the first node whose own error is beyond tolerance
    print(node.target, node.fx_name, node.onnx_nodes, node.source)
    report.save("parity/")                     # report.md, report.html (plots of the error along each graph), a reproducer

    report = aot2onnx.parity.compare(model, (x,), loss_fn=F.cross_entropy, targets=y, steps=5,
                                     optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), compile_optimizer=True)
    report.first_parting()                     # None, or the step, graph and node where the two first part

``compare_artifact`` does the same for an exported training artifact against the module it came from;
``python -m aot2onnx parity MODULE:FACTORY --example-inputs FILE.npz --out DIR`` from the command line. The
implementation lives in :mod:`aot2onnx.tools.parity`.
"""

from __future__ import annotations

from aot2onnx.tools import parity as _parity
from aot2onnx.tools.parity import (  # noqa: F401  (the public names, listed once: in aot2onnx.tools.parity)
    NOISE_FACTOR,
    SLACK_ULPS,
    ErrorStats,
    GraphParity,
    NodeParity,
    ParityReport,
    Reproducer,
    TensorParity,
    compare,
    compare_artifact,
)

__all__ = [name for name in _parity.__all__ if name != "main"]  # the command line stays in tools/
