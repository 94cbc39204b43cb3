"""The table of ONNX Runtime's CUDA kernels (``opset_tables/ort_cuda_kernels.json``): what its generator reads
from ONNX Runtime's ``docs/OperatorKernels.md``, and that the checked-in table is the generator's output."""

from __future__ import annotations

import json

from aot2onnx.runtime.host_copies import CUDA_KERNELS_PATH, cuda_kernels
from aot2onnx.tools.ort_kernels import parse_operator_kernels, render_table

# An excerpt of OperatorKernels.md as ONNX Runtime writes it (rows cut to what the parse needs).
_EXCERPT = """\
## Operators implemented by CPUExecutionProvider

| Op Name | Parameters | OpSet Version | Types Supported |
|---------|------------|---------------|-----------------|
|**Operator Domain:** *ai.onnx*||||
|MaxUnpool|*in* X:**T1**<br> *in* I:**T2**<br> *in* output_shape:**T2**<br> *out* output:**T1**|22+|**T1** = tensor(float)<br/> **T2** = tensor(int64)|
|||[11, 21]|**T1** = tensor(float)<br/> **T2** = tensor(int64)|

<a name="cudaexecutionprovider"/>

## Operators implemented by CUDAExecutionProvider

| Op Name | Parameters | OpSet Version | Types Supported |
|---------|------------|---------------|-----------------|
|**Operator Domain:** *ai.onnx*||||
|Abs|*in* X:**T**<br> *out* Y:**T**|13+|**T** = tensor(double), tensor(float)|
|||[6, 12]|**T** = tensor(float)|
|ArgMax|*in* data:**T**<br> *out* reduced:**tensor(int64)**|13+|**T** = tensor(double), tensor(float), tensor(float16)|
|||12|**T** = tensor(double), tensor(float)|
|ReduceSum|*in* data:**T**<br> *in* axes:**tensor(int64)**<br> *out* reduced:**T**<br><br>or<br><br>*in* data:**T**<br> *out* reduced:**T**|13+|**T** = tensor(double), tensor(float)|
|Where|*in* condition:**B**<br> *in* X:**T**<br> *in* Y:**T**<br> *out* output:**T**|16+|**B** = tensor(bool)<br/> **T** = tensor(float), tensor(int64)|
|**Operator Domain:** *com.microsoft*||||
|BiasGelu|*in* A:**T**<br> *in* B:**T**<br> *out* C:**T**|1+|**T** = tensor(bfloat16), tensor(float)|
|ZipLike|*in* X:**T**<br> *out* Y:**S**|1+|**S** = seq(map(int64,tensor(float)))<br/> **T** = tensor(float)|

<a name="dmlexecutionprovider"/>

## Operators implemented by DmlExecutionProvider

| Op Name | Parameters | OpSet Version | Types Supported |
|---------|------------|---------------|-----------------|
|**Operator Domain:** *ai.onnx*||||
|MaxUnpool|*in* X:**T1**<br> *in* I:**T2**<br> *in* output_shape:**T2**<br> *out* output:**T1**|11+|**T1** = tensor(float)<br/> **T2** = tensor(int64)|
"""


def test_parse_reads_the_cuda_section_only():
    table = parse_operator_kernels(_EXCERPT)
    assert sorted(table) == ["ai.onnx", "com.microsoft"]
    assert sorted(table["ai.onnx"]) == ["Abs", "ArgMax", "ReduceSum", "Where"]  # not the CPU's or DML's MaxUnpool
    assert table["ai.onnx"]["Abs"] == {
        "inputs": ["T"], "outputs": ["T"],
        "kernels": [{"versions": [13, None], "types": {"T": ["double", "float"]}},
                    {"versions": [6, 12], "types": {"T": ["float"]}}],
    }
    assert table["ai.onnx"]["ArgMax"]["kernels"][1]["versions"] == [12, 12]
    assert table["ai.onnx"]["ArgMax"]["outputs"] == ["tensor(int64)"]
    # Two signatures: the inputs they agree on, None where one has an input the other lacks.
    assert table["ai.onnx"]["ReduceSum"]["inputs"] == ["T", None]
    assert table["ai.onnx"]["Where"]["inputs"] == ["B", "T", "T"]
    assert table["ai.onnx"]["Where"]["kernels"][0]["types"] == {"B": ["bool"], "T": ["float", "int64"]}
    assert table["com.microsoft"]["ZipLike"]["kernels"][0]["types"]["S"] == ["seq(map(int64,tensor(float)))"]


def test_render_is_json_one_op_a_line():
    table = parse_operator_kernels(_EXCERPT)
    cpu_ops = {d: sorted(ops) for d, ops in parse_operator_kernels(_EXCERPT, "CPUExecutionProvider").items()}
    assert cpu_ops == {"ai.onnx": ["MaxUnpool"]}
    text = render_table(table, {"repository": "github:microsoft/onnxruntime", "commit": "0" * 40}, cpu_ops)
    assert json.loads(text)["domains"] == json.loads(json.dumps(table))
    assert json.loads(text)["cpu_ops"] == cpu_ops
    assert sum(line.startswith('   "') for line in text.splitlines()) == 6


def test_checked_in_table():
    """The table names its source, holds ops that have CUDA kernels (ScatterElements with the version opset 18
    selects, 18+) and lacks MaxUnpool, which has none, and names the ops the CPU provider has kernels for;
    and it is what the generator writes from its own parse (no hand edits)."""
    table = cuda_kernels()
    assert table["provider"] == "CUDAExecutionProvider"
    assert table["source"]["repository"] == "github:microsoft/onnxruntime" and len(table["source"]["commit"]) == 40
    ops = table["domains"]["ai.onnx"]
    assert {"MatMul", "Conv", "ScatterElements", "If", "Where"} <= set(ops)
    assert "MaxUnpool" not in ops and "DFT" not in ops
    scatter = ops["ScatterElements"]
    assert scatter["inputs"] == ["T", "Tind", "T"]
    assert any(k["versions"][0] <= 18 and k["versions"][1] is None and "float" in k["types"]["T"]
               for k in scatter["kernels"])
    assert "MaxUnpool" in table["cpu_ops"]["ai.onnx"] and "CastLike" not in table["cpu_ops"]["ai.onnx"]
    assert render_table(table["domains"], table["source"], table["cpu_ops"]) == CUDA_KERNELS_PATH.read_text()
