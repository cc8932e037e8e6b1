"""What a step on a hardware profile waits for beyond its busiest rank's passes: the pipeline's
bubble (:func:`pipeline_bubble_s`) and the communication left exposed (:func:`_waits`): tp's
collectives, the fill and drain's sends, FSDP's and ddp's gathers and reduces beyond what compute
hides (a pipeline's: :func:`pipelined_dp_exposed`), the cp ring's hops beyond its attention blocks
(:func:`_ring_step_s`), and the optimizer step. :mod:`trainer.planner.cost.device` adds them up.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, defaultdict

from parallel.plan.spec import ParallelPlan
from trainer.config.hardware import HardwareProfile
from trainer.config.schema import RunConfig
from trainer.models import decoder_config
from trainer.planner.cost.comm import comm_ops, ring_exposed_s
from trainer.planner.cost.links import collective_seconds, group_link
from trainer.planner.cost.reference import rank_units
from trainer.planner.memory.layout import checkpointed
from trainer.planner.cost.speed import DeviceSpeed


def pipeline_bubble_s(busy: list[float], bubble: float) -> float:
    """The seconds a pipeline idles beyond its busiest rank's ``max(busy)``, for a schedule whose bubble
    fraction with equal stages is ``bubble`` (:func:`parallel.pipeline.order.expected_bubble`).

    With equal stages of ``t`` per micro-batch, 1F1B takes ``(m + p - 1) t``: the steady state's
    ``m t`` plus the fill and drain's ``(p - 1) t``, ``bubble / (1 - bubble)`` of the busy time. With
    unequal stages the steady state goes at the busiest rank's pace but the fill and drain pass through
    every other rank at its own: 1F1B takes ``(m - 1) t_max + sum_r t_r``. So the idle time is
    ``bubble / (1 - bubble)`` times the mean of the other ranks' busy time, not the busiest's (the same
    for equal stages; ``1 / v`` of it for v interleaved chunks, as the fraction already says)."""
    if len(busy) < 2 or bubble <= 0:
        return 0.0
    others = sorted(busy)[:-1]
    return bubble / (1.0 - bubble) * sum(others) / len(others)


def _waits(cfg: RunConfig, plan: ParallelPlan, profile: HardwareProfile, params: dict, micro: int,
           busy: list[float], speed: DeviceSpeed, per_micro: list[tuple[float, float]] | None = None):
    """``(comm seconds per axis, exposed seconds per axis, bytes sent per axis, optimizer seconds)`` of
    the pp rank whose communication and optimizer step leave the most on the critical path.
    ``per_micro``: each pp rank's forward and backward seconds of one micro-batch (what a pipelined
    stage's gathers and reduces can hide behind); ``None``: as much as there is (a lower bound)."""
    per_node = max(1, plan.mesh.world_size // cfg.launch.nnodes)  # the ranks one node runs (row-major)
    dp = plan.param_data_parallel  # FSDP over dp x cp: the cp ranks gather, reduce and shard as dp ranks
    shard = plan.mesh.size(dp.shard_dim_names) if dp else 1
    dp_axes = ",".join(dp.dim_names) if dp else None
    # joined; hsdp's replicate axis and its shard axes (with a cp axis folded in: joined); beside ep, the parameters
    # other than the experts are FSDP over the shard axes x ep (comm._dp_ops): prefetched and reduced like the rest
    dp_keys = {dp_axes, *dp.dim_names, ",".join(dp.shard_dim_names)} if dp else set()
    if dp and plan.expert_parallel is not None:
        dp_keys.add(",".join((*dp.shard_dim_names, plan.expert_parallel.dim)))
    key_axis = dp_axes or "dp"
    step_s = _ring_step_s(cfg, plan, micro, speed)
    ranks, known = [], {}
    blocks, wrapped = set(plan.blocks), checkpointed(plan)
    experts = Counter(plan.unit_of(fqn) for fqn in plan.expert_parallel.modules) if plan.expert_parallel else Counter()
    for rank, held in enumerate(rank_units(plan)):
        # Ranks that hold alike units (a deep pipeline's middle stages) run the same collectives: priced once.
        key = (tuple((params[u], u in blocks, u in wrapped, experts[u]) for u in held),
               None if plan.pipeline is not None else busy[rank])
        if key not in known:
            known[key] = _rank_waits(cfg, plan, profile, held, params, micro, busy[rank], speed, step_s,
                                     per_node, dp_keys, key_axis, shard)
        comm, exposed, traffic, *rest = known[key]
        ranks.append((dict(comm), defaultdict(float, exposed), dict(traffic), *rest))
    if plan.pipeline is not None and any(r[4] + r[6] for r in ranks):
        dp_s = pipelined_dp_exposed([r[4:7] for r in ranks], per_micro, plan.pipeline.stages_per_rank)
        for r in ranks:  # the whole pipeline waits for it: every rank's step ends with it
            r[1][key_axis] += dp_s * cfg.train.grad_accum
    worst = max(ranks, key=lambda r: sum(r[1].values()) + r[3])
    return dict(worst[0]), dict(worst[1]), dict(worst[2]), worst[3]


def _rank_waits(cfg: RunConfig, plan: ParallelPlan, profile: HardwareProfile, held: list[str], params: dict,
                micro: int, busy: float, speed: DeviceSpeed, step_s: tuple[float, float], per_node: int,
                dp_keys: set, key_axis: str, shard: int) -> tuple:
    """One pp rank's ``(comm, exposed, traffic, optimizer, gathers, largest gather, reduces)`` (see :func:`_waits`),
    which depend on the units it holds (``held``) through what :func:`comm_ops` reads of them: their parameters,
    whether each is a block or a checkpointed one, and the expert modules it holds."""
    shape, names = plan.mesh.shape, plan.mesh.dim_names
    comm: dict[str, float] = defaultdict(float)
    exposed: dict[str, float] = defaultdict(float)
    traffic: dict[str, float] = defaultdict(float)
    gathers, first, reduces, tail, hops = 0.0, 0.0, 0.0, 0.0, {}
    priced: dict[tuple, float] = {}  # FSDP's alike blocks: the same collective on the same buffer, priced once
    for op in comm_ops(cfg, plan, held, params, micro):
        if (op.op, op.axis, op.nbytes) not in priced:
            link = _link(shape, names, tuple(op.axis.split(",")), per_node)
            priced[op.op, op.axis, op.nbytes] = collective_seconds(profile, op.op, link, op.nbytes)
        one = priced[op.op, op.axis, op.nbytes]
        comm[op.axis] += one * op.count
        traffic[op.axis] += op.sent_bytes
        if op.role in ("kv", "kv_grad"):  # the cp ring's hops: behind its attention blocks, below
            hops[op.role] = (one, op.count)
        elif op.op == "send_recv":
            exposed[op.axis] += one * min(op.count, 2 * (plan.pp_size - 1) * cfg.train.grad_accum)
        elif op.axis in dp_keys:
            if op.op == "all_gather":
                gathers += one * op.count
                first = max(first, one)
            else:
                reduces += one * op.count
                tail = max(tail, one)
        else:  # tp (the engine's tensor-parallel styles are synchronous), the cp all-gather's K/V
            exposed[op.axis] += one * op.count
    if "kv" in hops:
        g = plan.cp_size
        (hop, count), (grad_hop, grad_count) = hops["kv"], hops["kv_grad"]
        layers = grad_count / g  # block passes backward; forward: a checkpointed block's twice
        forward, backward = ring_exposed_s(g, hop, grad_hop, *step_s)
        assert plan.context_parallel is not None, "K/V hops are context parallelism's"
        exposed[plan.context_parallel.dim] += forward * (count / (g - 1) - layers) + backward * layers
    if plan.pipeline is None and gathers + reduces:  # prefetched / bucketed behind compute, the last reduce excepted
        dp_s = gathers + reduces
        exposed[key_axis] += max(dp_s - busy, 0.0) + min(tail, dp_s)
    numel = sum(params[u][0] for u in held)
    return comm, exposed, traffic, speed.optimizer_s(numel / shard), gathers, first, reduces

def pipelined_dp_exposed(ranks: list[tuple[float, float, float]], per_micro: list[tuple[float, float]] | None,
                         chunks: int) -> float:
    """Seconds a pipeline's data-parallel collectives add to one accumulation pass, as torch 2.13's
    pipelining runs FSDP2 and replicate. ``ranks``: per pp rank in order, ``(all-gather seconds,
    its largest single all-gather, reduce seconds)``; ``per_micro``: per rank ``(forward, backward)``
    seconds of one micro-batch over all its ``chunks`` stages (``None``: unbounded, a lower bound).

    * Gathers: parameters stay gathered across micro-batches (``reshard_after_forward=False``), so a
      stage gathers during its first micro-batch's forward, each unit's all-gather prefetched behind
      the unit before it, and before that input arrives (NCCL's waits hold the stream, not the host):
      rank ``r`` starts its first chunk's forward when rank ``r-1``'s is done and its own largest
      gather is in, and ends it no sooner than all its gathers are. What this delays the fill by is exposed.
    * Reduces: ``PipelineStage`` runs every backward without gradient sync and reduces a stage's
      gradients after its last backward (``perform_reduce_grad``: every FSDP unit's reduce-scatter, or
      replicate's all-reduce, then the compute stream waits for them). Nothing hides them behind the
      last micro-batches' backward on the same rank (Megatron's overlap-grad-reduce would); only the
      drain does: rank ``r`` finishes its last backward while ranks ``r-1 .. 0`` still run theirs
      (one chunk each), so the step waits ``max_r(reduce_r - sum_{q<r} backward_q / chunks)``; rank 0's
      reduce is always exposed.
    """
    reduce_wait, slack = 0.0, 0.0
    for r, (_, _, reduces) in enumerate(ranks):
        reduce_wait = max(reduce_wait, reduces - slack)
        slack += math.inf if per_micro is None else per_micro[r][1] / chunks
    if per_micro is None:
        return reduce_wait
    end, baseline = 0.0, 0.0
    for (gathers, first, _), (forward, _) in zip(ranks, per_micro):
        chunk = forward / chunks
        end = max(max(end, first) + chunk, gathers)
        baseline += chunk
    return max(end - baseline, 0.0) + reduce_wait


def _ring_step_s(cfg: RunConfig, plan: ParallelPlan, micro: int, speed: DeviceSpeed) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one cp ring step's attention: a rank's queries over one
    block of keys (``seq / cp`` each), half of the square under the balanced causal split (the own
    block's triangle; half of every other block's keys), backward 2.5 times forward (it recomputes
    the scores) at the profile's attention rates, as the pass prices the ring's kernels."""
    decoder = decoder_config(cfg.model)
    if plan.cp_size == 1 or decoder is None:
        return 0.0, 0.0
    tp = plan.mesh.size(plan.placement_axes)
    tokens = cfg.train.seq_len // plan.cp_size
    flops = 4.0 * micro * decoder.n_heads / tp * tokens * tokens * decoder.head_width * 0.5
    return flops / speed.attention_flops[0], 2.5 * flops / speed.attention_flops[1]


@functools.lru_cache(maxsize=4096)
def _link(shape: tuple[int, ...], names: tuple[str, ...], axes: tuple[str, ...], per_node: int):
    return group_link(shape, names, list(axes), per_node)
