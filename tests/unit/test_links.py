"""Which link each mesh axis crosses, and collectives priced on it against the formulas by hand.

Run: ``python -m pytest tests/unit/test_links.py -q``
"""

from __future__ import annotations

import pytest

from trainer.config.hardware import HardwareProfile, Link
from trainer.planner.cost.links import AxisLink, collective_seconds, group_link

# Round numbers, so every expected time below is a line of arithmetic: NVLink 100 GB/s and 2 us a
# step, the NIC 10 GB/s and 10 us a step.
ROUND = HardwareProfile(name="round", intra_node=Link(bandwidth_gb_s=100, latency_us=2, source="test"),
                        inter_node=Link(bandwidth_gb_s=10, latency_us=10, source="test"))
US = 1e-6


@pytest.mark.parametrize(("shape", "dims", "axes", "per_node", "expected"), [
    # 64 nodes of 8, (dp, pp, tp): tp inside a node, pp and dp across nodes, one member per node
    ([8, 4, 8], ["dp", "pp", "tp"], ["tp"], 8, ("intra", 8, 8, 1)),
    ([8, 4, 8], ["dp", "pp", "tp"], ["pp"], 8, ("inter", 4, 1, 4)),
    ([8, 4, 8], ["dp", "pp", "tp"], ["dp"], 8, ("inter", 8, 1, 8)),
    # the mesh fits one node: everything is intra
    ([2, 4], ["dp", "tp"], ["dp"], 8, ("intra", 2, 2, 1)),
    ([2, 4], ["dp", "tp"], ["tp"], 8, ("intra", 4, 4, 1)),
    # tp of 8 on nodes of 4: hierarchical, 4 on each of 2 nodes; dp of 16 crosses 16 nodes
    ([16, 8], ["dp", "tp"], ["tp"], 4, ("hierarchical", 8, 4, 2)),
    ([16, 8], ["dp", "tp"], ["dp"], 4, ("inter", 16, 1, 16)),
    # dp joined over two dims (hsdp's replicate x shard), tp innermost: 2 per node on 4 nodes
    ([2, 4, 2], ["dp_replicate", "dp_shard", "tp"], ["dp_replicate", "dp_shard"], 4, ("hierarchical", 8, 2, 4)),
    # tp outermost (an unusual order): the tp group is spread one per node
    ([8, 8], ["tp", "dp"], ["tp"], 8, ("inter", 8, 1, 8)),
    # uneven: tp of 3 on nodes of 2 ({0,1},{2} / {3},{4,5}): the finest even split, 1 per node on 3
    ([2, 3], ["dp", "tp"], ["tp"], 2, ("inter", 3, 1, 3)),
])
def test_group_link_per_axis(shape, dims, axes, per_node, expected):
    link = group_link(shape, dims, axes, per_node)
    assert (link.kind, link.group_size, link.local, link.nodes) == expected
    assert link.axes == tuple(axes)


def test_group_link_takes_the_worst_group():
    """[3, 4] with 6 ranks per node: tp groups {0-3} (one node) and {4-7} (2 + 2 on two nodes); the worst counts."""
    assert group_link([3, 4], ["dp", "tp"], ["tp"], 6) == AxisLink(("tp",), 4, 2, 2)


def test_group_link_refuses_unknown_axes():
    with pytest.raises(ValueError, match="subset of the mesh dims"):
        group_link([2, 2], ["dp", "tp"], ["pp"], 8)


def test_ring_inside_a_node():
    link = AxisLink(("tp",), 8, 8, 1)
    # all_reduce: 2(g-1) = 14 steps of 2 us; 2(g-1)/g * 1 GB at 100 GB/s = 17.5 ms
    assert collective_seconds(ROUND, "all_reduce", link, 1e9) == pytest.approx(14 * 2 * US + 0.0175)
    # all_gather of 400 MB over 4: 3 steps; 3/4 * 0.4 GB / 100 GB/s = 3 ms
    assert collective_seconds(ROUND, "all_gather", AxisLink(("tp",), 4, 4, 1), 4e8) == pytest.approx(6 * US + 0.003)
    assert collective_seconds(ROUND, "reduce_scatter", AxisLink(("tp",), 4, 4, 1), 4e8) == pytest.approx(6 * US + 0.003)


