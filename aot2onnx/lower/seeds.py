"""Seeds for random ONNX ops, drawn from torch's default generator (see README, "Randomness").

Only torch and onnx are imported here: a model from the cache is reseeded without loading the lowering.
"""

from __future__ import annotations

import onnx
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from aot2onnx.signature import RANDOM_OPS

__all__ = ["draw_seeds", "reseed"]


def draw_seeds(count: int) -> list[int]:
    """``count`` seeds from torch's default generator (so ``torch.manual_seed`` makes them reproducible)."""
    # Compilation runs under Dynamo's fake tensor mode; the draw must use torch's real generator.
    with unset_fake_temporarily():
        # ONNX stores most seeds as a float: stay below 2**24, where every integer is exact.
        return torch.randint(0, 2**24, (count,)).tolist() if count else []


def reseed(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fresh seeds for the random nodes of a lowered model's main graph (a copy when there are any)."""
    positions = [i for i, node in enumerate(model.graph.node) if node.domain in ("", "ai.onnx") and node.op_type in RANDOM_OPS]
    if not positions:
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for i, seed in zip(positions, draw_seeds(len(positions))):
        node = model.graph.node[i]
        kept = [a for a in node.attribute if a.name != "seed"]
        del node.attribute[:]
        node.attribute.extend(kept)
        # Dropout's seed is an int; the other random ops take a float.
        node.attribute.append(onnx.helper.make_attribute("seed", seed if node.op_type == "Dropout" else float(seed)))
    return model
