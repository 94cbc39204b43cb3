"""Every private name of PyTorch's compiler stack that aot2onnx uses is where it expects it, in the shape it
uses it: after a torch upgrade, this test names what moved. ``make check-torch TORCH=2.11.0`` runs it against
another torch."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib

import pytest
import torch

from aot2onnx.capture import _torch_compat as compat

PACKAGE = pathlib.Path(compat.__file__).parents[1]


@pytest.mark.parametrize("name", sorted(compat.SYMBOLS))
def test_torch_symbol_is_where_aot2onnx_reads_it(name):
    module, symbol = compat.SYMBOLS[name]
    found = getattr(importlib.import_module(module), symbol, None)
    assert found is not None, f"{module}.{symbol} moved"
    assert getattr(compat, name) is found


@pytest.mark.parametrize("name", sorted(compat.GRAPH_BREAK_SYMBOLS))
def test_dynamo_graph_break_symbol_is_there(name):
    # Optional for the package (the notes turn off without them), but every supported torch has them.
    module, symbol = compat.GRAPH_BREAK_SYMBOLS[name]
    assert getattr(importlib.import_module(module), symbol, None) is not None, f"{module}.{symbol} moved"
    assert compat.GRAPH_BREAK_NOTES is None


def _private_torch_names(tree: ast.AST) -> list[str]:
    """``torch._x`` and ``torch.fx.experimental`` names a module imports or reads, other than the op types."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            parts = []
            value: ast.AST = node
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                names = [".".join([value.id, *reversed(parts)])]
        for name in names:
            parts = name.split(".")
            if parts[0] != "torch" or len(parts) < 2:
                continue
            private = [p for p in parts[1:] if p.startswith("_") and not p.startswith("__")]
            if parts[1] in ("_ops", "ops"):  # the op types (see the fence's docstring), and ops by name
                continue
            if private or name.startswith("torch.fx.experimental"):
                found.append(name)
    return found


def test_no_other_module_reads_private_torch_names():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_torch_compat.py":
            continue
        tree = ast.parse(path.read_text())
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                child.parent = parent  # type: ignore[attr-defined]
        offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in _private_torch_names(tree)]
    assert offenders == []


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_functorch_config_has_what_aot2onnx_patches():
    for key in ("cse", "recompute_views", "unlift_effect_tokens", "enable_autograd_cache",
                "enable_remote_autograd_cache", "bundled_autograd_cache", "force_non_lazy_backward_lowering"):
        assert hasattr(compat.functorch_config, key), key
    assert hasattr(compat.fx_config, "backed_size_oblivious")


def test_aot_autograd_cache_has_what_aot2onnx_replaces():
    cache = compat.AOTAutogradCache
    assert _parameters(cache._write_to_local_cache) == ["key", "content"]
    assert _parameters(cache.iterate_over_candidates) == ["local", "remote_cache", "key"]
    assert _parameters(cache._get_tmp_dir) == []
    # capture/aot.py's _cache_key takes (mod, example_inputs, config, *rest) and passes rest[1:] to the details
    key_params = _parameters(compat.autograd_cache.autograd_cache_key)
    assert key_params[1:3] == ["example_inputs", "config"]
    details_params = _parameters(compat.AOTAutogradCacheDetails.__init__)
    assert details_params[:5] == ["self", "gm", "example_inputs", "aot_config", "fx_config"]
    assert details_params[5:] == key_params[4:]  # what follows inductor's settings is passed on as it is
    assert callable(compat.autograd_cache.write_atomic)
    assert _parameters(compat.graph_compile.collect_bw_donated_buffer_idxs) == ["fw_module", "bw_module", "fw_metadata"]
    assert _parameters(compat.SerializableAOTDispatchCompiler.__init__) == ["self", "output_code_ty", "compiler_fn"]
    assert compat.AOTAUTOGRAD_CACHE_PREFIX == "a"


def test_output_code_has_the_methods_reloadable_graph_overrides():
    assert _parameters(compat.OutputCode.post_compile) == ["self", "example_inputs", "constants", "graph_kwargs"]
    assert _parameters(compat.OutputCode.prepare_for_serialization) == ["self"]
    assert _parameters(compat.OutputCode.set_triton_bundle) == ["self", "triton_bundle"]


