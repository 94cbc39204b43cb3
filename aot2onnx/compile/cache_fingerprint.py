"""The persistent cache's keys: what decides a lowering, fingerprinted. A graph's key covers the FX graph (ops,
arguments, every node's dtype and shape, constant tensors' bytes), the options that change the model, the user's
lowering rules (:func:`function_fingerprint`: their code and everything it reads), the source of aot2onnx itself
and the versions of the packages that lower and run it (see :mod:`aot2onnx.compile.cache`)."""

from __future__ import annotations

import dis
import enum
import functools
import hashlib
import importlib.metadata
import logging
import os
import pathlib
import site
import sys
import sysconfig
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx

from aot2onnx.capture._torch_compat import unset_fake_temporarily
from aot2onnx.capture.decompositions import target_name
from aot2onnx.lower._onnxscript_compat import loaded_values_module

__all__ = ["FORMAT", "environment_key", "function_fingerprint", "graph_key", "package_fingerprint", "rule_key", "unkeyed_rule"]

FORMAT = "aot2onnx.cache/3"  # the entries' format, part of every key; 2: entries carry an HMAC; 3: signatures say
# which tensors are complex


_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]  # the aot2onnx package


def _hash_sources(digest: Any, paths: list[pathlib.Path]) -> None:
    """Adds each file's path (relative to the package) and contents to ``digest``, in path order."""
    for path in sorted(paths):
        digest.update(str(path.relative_to(_PACKAGE_ROOT)).encode())
        digest.update(path.read_bytes())


@functools.cache
def _environment_fingerprint() -> str:
    """Versions of everything the lowering depends on, and a digest of aot2onnx's own source."""
    digest = hashlib.sha256()
    for package in ("torch", "onnx", "onnxscript", "onnx_ir", "onnxruntime", "aot2onnx"):
        try:
            version = importlib.metadata.version(package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        digest.update(f"{package}={version};".encode())
    # Lowerings that follow eager's CPU kernels depend on the vector width those run at (lower/ops/norm.py):
    # a cache shared by an AVX2 and an AVX-512 machine must not serve one the other's graphs.
    digest.update(f"cpu={torch.backends.cpu.get_cpu_capability()};".encode())
    # The package version does not change with every edit of a rule; the source of the lowering does.
    root = _PACKAGE_ROOT
    _hash_sources(digest, [*root.joinpath("lower").rglob("*.py"), root / "signature.py",
                           root / "compile" / "cache.py", root / "compile" / "cache_fingerprint.py"])
    return digest.hexdigest()


@functools.cache
def package_fingerprint() -> str:
    """A digest of all of aot2onnx's source: AOTAutograd-level entries also depend on the capture (the
    decomposition table, the partitioner's settings) and on the backend's glue."""
    digest = hashlib.sha256()
    _hash_sources(digest, list(_PACKAGE_ROOT.rglob("*.py")))
    return digest.hexdigest()


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T({value.dtype},{tuple(str(s) for s in value.shape)},{tuple(str(s) for s in value.stride())})"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_describe_value(v) for v in value) + "]"
    return type(value).__name__ + ":" + str(value)


class _Unfingerprintable(Exception):
    """A value a rule depends on has no reliable fingerprint; the message says which."""


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {site.getusersitepackages(), str(_PACKAGE_ROOT)}
    return tuple(os.path.join(os.path.realpath(root), "") for root in roots)


@functools.cache
def _is_installed(filename: str | None) -> bool:
    """Whether code from ``filename`` belongs to the Python installation, an installed package or aot2onnx:
    it changes with their versions (and aot2onnx's source), which the keys cover, so it counts by name."""
    if filename is None or filename.startswith("<frozen "):
        return True
    return os.path.realpath(filename).startswith(_installed_roots())


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, type(Ellipsis)})
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def _names(code: types.CodeType) -> tuple[set[str], set[str]]:
    """The global names ``code`` (and the code nested in it) reads, and the attribute names it reads."""
    global_names: set[str] = set()
    attributes: set[str] = set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in _GLOBAL_OPS:
            global_names.add(instruction.argval)
        elif instruction.opname in _ATTRIBUTE_OPS:
            attributes.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            nested_globals, nested_attributes = _names(const)
            global_names |= nested_globals
            attributes |= nested_attributes
    return global_names, attributes


