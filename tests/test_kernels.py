"""Target opsets come from what the installed ONNX Runtime can run, probed per op (aot2onnx.runtime.kernels)."""

from __future__ import annotations

import onnx
import pytest
import torch
import torch_behaviour

import aot2onnx
from aot2onnx.runtime import kernels


def test_the_newest_runnable_opset_keeps_every_kernel_of_opset_18():
    newest = kernels.newest_runnable_opset()
    assert newest >= kernels.BASE_OPSET
    for opset in range(kernels.BASE_OPSET, newest + 1):
        assert kernels.opset_support(opset).runnable, kernels.opset_support(opset)


def test_the_probe_sees_a_missing_kernel_that_loading_does_not():
    # ONNX Runtime has no int64 Relu kernel; an opset-18 model runs it through the schema's function body, an
    # opset-21 one does not (onnxruntime 1.32).
    assert kernels._runs("Relu", 21, "tensor(float)") is True
    assert kernels._runs("Relu", 21, "tensor(int64)") is False


@pytest.mark.parametrize("opset", [onnx.defs.onnx_opset_version() + 1, 99])
def test_an_opset_beyond_onnx_is_refused_with_the_newest_that_works(opset):
    with pytest.raises(ValueError, match=rf"opset {opset} cannot be targeted: .*The newest opset this onnxruntime runs is {kernels.newest_runnable_opset()}"):
        aot2onnx.backend(opset=opset)
    # Through torch.compile's options the same error reaches the user inside Dynamo's BackendCompilerFailed.
    with pytest.raises(Exception, match=f"ValueError: opset {opset} cannot be targeted"):
        torch.compile(torch.nn.Linear(2, 2), backend="aot2onnx", options={"opset": opset})(torch.randn(1, 2))


def test_an_opset_onnx_runtime_loads_but_cannot_run_is_refused():
    unrunnable = [o for o in range(kernels.BASE_OPSET + 1, onnx.defs.onnx_opset_version() + 1)
                  if kernels.opset_support(o).loads and not kernels.opset_support(o).runnable]
    if not unrunnable:
        pytest.skip("this onnxruntime runs every opset it loads")
    with pytest.raises(ValueError, match=r"has no kernel for .*\(\d+\) for "):
        aot2onnx.backend(opset=unrunnable[0])


def test_an_opset_below_18_is_refused():
    with pytest.raises(ValueError, match="opset must be >= 18"):
        aot2onnx.backend(opset=17)


def test_random_ops_train_at_the_newest_runnable_opset():
    newest = kernels.newest_runnable_opset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend=aot2onnx.backend(opset=newest))
    x = torch.randn(4, 8)
    out = compiled(x)
    out.sum().backward()
    # A dropout mask is random: check its effect's shape and that gradients flowed, and that the same
    # model without dropout matches eager exactly through the same opset.
    assert out.shape == (4, 1) and model[0].weight.grad is not None
    model.eval()
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_node_the_target_opset_cannot_run_is_refused_naming_its_fx_node():
    newest = kernels.newest_runnable_opset()
    if newest == kernels.BASE_OPSET or kernels._runs("Relu", newest, "tensor(int64)") is not False:
        pytest.skip("this onnxruntime runs an int64 Relu at its newest opset")
    if not torch_behaviour.cumprod_backward_takes_an_int64_relu():
        pytest.skip("this torch's cumprod backward holds no int64 Relu (torch 2.11's decomposition)")
    x = torch.randn(5, requires_grad=True)
    compiled = torch.compile(lambda x: torch.cumprod(x, 0), backend=aot2onnx.backend(opset=newest, fallback=False))
    # cumprod's backward takes a Relu of int64 indices.
    with pytest.raises(Exception, match=r"(?s)cannot run at opset \d+: .*Relu for int64, lowered from %relu"):
        compiled(x).sum().backward()
    torch._dynamo.reset()
    # With the fallback (the default), that node runs in PyTorch instead, with a warning naming it.
    compiled = torch.compile(lambda x: torch.cumprod(x, 0), backend=aot2onnx.backend(opset=newest))
    with pytest.warns(UserWarning, match=r"relu \(aten\.relu\.default\)"):
        compiled(x).sum().backward()
    x.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.cumprod(x, 0), backend="aot2onnx")
    out = compiled(x)
    out.sum().backward()
    expected = x.detach().clone().requires_grad_()
    torch.cumprod(expected, 0).sum().backward()
    torch.testing.assert_close(x.grad, expected.grad)
