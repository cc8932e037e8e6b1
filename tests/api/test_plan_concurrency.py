"""Plans requested at once give the numbers each gives alone: ``POST /v1/plans`` computes them side
by side in the validation pool's workers, and each plan's meta pass applies its attention kernel in
its own thread (trainer.planner.memory.meta_pass.AttentionKernel), so one plan's pass never changes another's."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

# Two meta passes that differ in model, tensor parallelism, sequence length and data parallelism,
# each with attention in every block.
TP_DEBUG = ["model=gpt_debug", "train.seq_len=64", "+parallel=tp", "mesh=[2]", "tracking.pictures=false"]
FSDP_SMALL = ["model=gpt_small", "train.seq_len=128", "train.global_batch_size=4", "+parallel=fsdp", "mesh=[2]",
              "tracking.pictures=false"]


def test_concurrent_plans_give_the_numbers_each_gives_alone(queue_server):
    with queue_server.client("bob") as bob:
        alone = []
        for overrides in (TP_DEBUG, FSDP_SMALL):
            response = bob.post("/v1/plans", json={"overrides": overrides})
            assert response.status_code == 200, response.text
            alone.append(response.json())
    debug, small = alone
    assert debug["model"] == small["model"] == "llama" and debug["dims"] == ["tp"] and small["dims"] == ["dp"]
    assert [r["activation_bytes"] > 0 for r in debug["per_pp_rank"] + small["per_pp_rank"]] == [True, True]
    assert debug["per_pp_rank"] != small["per_pp_rank"]

    # Each config twice, all four released together, so the passes run side by side in the thread pool.
    requests = [TP_DEBUG, FSDP_SMALL, TP_DEBUG, FSDP_SMALL]
    start = threading.Barrier(len(requests))

    def post(overrides: list[str]):
        with queue_server.client("bob") as client:
            start.wait()
            return client.post("/v1/plans", json={"overrides": overrides})

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        together = list(pool.map(post, requests))
    assert [r.status_code for r in together] == [200] * len(requests), [r.text for r in together]
    assert [r.json() for r in together] == [debug, small, debug, small]  # every number, exactly
