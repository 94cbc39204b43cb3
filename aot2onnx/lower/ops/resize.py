"""Upsampling where torch_lib's rule maps coordinates otherwise than ATen."""

from __future__ import annotations

import torch
from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

from aot2onnx.lower.ops._common import static_dims
from aot2onnx.lower.registry import project_rule

aten = torch.ops.aten


def _refuse_other_mappings(self, output_size, align_corners: bool, scales: tuple[float | None, float | None]) -> None:
    """ATen's antialiased kernels put output pixel i at (i + 0.5) * scale in the input, with scale 1 / the
    scale factor where one is given (F.interpolate(scale_factor=...) passes it) and input / output size
    else; align_corners only makes scale (in - 1) / (out - 1). ONNX's Resize, which torch_lib's rule builds
    from the sizes, uses input / output size, and with align_corners maps i to i * scale. The two agree only
    where the sizes give ATen's scale, without align_corners: other calls fall back to PyTorch (they gave
    other values than eager, off by up to 2 on unit inputs) rather than compute something else."""
    if align_corners:
        raise NotImplementedError("antialiased upsampling with align_corners=True: ONNX's Resize maps other points")
    sizes = static_dims(self)
    for axis, scale in enumerate(scales):
        if scale is None or scale <= 0:
            continue
        if sizes is None:
            raise NotImplementedError("antialiased upsampling with a scale factor on a dynamic size")
        in_size, out_size = sizes[-2 + axis], output_size[axis]
        if not isinstance(out_size, int) or abs(1.0 / scale - in_size / out_size) > 1e-7 * (in_size / out_size):
            raise NotImplementedError(
                f"antialiased upsampling with scale factor {scale} from {in_size} to {out_size}: ATen maps points "
                f"by 1/{scale}, ONNX's Resize by {in_size}/{out_size}"
            )


@project_rule(aten._upsample_bilinear2d_aa.default)
def aten__upsample_bilinear2d_aa(self, output_size, align_corners: bool, scales_h: float | None = None,
                                 scales_w: float | None = None):
    """_upsample_bilinear2d_aa(Tensor self, SymInt[2] output_size, bool align_corners, float? scales_h=None, float? scales_w=None) -> Tensor"""
    _refuse_other_mappings(self, output_size, align_corners, (scales_h, scales_w))
    return torchlib_nn.aten__upsample_bilinear2d_aa(self, output_size, align_corners, scales_h, scales_w)


@project_rule(aten._upsample_bicubic2d_aa.default)
def aten__upsample_bicubic2d_aa(self, output_size, align_corners: bool, scales_h: float | None = None,
                                scales_w: float | None = None):
    """_upsample_bicubic2d_aa(Tensor self, SymInt[2] output_size, bool align_corners, float? scales_h=None, float? scales_w=None) -> Tensor"""
    _refuse_other_mappings(self, output_size, align_corners, (scales_h, scales_w))
    return torchlib_nn.aten__upsample_bicubic2d_aa(self, output_size, align_corners, scales_h, scales_w)
