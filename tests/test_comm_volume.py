"""Paper §4.2.2: sequence parallelism moves the same bytes as tensor parallelism's all-reduces
(4 all-gathers + 4 reduce-scatters instead of 4 all-reduces per layer), plus the backward
re-gather of the two saved input shards."""
from distributed_harness import tp_group_of
from gpt_helpers import batch, mesh_for, tiny_config
from seqpar.distributed import count_comm
from seqpar.model import GPT


def _traffic(group, layers, sp, recompute="none"):
    cfg = tiny_config(layers=layers, sequence_parallel=sp, recompute=recompute)
    model = GPT(cfg, mesh_for(group), seed=0)
    tokens, labels = batch(cfg)
    with count_comm() as c:
        model(tokens, labels).backward()
    return c


def _per_layer(rank, world):
    group = tp_group_of(world)
    out = {}
    for sp in (False, True):
        for rc in ("none", "selective", "full"):
            one, two = _traffic(group, 1, sp, rc), _traffic(group, 2, sp, rc)
            calls = {k: two.calls.get(k, 0) - one.calls.get(k, 0) for k in set(one.calls) | set(two.calls)}
            nbytes = {k: two.bytes.get(k, 0) - one.bytes.get(k, 0) for k in set(one.bytes) | set(two.bytes)}
            out[(sp, rc)] = ({k: v for k, v in calls.items() if v}, {k: v for k, v in nbytes.items() if v},
                             two.wire_bytes(world) - one.wire_bytes(world))
    return out


def test_sequence_parallel_moves_the_same_bytes_as_tensor_parallel(spawn):
    t = 2
    cfg = tiny_config()
    b = batch(cfg)[0].shape[0]
    n = cfg.seq_len * b * cfg.hidden * 4  # one [s, b, h] fp32 activation, bytes
    for r in spawn(_per_layer, t):
        # plain TP, per layer: forward all-reduces after attention and MLP, backward ones before them
        assert r[(False, "none")][:2] == ({"all_reduce": 4}, {"all_reduce": 4 * n})
        # SP, per layer: g and g-bar forward (2 + 2), their transposes backward (2 + 2),
        # and the column layers' re-gather of their saved shards (2)
        assert r[(True, "none")][:2] == ({"all_gather": 6, "reduce_scatter": 4},
                                         {"all_gather": 6 * n, "reduce_scatter": 4 * n})
        tp_wire, sp_wire = r[(False, "none")][2], r[(True, "none")][2]
        regather = 2 * (t - 1) / t * n
        assert tp_wire == 8 * (t - 1) / t * n
        assert sp_wire == tp_wire + regather  # equal volume, plus the re-gather of §4.2.2
        # selective recomputation adds no communication; full recomputation repeats the forward's
        for sp in (False, True):
            assert r[(sp, "selective")] == r[(sp, "none")]
        assert r[(False, "full")][0] == {"all_reduce": 6}
        assert r[(True, "full")][0] == {"all_gather": 8, "reduce_scatter": 6}
