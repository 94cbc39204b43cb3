"""Peak memory of torch.nn.functional.linear_cross_entropy, eager against aot2onnx (docs/chunked-linear-cross-entropy.md).

Each case runs in its own process: two training steps (forward + backward) at N tokens, hidden size H and V
classes, float32. The figures are Linux's VmHWM (peak RSS): "first call" is the peak of the first step over the
RSS just before it (for aot2onnx it includes compiling), "step" that of the second step over the RSS before it
(VmHWM reset through /proc/self/clear_refs). Allocations of 1 MiB or more are returned to the system when freed
(MALLOC_MMAP_THRESHOLD_), so the step's figure is what it holds at its peak, not what the allocator kept.

    python scripts/lce_memory.py                 # N=4096, H=768, V=32000; reductions mean and none
    SHAPE="512 64 2000" python scripts/lce_memory.py
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _case(kind: str, reduction: str, n: int, h: int, v: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    torch.manual_seed(0)
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) * 0.02).requires_grad_()
    t = torch.randint(0, v, (n,))
    options = None if kind == "eager-reference" else LinearCrossEntropyOptions(allow_retain_graph=True)

    def loss_fn(x, w):
        return F.linear_cross_entropy(x, w, t, reduction=reduction, options=options)

    if kind == "aot2onnx":
        import aot2onnx  # noqa: F401

        loss_fn = torch.compile(loss_fn, backend="aot2onnx", dynamic=False, options={"cache": False})

    def step() -> None:
        loss = loss_fn(x, w)
        (loss if loss.dim() == 0 else loss.sum()).backward()
        x.grad = w.grad = None

    gc.collect()
    before_first = _status("VmRSS")
    start = time.perf_counter()
    step()
    first_s = time.perf_counter() - start
    first_peak = _status("VmHWM")
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    start = time.perf_counter()
    step()
    step_s = time.perf_counter() - start
    peak = _status("VmHWM")
    mib = lambda b: round(b / 2**20)
    return {"case": kind, "reduction": reduction, "first_call_extra_MiB": mib(first_peak - before_first),
            "step_extra_MiB": mib(peak - before), "rss_before_first_MiB": mib(before_first),
            "rss_before_step_MiB": mib(before), "first_call_s": round(first_s, 1), "step_s": round(step_s, 2)}


def main() -> None:
    if len(sys.argv) > 1:
        kind, reduction, *shape = sys.argv[1:]
        print(json.dumps(_case(kind, reduction, *(int(s) for s in shape))))
        return
    shape = os.environ.get("SHAPE", "4096 768 32000").split()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    for reduction in ("mean", "none"):
        for kind in ("eager-reference", "eager-chunked", "aot2onnx"):
            out = subprocess.run([sys.executable, __file__, kind, reduction, *shape], capture_output=True, text=True,
                                 env=env)
            print(out.stdout.strip() or out.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