class _Fingerprinter:
    """Describes a value by everything a lowering rule's result can depend on, as text that is the same in
    every process for the same values (no addresses, no hash-ordered iteration)."""

    def __init__(self) -> None:
        self._active: set[int] = set()  # functions and modules being described: a recursive reference

    def value(self, value: Any, where: str) -> str:
        kind = type(value)
        if kind in _ATOMS:
            return f"{kind.__name__}:{value!r}"
        if isinstance(value, enum.Enum):
            return f"enum:{kind.__module__}.{kind.__qualname__}.{value.name}={self.value(value.value, where)}"
        if kind is list or isinstance(value, tuple):  # tuples: torch.Size and named tuples too
            items = ",".join(self.value(v, f"{where}[{i}]") for i, v in enumerate(value))
            return f"{kind.__module__}.{kind.__qualname__}({items})"
        if kind in (set, frozenset):
            return kind.__name__ + "(" + ",".join(sorted(self.value(v, f"an element of {where}") for v in value)) + ")"
        if kind is dict:
            items = sorted(
                f"{self.value(k, f'a key of {where}')}:{self.value(v, f'{where}[{k!r}]')}" for k, v in value.items()
            )
            return "dict(" + ",".join(items) + ")"
        if kind is types.CodeType:
            return self.code(value, where)
        if kind is types.FunctionType:
            return self.function(value, where)
        if isinstance(value, types.ModuleType):
            return self.module(value, set(), where)
        if kind is types.MethodType:
            return f"method({self.value(value.__self__, where)},{self.value(value.__func__, where)})"
        if kind is functools.partial:
            parts = (value.func, value.args, value.keywords)
            return "partial(" + ",".join(self.value(part, where) for part in parts) + ")"
        if kind in (types.BuiltinFunctionType, types.BuiltinMethodType):
            owner = value.__self__
            if owner is None or isinstance(owner, types.ModuleType):
                return f"builtin:{value.__module__}.{value.__qualname__}"
            return f"bound:{self.value(owner, where)}.{value.__name__}"
        if kind in (types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType):
            return f"descriptor:{value.__objclass__.__module__}.{value.__objclass__.__qualname__}.{value.__name__}"
        if isinstance(value, type):
            module = sys.modules.get(value.__module__)
            if value.__module__ == "builtins" or _is_installed(getattr(module, "__file__", None)):
                return f"class:{value.__module__}.{value.__qualname__}"
            raise _Unfingerprintable(f"{where} is the class {value.__qualname__}, defined outside installed packages")
        if isinstance(value, torch.Tensor):
            return f"tensor:{_describe_value(value)}:{hashlib.sha256(_tensor_bytes(value)).hexdigest()}"
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return f"torch:{value}"
        if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return f"op:{value}"
        if isinstance(value, logging.Logger):  # logs, does not decide what a rule builds
            return f"logger:{value.name}"
        protobuf = sys.modules.get("google.protobuf.message")
        if protobuf is not None and isinstance(value, protobuf.Message):  # an onnx.TensorProto, say
            message = value.SerializeToString(deterministic=True)
            return f"proto:{value.DESCRIPTOR.full_name}:{hashlib.sha256(message).hexdigest()}"
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            if isinstance(value, numpy.ndarray) and not value.dtype.hasobject:
                return f"ndarray:{value.dtype.str}:{value.shape}:{hashlib.sha256(value.tobytes()).hexdigest()}"
            if isinstance(value, numpy.generic) and not isinstance(value, numpy.object_):
                return f"numpy:{value.dtype.str}:{value.tobytes().hex()}"
            if isinstance(value, numpy.dtype):
                return f"dtype:{value.str}"
        # onnxscript is imported only where a rule uses it; then its module is in sys.modules.
        onnxscript_values = loaded_values_module()
        if onnxscript_values is not None:
            if isinstance(value, onnxscript_values.Opset):
                return f"opset:{value.domain}:{value.version}"
            if isinstance(value, onnxscript_values.OnnxFunction):  # a script function: its proto is all of it
                proto = value.to_function_proto().SerializeToString()
                return f"onnxfunction:{hashlib.sha256(proto).hexdigest()}"
            if isinstance(value, onnxscript_values.TracedOnnxFunction):
                return f"traced({self.value(value.opset, where)},{self.value(value.func, where)})"
        raise _Unfingerprintable(f"{where} is a {kind.__module__}.{kind.__qualname__}: no reliable fingerprint")

    def code(self, code: types.CodeType, where: str) -> str:
        constants = ",".join(self.value(c, f"a constant of {where}") for c in code.co_consts)
        signature = (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)
        fields = (*signature, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)
        body = hashlib.sha256(code.co_code + getattr(code, "co_exceptiontable", b"")).hexdigest()
        return f"code({body},{fields!r},[{constants}])"

    def function(self, function: types.FunctionType, where: str) -> str:
        name = f"{function.__module__}.{function.__qualname__}"
        if id(function) in self._active:
            return f"recursion:{name}"
        self._active.add(id(function))
        try:
            code = function.__code__
            global_names, attributes = _names(code)
            parts = [f"function:{name}"]
            if not _is_installed(code.co_filename):
                parts.append(self.code(code, name))
                parts.append(self.value(function.__defaults__, f"the default arguments of {name}"))
                parts.append(self.value(function.__kwdefaults__, f"the keyword defaults of {name}"))
                parts.append(self._globals(function, global_names, attributes, name))
            # An installed function counts by name, but a closure's cells hold what its factory was given.
            for variable, cell in zip(code.co_freevars, function.__closure__ or ()):
                try:
                    contents = cell.cell_contents
                except ValueError:  # not assigned yet
                    parts.append(f"{variable}:empty")
                    continue
                where = f"the closure variable {variable!r} of {name}"
                parts.append(f"{variable}={self._read(contents, attributes, where)}")
            return "(" + ";".join(parts) + ")"
        finally:
            self._active.discard(id(function))

    def _read(self, value: Any, attributes: set[str], where: str) -> str:
        """A value the code reads by name: a module is described by the ``attributes`` the code reads."""
        if isinstance(value, types.ModuleType):
            return self.module(value, attributes, where)
        return self.value(value, where)

    def _globals(self, function: types.FunctionType, global_names: set[str], attributes: set[str], name: str) -> str:
        namespace = function.__globals__
        builtin_namespace = function.__builtins__
        parts = []
        for global_name in sorted(global_names):
            if global_name in namespace:
                value = namespace[global_name]
            elif global_name in builtin_namespace:
                value = builtin_namespace[global_name]
            else:
                parts.append(f"{global_name}:undefined")
                continue
            parts.append(f"{global_name}={self._read(value, attributes, f'the global {global_name!r} of {name}')}")
        return "globals(" + ";".join(parts) + ")"

    def module(self, module: types.ModuleType, attributes: set[str], where: str) -> str:
        """An installed module counts by name; the user's own (``config.SCALE``) by the attributes the code
        reads from it."""
        name = module.__name__
        # A module made at run time (torch.ops.aten) has no file of its own: its package's file says.
        package = sys.modules.get(name.partition(".")[0])
        file = getattr(module, "__file__", None) or getattr(package, "__file__", None)
        if name in sys.builtin_module_names or (file is not None and _is_installed(file)) or id(module) in self._active:
            return f"module:{name}"
        self._active.add(id(module))
        try:
            namespace = vars(module)
            parts = [f"module:{name}"]
            for attribute in sorted(attributes & namespace.keys()):
                inner = f"{name}.{attribute} ({where})"
                parts.append(f"{attribute}={self._read(namespace[attribute], attributes, inner)}")
            return "(" + ";".join(parts) + ")"
        finally:
            self._active.discard(id(module))


