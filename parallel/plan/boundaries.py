"""Where pipeline stages begin: pure arithmetic on the model's top-level units, no process group.

A *unit* is a piece the model may be cut between, in forward order: `tok_embeddings`,
`layers.0`, ..., `norm`, `output` (or raw top-level parameters such as `w0`, `w1`).
"""

from __future__ import annotations


def auto_boundaries(units: list[str], unit_params: list[int], num_stages: int) -> list[str]:
    """First unit of every stage but the first: contiguous stages whose largest parameter count
    is as small as it can be (the classic linear-partition dynamic programme; units are few)."""
    n = len(units)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} units into {num_stages} stages")
    prefix = [0]
    for count in unit_params:
        prefix.append(prefix[-1] + count)
    inf = float("inf")
    # best[k][i]: smallest max-stage size putting the first i units into k stages; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(num_stages, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return [units[i] for i in reversed(starts)]
