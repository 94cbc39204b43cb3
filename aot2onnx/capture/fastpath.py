"""Decompositions of torch's fused inference fast paths.

In eval mode with gradients off, ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` call fused
kernels (``_transformer_encoder_layer_fwd``, ``_native_multi_head_attention``) that PyTorch does not
decompose. Spelled out here with the same math as the modules' slow paths, they reach ops that lower, so an
eval transformer under ``torch.no_grad()`` runs as one inference graph like any other model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["FASTPATH_DECOMPOSITIONS"]

aten = torch.ops.aten


def _additive_mask(mask: torch.Tensor | None, mask_type: int | None, batch: int, heads: int, seq: int, dtype):
    """The fast path's mask as an additive (batch or 1, heads or 1, seq, seq) float mask.

    mask_type 0: attention mask (seq, seq); 1: key padding mask (batch, seq); 2: merged (batch, heads, seq,
    seq). A bool mask is True where attention is *not* allowed, as in nn.MultiheadAttention.
    """
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    else:
        mask = mask.to(dtype)
    if mask_type == 1:
        return mask.view(batch, 1, 1, seq)
    if mask.dim() == 2:
        return mask.view(1, 1, seq, seq)
    return mask


def _attention(query, key, value, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type):
    """Multi-head attention with packed input projections; returns (output, attention weights per head)."""
    batch, seq, _ = query.shape
    head_dim = embed_dim // num_heads
    w_q, w_k, w_v = qkv_weight.chunk(3)
    b_q, b_k, b_v = qkv_bias.chunk(3)

    def heads(x, w, b):
        return F.linear(x, w, b).view(batch, -1, num_heads, head_dim).transpose(1, 2)

    q, k, v = heads(query, w_q, b_q), heads(key, w_k, b_k), heads(value, w_v, b_v)
    scores = q @ k.transpose(-2, -1) / head_dim**0.5
    additive = _additive_mask(mask, mask_type, batch, num_heads, seq, scores.dtype)
    if additive is not None:
        scores = scores + additive
    weights = scores.softmax(-1)
    out = (weights @ v).transpose(1, 2).reshape(batch, -1, embed_dim)
    return F.linear(out, proj_weight, proj_bias), weights


def _transformer_encoder_layer_fwd(
    src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first, eps,
    norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2,
    mask=None, mask_type=None,
):
    def attend(x):
        return _attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type)[0]

    def feed_forward(x):
        h = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(h) if use_gelu else F.relu(h), ffn_weight_2, ffn_bias_2)

    def norm1(x):
        return F.layer_norm(x, (embed_dim,), norm_weight_1, norm_bias_1, eps)

    def norm2(x):
        return F.layer_norm(x, (embed_dim,), norm_weight_2, norm_bias_2, eps)

    if norm_first:
        x = src + attend(norm1(src))
        return x + feed_forward(norm2(x))
    x = norm1(src + attend(src))
    return norm2(x + feed_forward(x))


def _native_multi_head_attention(
    query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask=None,
    need_weights=True, average_attn_weights=True, mask_type=None,
):
    out, weights = _attention(
        query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type
    )
    if not need_weights:
        return out, torch.empty(0, dtype=out.dtype, device=out.device)
    return out, weights.mean(1) if average_attn_weights else weights


FASTPATH_DECOMPOSITIONS: dict[torch._ops.OpOverload, Callable] = {
    aten._transformer_encoder_layer_fwd.default: _transformer_encoder_layer_fwd,
    aten._native_multi_head_attention.default: _native_multi_head_attention,
}
