"""The order in which the search (:class:`trainer.planner.auto.search.Search`) prices the valid layouts:
best first, then the ranking the dry run prints.

    price_best_first(search, valid)       # valid: [(compute floor, candidate, cfg, plan), ...]
    candidates = ranked(valid, invalid, overflowing)

Each valid layout sits in one heap at the best lower bound of its step known so far: its compute floor,
then its full bound (:meth:`~trainer.planner.forecast.pricing.ProfilePricing.lower_bound`), then its
predicted step. The search always advances the lowest entry one stage: bounds it, prices its time or,
once its predicted step is the lowest key, predicts its memory. The first layout found to fit there is
the fastest that fits, since every other layout's step is at least its own key, so:

* memory (the costly part: the two-block floor, the full pass) is predicted only for layouts faster than
  the one chosen, which must be shown not to fit, and for the chosen one;
* time is priced only for layouts whose bound is below the chosen one's step; the rest are pruned by a
  bound above it, so none pruned could have won.

Among equal steps the layout first in the floors' order is checked first, as a scan in that order would.
``gpt_175b`` on 512 A100s: 142 memory predictions and 1,586 time pricings where a scan in floor order, whose
best stays unknown until a layout fits, made 2,449 and 2,495 (docs/planning.md).
"""

from __future__ import annotations

import heapq
import math

from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.planner.auto.ranking import Candidate

Valid = list[tuple[float, Candidate, RunConfig, ParallelPlan]]
FLOOR, BOUND, PRICED = 0, 1, 2  # what a heap entry's key is: the compute floor, the full bound, the step


def price_best_first(search, valid: Valid) -> None:
    """Price ``valid`` best first (see the module docstring), setting each candidate's verdict: chosen or
    slower (status ``slower`` until :func:`ranked`), does not fit, or pruned."""
    progress = search.progress
    heap = [(floor, i, FLOOR) for i, (floor, *_) in enumerate(valid)]
    heapq.heapify(heap)
    best, ranked_below = math.inf, search.rank_below
    while heap and heap[0][0] <= max(best, ranked_below):
        key, i, stage = heapq.heappop(heap)
        _, c, cfg, plan = valid[i]
        progress.floor = key
        if stage == FLOOR:
            c.lower_bound_s = search.pricing.lower_bound(cfg, plan, search.params(plan),
                                                         search.flops_per_sequence(cfg, plan))
            heapq.heappush(heap, (max(c.lower_bound_s, key), i, BOUND))
        elif stage == BOUND:
            search.predict(c, cfg, plan, memory=False)
            progress.count("priced")
            heapq.heappush(heap, (max(priced_step(c), key), i, PRICED))
        elif (step := priced_step(c)) < best or step <= ranked_below:  # the fastest priced, memory not known yet
            search.predict_memory(c, cfg, plan)
            # Only a layout predicted to fit ends the search: one above the budget within the prediction's
            # measured error (a user's own layout that is not refused) is kept, and chosen only if none fits.
            if c.status == "slower" and not c.memory_note and step < best:
                best, progress.best = step, c
        progress.tick("pricing")
    for key, i, stage in heap:  # every key > best (and rank_below): none of these can be chosen
        c = valid[i][1]
        if stage != PRICED:
            c.status, c.reason = "pruned", f"pruned: lower bound {key * 1e3:.1f} ms > best {best * 1e3:.1f} ms"
            progress.count("pruned")


def price_all(search, valid: Valid) -> None:
    """Every layout's bound, time and memory (``parallel.auto.prune=false``: the whole ranking exact)."""
    for _, c, cfg, plan in valid:
        c.lower_bound_s = search.pricing.lower_bound(cfg, plan, search.params(plan),
                                                     search.flops_per_sequence(cfg, plan))
        search.predict(c, cfg, plan)
        search.progress.count("priced")
        if c.status == "slower" and not c.memory_note and (search.progress.best is None
                                                           or priced_step(c) < priced_step(search.progress.best)):
            search.progress.best = c
        search.progress.tick("pricing")


def ranked(valid: Valid, invalid: list[Candidate], overflowing: list[Candidate]) -> list[Candidate]:
    """The ranking: the choice (the fastest predicted to fit, or within the prediction's measured error when
    none fits), then the other layouts kept (those that fit, not checked being slower, or may not fit) by step;
    then those that do not fit and the pruned; then the invalid."""
    # A layout whose memory was predicted goes before an unchecked one of the same step: only it can be chosen.
    predicted = sorted((c for _, c, _, _ in valid if c.status == "slower"), key=lambda c: (c.step_s, c.memory_skipped))
    # The choice is the fastest predicted to fit; one that may not fit (above the budget, within the measured
    # error) only when none fits. It heads the ranking; the rest follow by step.
    fitting = [c for c in predicted if not c.memory_note and not c.memory_skipped]
    if predicted:
        chosen = fitting[0] if fitting else predicted[0]
        predicted.remove(chosen)
        predicted.insert(0, chosen)
        chosen.status = "chosen"
        chosen.reason = ("chosen: fastest predicted to fit" if not chosen.memory_note else "chosen: none is "
                         "predicted to fit; fastest within the prediction's measured error of the budget")
        for c in predicted[1:]:
            if c.memory_note and priced_step(c) < priced_step(chosen):
                c.reason = (f"not chosen ({priced_step(c) / priced_step(chosen) - 1:+.0%} against the choice, "
                            "which fits)")
            else:
                c.reason = slower_reason(c, chosen) + ("; memory not predicted (it cannot be chosen)"
                                                       if c.memory_skipped else "")
        for c in predicted:
            if c.memory_note:
                c.reason += f"; {c.memory_note}"
    rest = [c for _, c, _, _ in valid if c.status in ("does not fit", "pruned")] + overflowing
    rest.sort(key=lambda c: (c.status != "does not fit", c.step_s or c.lower_bound_s or 0.0, c.peak_bytes or 0.0))
    return predicted + rest + invalid


def slower_reason(c: Candidate, winner: Candidate) -> str:
    """``slower: +23% (+4.1 ms comm tp)``: how much, and the part that grew most against the winner."""
    diffs = {part: c.parts_s.get(part, 0.0) - winner.parts_s.get(part, 0.0) for part in {**c.parts_s, **winner.parts_s}}
    part, extra = max(diffs.items(), key=lambda kv: kv[1])
    return f"slower: +{(priced_step(c) / priced_step(winner) - 1):.0%} (+{extra * 1e3:.1f} ms {part})"


def priced_step(c: Candidate) -> float:
    """A priced candidate's predicted step, in seconds."""
    assert c.step_s is not None, f"{c.label} is not priced"
    return c.step_s