def _fingerprint(function: Any) -> tuple[str | None, str]:
    """``function``'s fingerprint and ``""``, or ``None`` and why it has none."""
    try:
        text = _Fingerprinter().value(function, "the rule")
    except _Unfingerprintable as e:
        return None, str(e)
    except RecursionError:  # a container that holds itself
        return None, "a value it reads nests too deeply"
    return hashlib.sha256(text.encode()).hexdigest(), ""


def function_fingerprint(function: Any) -> str | None:
    """A digest of everything a lowering rule's result can depend on; ``None`` where that cannot be known.

    Covered: the code (bytecode, constants, names, the code objects nested in it), default and keyword-only
    default arguments, the values in its closure's cells, and the values of the globals it reads:
    recursively through the user functions it calls, the attributes it reads from the user's own modules,
    containers, tensors and arrays by their bytes, onnxscript opsets by domain and version, onnxscript
    script functions by their proto. Functions, classes and modules of the Python installation, of
    installed packages and of aot2onnx count by their qualified name (their versions are in the keys).
    Anything else (an instance of a class of the user's) has no reliable fingerprint: ``None``, and the
    graphs that use the rule are not cached (see :func:`unkeyed_rule`).
    """
    return _fingerprint(function)[0]


def rule_key(rule: Any) -> str:
    """A user rule as the keys hold it: target, opset, name and fingerprint (``unkeyed`` where it has none).

    A graph that a rule without a fingerprint lowers is never stored, so ``unkeyed`` stands safely for any
    such rule in the keys of graphs that do not use it.
    """
    fingerprint = function_fingerprint(rule.function) or "unkeyed"
    return f"{rule.origin}:{target_name(rule.target)}:{rule.opset_introduced}:{rule.name}:{fingerprint}"


