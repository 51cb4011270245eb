"""Inference pass of a pre-norm `nn.TransformerEncoder` (ReLU, no dropout) with functional ops.

Drafting runs the order model on a handful of 32-slot states per round; at that size the module-level dispatch
and fast-path checks of `nn.TransformerEncoder` cost as much as its arithmetic. Same weights, same maths; the
modules still train (dropout) and define the checkpoint layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


def encode(encoder: nn.TransformerEncoder, x: torch.Tensor) -> torch.Tensor:
    """x [N, L, d] -> [N, L, d], equal to `encoder(x)` in eval mode for norm_first layers with ReLU."""
    n, L, d = x.shape
    for layer in encoder.layers:
        att = layer.self_attn
        heads = att.num_heads
        y = F.layer_norm(x, (d,), layer.norm1.weight, layer.norm1.bias, layer.norm1.eps)
        qkv = F.linear(y, att.in_proj_weight, att.in_proj_bias).view(n, L, 3, heads, d // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, L, d)
        x = x + F.linear(a, att.out_proj.weight, att.out_proj.bias)
        y = F.layer_norm(x, (d,), layer.norm2.weight, layer.norm2.bias, layer.norm2.eps)
        y = F.relu(F.linear(y, layer.linear1.weight, layer.linear1.bias))
        x = x + F.linear(y, layer.linear2.weight, layer.linear2.bias)
    return x
