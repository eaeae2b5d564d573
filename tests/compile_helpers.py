"""Compiled-graph inspection for the compile tests: a backend that records the forward and
backward graphs AOTAutograd hands to a compiler (with Inductor's min-cut partitioner, so the
recomputation decisions are the ones Inductor sees) and runs them as they are."""
from __future__ import annotations

import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


class Recorder:
    """``torch.compile(..., backend=Recorder().backend)``; ``graphs`` holds (kind, GraphModule)."""

    def __init__(self):
        self.graphs: list[tuple[str, torch.fx.GraphModule]] = []

        def compiler(kind):
            def compile_graph(gm, example_inputs):
                self.graphs.append((kind, gm))
                return make_boxed_func(gm.forward)
            return compile_graph
        self.backend = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                                    partition_fn=min_cut_rematerialization_partition)

    def collectives(self, kind: str | None = None) -> dict[str, int]:
        """Payload bytes per collective in the recorded graphs, as seqpar's counter counts them
        (the all-gather's output, the reduce-scatter's or all-to-all's input, the all-reduce's tensor)."""
        out: dict[str, int] = {}
        for k, gm in self.graphs:
            if kind is not None and k != kind:
                continue
            for node in gm.graph.nodes:
                name = getattr(node.target, "__name__", "").split(".")[0]
                if node.op != "call_function" or name not in COLLECTIVES:
                    continue
                val, arg = node.meta["val"], node.args[0].meta["val"]
                nbytes = max(val.numel() * val.element_size(), arg.numel() * arg.element_size())
                out[name] = out.get(name, 0) + nbytes
        return out


def graph_breaks() -> int:
    """Graph breaks dynamo has counted in this process so far."""
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values())


def unique_graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]