def unkeyed_rule(gm: torch.fx.GraphModule, rules: Iterable[Any]) -> tuple[Any, str] | None:
    """The first of ``rules`` that lowers a node of ``gm`` and has no fingerprint, with why; else ``None``.

    Asked of a graph after its lowering, whose passes may have added nodes: a rule is looked up by the
    node's target, so these are exactly the rules the lowering could have used.
    """
    targets = {target_name(node.target) for node in gm.graph.nodes if node.op == "call_function"}
    for rule in rules:
        if target_name(rule.target) in targets:
            fingerprint, reason = _fingerprint(rule.function)
            if fingerprint is None:
                return rule, reason
    return None


def environment_key(*parts: Any) -> str:
    """A key that depends only on the environment (versions, aot2onnx's source) and ``parts``."""
    return hashlib.sha256(f"{FORMAT};{_environment_fingerprint()};{parts!r}".encode()).hexdigest()


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A constant's data. The key is made inside AOTAutograd's fake mode, which refuses any op on a real
    tensor (the graph's constants are real): reading them needs the mode lifted for the read."""
    with unset_fake_temporarily():
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def graph_key(gm: torch.fx.GraphModule, *, opset: int, rules: Iterable[Any], device_type: str = "cpu",
              kernels: str = "none") -> str:
    """The cache key of lowering ``gm`` at ``opset`` for ``device_type``; ``rules`` are the user's lowering rules,
    ``kernels`` the build id of the fused kernels it lowers to (``runtime.fused.build_id``), or "none".

    aot2onnx's own rules and torch_lib's are covered by the source digest and the versions; a user's rule
    by :func:`rule_key`, so editing it, or changing a value it reads, invalidates what it lowered.
    """
    digest = hashlib.sha256()
    digest.update(f"{FORMAT};{_environment_fingerprint()};opset={opset};device={device_type};kernels={kernels};".encode())
    for node in gm.graph.nodes:
        digest.update(f"{node.op}|{node.name}|{node.target}|{node.args}|{node.kwargs}|".encode())
        digest.update(_describe_value(node.meta.get("val")).encode())
        if node.op == "get_attr":
            tensor = getattr(gm, node.target)
            if isinstance(tensor, torch.Tensor):
                digest.update(_tensor_bytes(tensor))
    for rule in rules:
        digest.update(f"{rule_key(rule)};".encode())
    return digest.hexdigest()