def test_ring_or_tree_across_nodes():
    link = AxisLink(("dp",), 4, 1, 4)
    # large: ring, 6 steps of 10 us, 2 * 3/4 * 100 MB at 10 GB/s = 15 ms (tree: 40 us + 100 MB / 4.6 GB/s = 21.7 ms)
    assert collective_seconds(ROUND, "all_reduce", link, 1e8) == pytest.approx(60 * US + 0.015)
    # small: tree, 2 * log2(4) = 4 steps of 10 us + 1 kB / (0.46 * 10 GB/s) (ring: 60 us)
    assert collective_seconds(ROUND, "all_reduce", link, 1e3) == pytest.approx(40 * US + 1e3 / 4.6e9)


def test_hierarchical_group():
    link = AxisLink(("tp",), 8, 4, 2)
    # all_reduce of 800 MB: hierarchical = 2 x (3 steps of 2 us + 3/4 * 0.8 GB / 100 GB/s)
    #   + (2 steps of 10 us + 2 * 1/2 * 0.2 GB / 10 GB/s) = 12.012 ms + 20.02 ms; beats the ring (44 us + 35 ms,
    #   its bus bandwidth min(100, 4 NICs x 10) = 40 GB/s) and the tree (32 us + 0.8 GB / 18.4 GB/s = 43.5 ms)
    assert collective_seconds(ROUND, "all_reduce", link, 8e8) == pytest.approx(0.012012 + 0.02002)
    # reduce_scatter of 800 MB: (3 x 2 us + 6 ms) + (10 us + 1/2 * 0.2 GB / 10 GB/s) = 16.016 ms (ring: 17.522 ms)
    assert collective_seconds(ROUND, "reduce_scatter", link, 8e8) == pytest.approx(0.006006 + 0.01001)
    # all_to_all of 800 MB: 3 on-node peers (2 us) and 4 off-node (10 us); max(3/8 * 0.8 GB / 100, 4/8 * 0.8 GB / 10)
    assert collective_seconds(ROUND, "all_to_all", link, 8e8) == pytest.approx(46 * US + 0.04)


def test_send_recv_crosses_the_link_of_its_worst_hop():
    assert collective_seconds(ROUND, "send_recv", AxisLink(("pp",), 4, 1, 4), 1e8) == pytest.approx(10 * US + 0.01)
    assert collective_seconds(ROUND, "send_recv", AxisLink(("pp",), 4, 4, 1), 1e8) == pytest.approx(2 * US + 0.001)
    assert collective_seconds(ROUND, "send_recv", AxisLink(("pp",), 8, 4, 2), 1e8) == pytest.approx(10 * US + 0.01)


def test_an_h100_node_all_reduce():
    """tp all-reduce of 64 MiB on 8 H100s: 14 NVLink steps of 3.4 us, 2 * 7/8 * 64 MiB at 370.8 GB/s."""
    from trainer.config.compose import compose_dict
    from trainer.config.schema import RunConfig

    h100 = RunConfig.model_validate(compose_dict(["hardware=h100_sxm"])).hardware
    link = group_link([8, 4, 8], ["dp", "pp", "tp"], ["tp"], h100.devices_per_node)
    seconds = collective_seconds(h100, "all_reduce", link, 64 * 2**20)
    assert seconds == pytest.approx(14 * 3.4e-6 + 1.75 * 64 * 2**20 / 370.8e9)
    assert seconds == pytest.approx(364.3e-6, rel=1e-3)  # 47.6 us of steps + 316.7 us of bytes


def test_nothing_to_send_costs_nothing_and_unknown_ops_are_refused():
    assert collective_seconds(ROUND, "all_reduce", AxisLink(("dp",), 1, 1, 1), 1e9) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_seconds(ROUND, "broadcast", AxisLink(("dp",), 2, 2, 1), 1e9)
    with pytest.raises(ValueError, match="states no intra_node"):
        collective_seconds(HardwareProfile(), "all_reduce", AxisLink(("dp",), 2, 2, 1), 1e9)
