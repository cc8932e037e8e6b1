"""``GET /v1/jobs/{id}/logs?tail=N`` finds its start by reading blocks from the end
(api/routes/logs.py): the same lines as before, at a cost of the tail's blocks, not of its bytes.

    python -m pytest tests/unit/test_log_tail.py -q
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from api.routes.logs import CHUNK, _tail_offset


def reference_offset(data: bytes, lines: int) -> int:
    """Where the last ``lines`` lines begin, the plain way (a final newline ends the last line)."""
    body = data[:-1] if data.endswith(b"\n") else data
    starts = [i + 1 for i, byte in enumerate(body) if byte == 10]
    return starts[-lines] if len(starts) >= lines else 0


def lines_executed(path: Path, lines: int) -> tuple[int, int]:
    """``(offset, Python lines _tail_offset executed)``: its cost, counted, not timed."""
    executed = 0

    def tracer(frame, event, _):
        nonlocal executed
        if frame.f_code is _tail_offset.__code__:
            if event == "line":
                executed += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        offset = _tail_offset(path, lines)
    finally:
        sys.settrace(None)
    return offset, executed


def test_tail_offsets_match_the_plain_definition(tmp_path):
    rng = random.Random(36)
    path = tmp_path / "job.log"
    for trial in range(200):
        size = rng.choice([0, 1, 5, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7, rng.randint(0, 4 * CHUNK)])
        newline_share = rng.choice([0.0, 0.001, 0.05, 0.5, 1.0])
        data = bytes(10 if rng.random() < newline_share else 97 for _ in range(size))
        path.write_bytes(data)
        for lines in (1, 2, 3, rng.randint(1, 200), 1_000_000):
            assert _tail_offset(path, lines) == reference_offset(data, lines), (trial, size, lines)
    assert _tail_offset(tmp_path / "missing.log", 3) == 0


def test_the_cost_is_the_tails_blocks_not_its_bytes(tmp_path):
    # 4 MiB without a newline: the tail is the whole file, read in 64 blocks, not looked at byte by byte
    # (the loop over bytes ran about 4 million Python lines here, 3 s of CPU per request at 64 MiB).
    flat = tmp_path / "flat.log"
    flat.write_bytes(b"x" * (4 << 20))
    offset, executed = lines_executed(flat, 1)
    blocks = (4 << 20) // CHUNK
    assert offset == 0 and executed <= 12 * blocks + 20, executed

    # 300 MB of log before three lines costs what the three lines alone cost.
    tail = b"".join(b"line %d\n" % i for i in range(100))
    huge, small = tmp_path / "huge.log", tmp_path / "small.log"
    with open(huge, "wb") as f:
        f.truncate(300 << 20)  # sparse: written in a blink
        f.seek(300 << 20)
        f.write(tail)
    small.write_bytes(tail)
    (huge_offset, huge_cost), (small_offset, small_cost) = lines_executed(huge, 3), lines_executed(small, 3)
    assert huge_offset - (300 << 20) == small_offset == tail.index(b"line 97")
    assert huge_cost == small_cost