def test_fake_convolution_asks_the_hint_aot2onnx_patches():
    assert hasattr(compat.symbolic_shapes, compat.FAKE_CONV_HINT)
    table = compat.fake_impls.op_implementations_dict
    conv = table[torch.ops.aten.convolution.default]
    assert compat.FAKE_CONV_HINT in inspect.getsource(conv)


def test_parity_tool_patches_make_fx_where_aot_autograd_reads_it():
    assert compat.graph_capture.make_fx is compat.make_fx


def test_optimization_hint_reads_a_backed_size():
    shape_env = compat.ShapeEnv()
    fake_mode = compat.FakeTensorMode(shape_env=shape_env)
    context = compat.StatelessSymbolicContext(dynamic_sizes=[compat.DimDynamic.DUCK])
    fake = fake_mode.from_tensor(torch.zeros(5), symbolic_context=context)
    assert isinstance(fake.shape[0], torch.SymInt)
    assert compat.optimization_hint(fake.shape[0]) == 5


def test_aot_descriptors_aot2onnx_reads():
    for name in ("ParamAOTInput", "BufferAOTInput", "PlainAOTInput", "SavedForBackwardsAOTOutput",
                 "SavedForBackwardsNoVcCheckAOTOutput", "InputMutationAOTOutput", "PlainAOTOutput",
                 "IntermediateBaseAOTOutput"):
        assert hasattr(compat.aot_descriptors, name), name


def test_dynamo_callbacks_have_the_shape_graph_breaks_reads():
    assert hasattr(compat.CallbackTrigger, "DYNAMO")
    assert "callback_trigger" in {f.name for f in dataclasses.fields(compat.CallbackArgs)}
    for method in ("register_start_callback", "register_end_callback"):
        assert callable(getattr(compat.callback_handler, method))
    assert hasattr(compat.callback_handler, "end_callbacks")
    assert callable(compat.ConvertFrameAssert.__call__)


def test_linalg_checks_are_kept_in_the_block_and_left_as_they_were_after():
    before = compat.get_effect(compat.LINALG_CHECK)
    with compat.linalg_checks_kept():
        assert compat.get_effect(compat.LINALG_CHECK) == compat.EffectType.ORDERED
    assert compat.get_effect(compat.LINALG_CHECK) == before  # None on torch 2.11 and 2.12: inductor's as it was


def test_optimization_hint_gives_a_data_dependent_size_a_value():
    # aot2onnx's diagnosis of a refused graph runs its nodes on zeros of such sizes (compile/backend.py).
    size = compat.ShapeEnv().create_unbacked_symint()
    assert compat.optimization_hint(size) == compat.inductor_config.unbacked_symint_fallback


def test_dynamo_reset_clears_callbacks_through_the_handler_that_after_dynamo_reset_wraps():
    # after_dynamo_reset wraps callback_handler.clear: reset() must still clear through it, by that name.
    assert "callback_handler.clear()" in inspect.getsource(torch._dynamo.reset)
    calls = []

    def started(args):
        pass

    def again():
        calls.append(started in compat.callback_handler.start_callbacks)
        compat.callback_handler.register_start_callback(started)

    compat.after_dynamo_reset(again)
    compat.after_dynamo_reset(again)  # once per function, however often it is asked
    try:
        compat.callback_handler.register_start_callback(started)
        torch._dynamo.reset()
        assert calls == [False]  # called once, after the callbacks were cleared
        assert started in compat.callback_handler.start_callbacks
    finally:
        compat.callback_handler.clear._aot2onnx_after.remove(again)
        compat.callback_handler.remove_start_callback(started)


def test_chunked_loss_accumulator_takes_what_aot2onnx_binds():
    """torch's linear_cross_entropy accumulator (torch 2.13 on), whose reduction="none" backward call
    capture/chunked_loss.py routes to an op of its own: the parameters it reads by name are there."""
    import inspect

    import torch.nn.functional as F

    module, accumulator = compat.chunked_loss_accumulator()
    if not hasattr(F, "linear_cross_entropy"):
        assert accumulator is None
        return
    assert accumulator is not None and getattr(module, compat.CHUNKED_LOSS[1]) is accumulator
    names = set(inspect.signature(accumulator).parameters)
    assert {"input", "linear_weight", "target", "linear_bias", "weight", "reduction", "ignore_index", "label_smoothing",
            "batch_chunk_size", "acc_policy", "acc_dtype", "compute_input_grad", "compute_linear_weight_grad",
            "compute_linear_bias_grad", "loss_grad_output"} <= names
