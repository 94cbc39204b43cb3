"""Seeds for random ONNX ops, drawn from torch's default generator (see README, "Randomness").

One seeder, :func:`seed_random_ops`, on onnx_ir: lowering runs it on a new model, and :func:`reseed` runs it on
a model from the cache, so that both seed the same nodes (the main graph's, its functions' and subgraphs').
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import torch

from aot2onnx.capture._torch_compat import unset_fake_temporarily
from aot2onnx.signature import RANDOM_OPS

__all__ = ["draw_seeds", "reseed", "seed_random_ops"]


def draw_seeds(count: int) -> list[int]:
    """``count`` seeds from torch's default generator (so ``torch.manual_seed`` makes them reproducible)."""
    # Compilation runs under Dynamo's fake tensor mode; the draw must use torch's real generator.
    with unset_fake_temporarily():
        # ONNX stores most seeds as a float: stay below 2**24, where every integer is exact.
        return torch.randint(0, 2**24, (count,)).tolist() if count else []


def _is_random(domain: str, op_type: str) -> bool:
    return domain in ("", "ai.onnx") and op_type in RANDOM_OPS


def seed_random_ops(model: ir.Model) -> None:
    """Gives every random ONNX node a seed drawn from torch's default generator.

    The draw happens once, when the graph is lowered (or loaded from the cache), so ``torch.manual_seed(s)``
    before the first call makes a run reproducible. Each node gets its own seed: two dropout layers never
    share a mask, and the optimizer cannot merge two random nodes as common subexpressions. ONNX Runtime's
    kernels keep their generator between runs, so each call still draws a new mask.
    """
    graphs = [model.graph, *(f.graph for f in model.functions.values())]
    nodes = [
        node
        for graph in graphs
        for node in ir.traversal.RecursiveGraphIterator(graph)
        if _is_random(node.domain, node.op_type)
    ]
    for node, seed in zip(nodes, draw_seeds(len(nodes))):
        # Dropout's seed is an int; the other random ops take a float.
        attr = ir.AttrInt64("seed", seed) if node.op_type == "Dropout" else ir.AttrFloat32("seed", float(seed))
        node.attributes["seed"] = attr


def _has_random_nodes(nodes: list[onnx.NodeProto]) -> bool:
    for node in nodes:
        if _is_random(node.domain, node.op_type):
            return True
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.HasField("g") else list(attr.graphs)
            if any(_has_random_nodes(list(g.node)) for g in subgraphs):
                return True
    return False


def reseed(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with fresh seeds (a new model when it has random nodes; ``model`` itself when it has none)."""
    if not any(_has_random_nodes(list(nodes)) for nodes in [model.graph.node, *(f.node for f in model.functions)]):
        return model
    seeded = ir.serde.deserialize_model(model)
    seed_random_ops(seeded)
    return ir.serde.serialize_model(seeded)
