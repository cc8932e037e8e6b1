"""The road a config takes through the rooms: how often execution goes from one project folder to
another, and back up the import layers, on the way from ``trainer.cli.main.main`` to the workers
(issue 45's "visits, climbs back up and returns"). Run by hand, not part of the default test run:

    PYTHONPATH=. python tests/bench/bench_road.py                       # both scenarios
    PYTHONPATH=. python tests/bench/bench_road.py --scenario launcher

Scenarios, each in a fresh interpreter whose working directory is a new temporary folder:

- ``launcher``: ``main()`` with ``+parallel=3d mesh=[2,2,2] train.steps=1 tracking=none``, traced from
  the call of ``main`` until the launcher hands the workers to torch's elastic agent
  (``torch.distributed.launcher.api.launch_agent``, which is replaced by a stop: no worker starts).
  The import of ``trainer.cli.main`` itself is not traced; imports made while ``main`` runs are.
- ``one-device``: ``main()`` with ``train.steps=1 tracking=none`` (one device, trained in this process),
  traced from the call of ``main`` until the first call of an optimizer's ``step`` (a function named
  ``step`` in ``torch/optim/``); the run then finishes untraced.

Definitions (``sys.setprofile``, the main thread only; only Python frames whose file lies under the
traced tree's ``api/``, ``service/``, ``trainer/`` or ``parallel/`` count, library frames are looked through):

- **room**: a module's folder as the import-linter contracts in ``pyproject.toml`` name it: the longest
  layer of any contract that is a prefix of the module (``trainer.planner.memory``, ``parallel.plan``);
  a module under no listed layer is its package plus its first part (``parallel.context``,
  ``trainer.planner`` for ``trainer/planner/__init__.py``); a package's own ``__init__`` is its package.
- **caller** of a project frame: the nearest project frame below it on the stack (so a call made by
  Hydra, importlib, contextlib or torch on the project's behalf is charged to the project frame that
  called them; a module body run by an import is called by the frame that imported it).
- **visit**: a call event (a function call, a generator resumed, a module body run) of a project frame
  whose room differs from its caller's room; the first project frame is the first visit. ``rooms``
  counts the distinct rooms visited.
- **climb back up**: a visit into a room above its caller's room: a higher package in the contract
  ``api > service > trainer > parallel``, or, inside one package, a layer listed earlier in that
  package's contract (``trainer.launch`` above ``trainer.validate``; rooms joined by ``|`` are level).
  A room under no listed layer is level with everything in its package.
- **return**: a return event (a value returned, a generator yielding, an exception leaving) of a
  project frame whose room differs from its caller's room: execution crossing back into another room.
  Since the import-linter contracts hold, every climb is a call the upper room arranged: a hook it
  installed (the memory model's module hooks, run from the model's forward), a function or an object
  it passed down.
- **distinct** visits / climbs: distinct (caller function, callee function) pairs among them, so a
  loop over layers or parameters counts once: the number of different crossings in the code's road.
- **outside the meta pass**: the same counts leaving out every event while the memory model's meta
  forward/backward (``trainer/planner/memory/meta_pass.py:saved_activations``) is on the stack, where
  its torch function/dispatch modes and saved-tensor hooks (``trainer.planner.memory``) run from the
  model's code (``trainer.models``) once per op: hundreds of climbs that are one pass over the model.
  The ``meta passes`` column counts the calls of ``saved_activations``.
- **entries of a module** (``trainer/models/__init__.py``, ``parallel/plan/resolve.py``): call events of
  a frame in that file whose caller is in another file, i.e. separate times execution enters it
  (calls within the file are not counted); its first entry is usually its import.

The table gives, per scenario, the counts, then the climbs by (from room -> to room), most first.
Recorded results: tests/bench/results/road_2026-11-29.txt.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

ROOT = Path(os.environ.get("ROAD_ROOT") or Path(__file__).resolve().parents[2])
PACKAGES = ("api", "service", "trainer", "parallel")  # highest first
WATCHED = ("trainer/models/__init__.py", "parallel/plan/resolve.py")
META_PASS = ("trainer/planner/memory/meta_pass.py", "saved_activations")  # the memory model's meta pass
SCENARIOS = {
    "launcher": ["+parallel=3d", "mesh=[2,2,2]", "train.steps=1", "tracking=none"],
    "one-device": ["train.steps=1", "tracking=none"],
}


class WorkersStart(BaseException):
    """Raised where the launcher hands its workers to torch's agent: the launcher's road ends there."""


def layer_levels(pyproject: Path) -> dict[str, int]:
    """Each contract layer's level inside its package (0 the highest), from import-linter's contracts."""
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    levels: dict[str, int] = {}
    for contract in contracts:
        layers = contract.get("layers", [])
        if set(layers) == set(PACKAGES):
            continue  # the packages' order is PACKAGES
        for level, layer in enumerate(layers):
            for name in layer.split("|"):
                levels[name.strip()] = level
    return levels


class Tally:
    """Visits, climbs and returns of one part of the road."""

    def __init__(self) -> None:
        self.visits = self.climbs = self.returns = 0
        self.edges: set[tuple[Any, Any]] = set()  # (caller's code, callee's code) of each visit
        self.climb_edges: set[tuple[Any, Any]] = set()
        self.visited: collections.Counter[str] = collections.Counter()
        self.climb_pairs: collections.Counter[str] = collections.Counter()
        self.crossings: collections.Counter[str] = collections.Counter()  # caller's room -> room, per visit

    def result(self) -> dict[str, Any]:
        return {"visits": self.visits, "rooms": len(self.visited), "climbs": self.climbs, "returns": self.returns,
                "edges": len(self.edges), "climb_edges": len(self.climb_edges),
                "climb_pairs": self.climb_pairs.most_common(), "most_visited": self.visited.most_common(8),
                "crossings": self.crossings.most_common(10)}


class Road:
    """The profile function: visits, climbs, returns and module entries, as the docstring defines them;
    counted over all events (``all``) and over those outside the memory model's meta pass (``road``)."""

    def __init__(self, levels: dict[str, int]) -> None:
        self.levels = levels
        self.prefixes = sorted(levels, key=len, reverse=True)
        self.roots = {str(ROOT / package) + os.sep: package for package in PACKAGES}
        self.rooms: dict[str, str | None] = {}  # file -> room (None: not the project's)
        self.modules: dict[str, str] = {}  # file -> path relative to ROOT
        self.all, self.road = Tally(), Tally()
        self.entries: collections.Counter[str] = collections.Counter()
        self.meta_passes = self.in_meta_pass = 0

    def room(self, filename: str) -> str | None:
        if filename not in self.rooms:
            self.rooms[filename] = None
            for prefix in self.roots:
                if filename.startswith(prefix):
                    relative = Path(filename).relative_to(ROOT)
                    self.modules[filename] = relative.as_posix()
                    parts = list(relative.with_suffix("").parts)
                    if parts[-1] in ("__init__", "__main__"):
                        parts.pop()
                    module = ".".join(parts)
                    layer = next((p for p in self.prefixes if module == p or module.startswith(p + ".")), None)
                    self.rooms[filename] = layer or ".".join(parts[:2])
        return self.rooms[filename]

    def caller(self, frame: FrameType) -> FrameType | None:
        back = frame.f_back
        while back is not None and self.room(back.f_code.co_filename) is None:
            back = back.f_back
        return back

    def above(self, to: str, source: str) -> bool:
        """Whether room ``to`` sits above room ``source`` in the layers."""
        to_package, source_package = to.split(".")[0], source.split(".")[0]
        if to_package != source_package:
            return PACKAGES.index(to_package) < PACKAGES.index(source_package)
        to_level, source_level = self.levels.get(to), self.levels.get(source)
        return to_level is not None and source_level is not None and to_level < source_level

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" and event != "return":
            return
        code = frame.f_code
        room = self.room(code.co_filename)
        if room is None:
            return
        caller = self.caller(frame)
        caller_room = self.room(caller.f_code.co_filename) if caller is not None else None
        meta_pass = code.co_name == META_PASS[1] and code.co_filename.endswith(META_PASS[0])
        tallies = (self.all,) if self.in_meta_pass else (self.all, self.road)
        if event == "call":
            if meta_pass:
                self.meta_passes += 1
                self.in_meta_pass += 1
            if caller is None or caller.f_code.co_filename != code.co_filename:
                self.entries[self.modules[code.co_filename]] += 1
            if caller_room != room:
                edge = (caller.f_code if caller is not None else None, code)
                climbs = caller_room is not None and self.above(room, caller_room)
                for tally in tallies:
                    tally.visits += 1
                    tally.visited[room] += 1
                    tally.edges.add(edge)
                    tally.crossings[f"{caller_room} -> {room}"] += 1
                    if climbs:
                        assert caller is not None
                        tally.climbs += 1
                        tally.climb_edges.add(edge)
                        tally.climb_pairs[f"{caller_room}:{caller.f_code.co_name} -> {room}:{code.co_name}"] += 1
            return
        if meta_pass:
            self.in_meta_pass -= 1
        if caller_room is not None and caller_room != room:
            for tally in (self.all,) if self.in_meta_pass else (self.all, self.road):
                tally.returns += 1

    def result(self) -> dict[str, Any]:
        return {"all": self.all.result(), "road": self.road.result(), "meta_passes": self.meta_passes,
                "entries": {module: self.entries.get(module, 0) for module in WATCHED}}


def trace(scenario: str) -> dict[str, Any]:
    """One scenario in this process (a fresh one: Hydra and the project keep process-wide state)."""
    sys.path.insert(0, str(ROOT))
    import torch.distributed.launcher.api as elastic_api

    from trainer.cli.main import main

    road = Road(layer_levels(ROOT / "pyproject.toml"))

    def stop(*args: Any, **kwargs: Any) -> NoReturn:
        sys.setprofile(None)
        raise WorkersStart

    def until_first_step(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_name == "step" and "torch" + os.sep + "optim" + os.sep in code.co_filename:
            sys.setprofile(None)
            return
        road(frame, event, arg)

    elastic_api.launch_agent = stop  # elastic_launch.__call__ looks it up in its module
    sys.argv = ["trainer", *SCENARIOS[scenario]]
    sys.setprofile(until_first_step)
    reached = None
    try:
        main()
    except WorkersStart:
        reached = "workers start"
    except SystemExit as done:
        reached = f"exit {done.code}"
    finally:
        still_tracing = sys.getprofile() is not None
        sys.setprofile(None)
    if scenario == "one-device" and not still_tracing:
        reached = "first optimizer step"
    return {**road.result(), "reached": reached}


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"traced tree: {ROOT} (git {git_head()})",
             f"{'scenario':<22} {'visits':>6} {'rooms':>5} {'climbs':>6} {'returns':>7} "
             f"{'distinct':>14} {'models/':>8} {'plan/':>8} {'meta':>5}",
             f"{'':<22} {'':>6} {'':>5} {'':>6} {'':>7} {'visits/climbs':>14} "
             f"{'__init__':>8} {'resolve':>8} {'passes':>5}  reached"]
    for name, r in results.items():
        for part, label in (("all", name), ("road", f"{name}, no meta pass")):
            t = r[part]
            distinct = f"{t['edges']}/{t['climb_edges']}"
            lines.append(f"{label:<22} {t['visits']:>6} {t['rooms']:>5} {t['climbs']:>6} {t['returns']:>7} "
                         f"{distinct:>14} {r['entries'][WATCHED[0]]:>8} {r['entries'][WATCHED[1]]:>8} "
                         f"{r['meta_passes']:>5}  {r['reached']}")
    for name, r in results.items():
        road, everything = r["road"], r["all"]
        lines.append(f"\n{name}: climbs back up outside the meta pass, from room:function -> room:function")
        lines += [f"  {n:>5}  {pair}" for pair, n in road["climb_pairs"]] or ["  none"]
        lines.append(f"  (inside the meta pass: {everything['climbs'] - road['climbs']} more, the memory model's "
                     "modes and saved-tensor hooks run from the model's code)")
        lines.append(f"{name}: most visited rooms: "
                     + ", ".join(f"{room} {n}" for room, n in everything["most_visited"]))
        lines.append(f"{name}: busiest crossings outside the meta pass (visits): "
                     + ", ".join(f"{pair} {n}" for pair, n in road["crossings"]))
    return "\n".join(lines)


def git_head() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--child", choices=list(SCENARIOS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = trace(args.child)
        print("ROAD " + json.dumps(result), flush=True)
        return
    results = {}
    for name in SCENARIOS if args.scenario == "all" else [args.scenario]:
        with tempfile.TemporaryDirectory(prefix="road-") as cwd:  # the run's outputs (logs, checkpoints) go here
            done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", name], cwd=cwd,
                                  capture_output=True, text=True, env={**os.environ, "ROAD_ROOT": str(ROOT)})
        found = [line for line in done.stdout.splitlines() if line.startswith("ROAD ")]
        if not found:
            raise SystemExit(f"{name}: no result (exit {done.returncode}):\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        results[name] = json.loads(found[-1][5:])
    print(table(results))


if __name__ == "__main__":
    main()
