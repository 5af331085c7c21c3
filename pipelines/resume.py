"""Elastic resume: a checkpoint taken on N ranks, finished on M ranks.

A reader's position is data (``pipelines.sample_order``): each worker state names its share, its
worker split and how many samples of its delivery order it consumed, so the positions consumed
before the checkpoint follow from the states alone. ``elastic_states`` gathers them from the N
ranks' states, takes what remains of the epoch (in the epoch's global order, which does not depend
on the world size) and cuts it into M balanced, contiguous shares: rank ``m`` of M loads share
``m`` with ``dataset.load_state_dict`` before its loader starts, and its DataLoader workers split
it. The next epoch is the normal M-rank epoch.

Exact: every sample the N-rank epoch had not delivered is delivered once across the M ranks, none
delivered before the checkpoint comes again; the rank shares differ by at most one sample. Not
exact: the order of the remainder is not the order N ranks would have used (each M-rank worker
shuffles its part of the remainder by windows, seeded as usual); samples in flight in a loader's
prefetch queue at the checkpoint were not consumed and come again; with ``drop_last`` the M shares
are cut to equal length, so up to M - 1 remaining samples are left out of the interrupted epoch.

Input states are what ``StatefulDataLoader.state_dict()`` returns (workers or none), or the
datasets' own ``state_dict()``s; all must come from one epoch of one dataset version with the same
options. A loader state taken with ``snapshot_every_n_steps`` > 1 holds its workers' states at the
last snapshot and the steps since (``_steps_since_snapshot``): the steps are dealt to the workers in
the loader's turn (round robin from the worker after the last one that yielded, skipping workers
that have run dry), ``batch_size`` samples each (the dataset's own ``batch_size`` in batch mode, else
the loader's, which ``batch_size=`` gives); without it such a state is refused.

Padding: the M shares differ by at most one sample; a short one gets one repeat (a virtual position,
``sample_order.padding_runs``), so every new rank has as many samples (``drop_last``: cut instead);
repeats of the old ranks are never counted as delivered samples.
"""

from __future__ import annotations

from typing import Iterable

from pipelines import sample_order


def dataset_states(loader_state: dict, batch_size: int | None = None) -> list[dict]:
    """The dataset states inside one rank's checkpoint: a StatefulDataLoader's state (its workers'
    snapshots advanced by the steps since the snapshot, or the single process's dataset state), or a
    dataset state as it is. ``batch_size``: the loader's (needed for steps since a snapshot when the
    dataset yields samples, not batches)."""
    if "kind" in loader_state:
        return [loader_state]
    snapshot = loader_state.get("_snapshot")
    if snapshot is not None:
        workers = snapshot.get("_worker_snapshots", {})
        states = [w.get("dataset_state") for _, w in sorted(workers.items(), key=lambda kv: _worker_number(kv[0]))]
    else:
        states = [loader_state.get("dataset_state")]
    if not states or any(s is None or "kind" not in s for s in states):
        raise ValueError("a checkpoint without a reader state: was the loader a StatefulDataLoader over a "
                         "dataset with state_dict()?")
    steps = int(loader_state.get("_steps_since_snapshot") or 0)
    if snapshot is not None and steps:
        states = [dict(s) for s in states]
        last = int(snapshot.get("_last_yielded_worker_id", -1))
        advance_by_steps(states, steps, (last + 1) % len(states), _step_samples(states[0], batch_size))
    return states


def _worker_number(key: str) -> int:
    return int("".join(c for c in str(key) if c.isdigit()) or 0)


def _step_samples(state: dict, batch_size: int | None) -> int:
    """Samples one loader step takes from a worker: the dataset's batch in batch mode, else the loader's."""
    size = state.get("batch_size") or batch_size
    if not size:
        raise ValueError("this loader state was taken between snapshots (snapshot_every_n_steps > 1) of a dataset "
                         "that yields samples: pass batch_size= (the loader's) so the steps since the snapshot "
                         "are counted, or checkpoint with snapshot_every_n_steps=1")
    return int(size)


def advance_by_steps(states: list[dict], steps: int, first: int, per_step: int) -> None:
    """Advance the worker states (index = worker number) by ``steps`` loader steps dealt in turn from
    worker ``first``: each takes up to ``per_step`` samples from the next worker that has any left."""
    left = [len(sample_order.worker_positions(s["runs"], s["worker"], s["num_workers"])) - s["position"]
            for s in states]
    worker = first
    for _ in range(steps):
        for _ in range(len(states)):
            if left[worker] > 0:
                break
            worker = (worker + 1) % len(states)
        else:
            raise ValueError(f"the loader state counts {steps} steps since its snapshot, more than its workers had left")
        take = min(per_step, left[worker])
        states[worker]["position"] += take
        left[worker] -= take
        worker = (worker + 1) % len(states)


def consumed(state: dict) -> list[int]:
    """The global positions one worker state had consumed (delivered or skipped as damaged)."""
    positions = sample_order.worker_positions(state["runs"], state["worker"], state["num_workers"])
    seed = f"{state['seed']}:{state['epoch']}:{state['rank']}:{state['worker']}" if state["shuffle"] else None
    return sample_order.delivery_order(positions, state["window"], seed)[:state["position"]]


_SAME = ("kind", "version", "dataset", "epoch", "seed", "shuffle", "window", "samples", "drop_last", "world_size")


def _check(states: list[dict]) -> int:
    """The old world size, after checking the states are one epoch's, every worker of every rank once."""
    first = states[0]
    for s in states:
        differ = [k for k in _SAME if s.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"states of different runs or epochs (they differ in {differ})")
        if s["worker"] is None:
            raise ValueError("a rank share that no loader has started: resume from the loaders' states")
    n = first["world_size"]
    seen = {(s["rank"], s["worker"]) for s in states}
    want = {(s["rank"], w) for s in states for w in range(s["num_workers"])}
    ranks = {s["rank"] for s in states}
    if len(seen) != len(states) or seen != want or ranks != set(range(n)):
        raise ValueError(f"the checkpoint must hold every worker of all {n} ranks once; it has (rank, worker) "
                         f"{sorted(seen)}")
    return n


def remaining_positions(states: list[dict]) -> list[int]:
    """The epoch's positions the old ranks were to deliver and had not, in global order."""
    done: set[int] = set()
    share: set[int] = set()
    for s in states:
        if s["worker"] == 0:
            share.update(sample_order.take_runs(s["runs"], 0, sample_order.runs_length(s["runs"])))
        done.update(consumed(s))
    return sorted(p for p in share - done if p < s["samples"])  # repeats (virtual positions) are not owed


def elastic_states(loader_states: Iterable[dict], world_size: int, batch_size: int | None = None) -> list[dict]:
    """From the N ranks' checkpoint states, one state per rank of ``world_size`` (M) ranks: rank ``m``
    calls ``dataset.load_state_dict(result[m])`` (a dataset built with rank=m, world_size=M) before
    its loader starts, and the M ranks finish the interrupted epoch, each remaining sample once (and
    as many samples each: a short share gets one repeat). ``batch_size``: the loaders' (see
    ``dataset_states``)."""
    states = [s for loader_state in loader_states for s in dataset_states(loader_state, batch_size)]
    if not states:
        raise ValueError("no states given")
    if world_size < 1:
        raise ValueError(f"world size {world_size} < 1")
    _check(states)
    left = remaining_positions(states)
    parts = [left[slice(*sample_order.balanced(len(left), world_size, m))] for m in range(world_size)]
    total = states[0]["samples"]
    if states[0]["drop_last"]:
        shortest = min(len(p) for p in parts)
        runs = [sample_order.runs_of(p[:shortest]) for p in parts]
    else:
        longest = max(len(p) for p in parts)
        short = [m for m, p in enumerate(parts) if len(p) < longest]
        runs = [sample_order.runs_of(p) + ([[total + short.index(m), total + short.index(m) + 1]] if m in short else [])
                for m, p in enumerate(parts)]
    base = {k: states[0][k] for k in _SAME if k in states[0]}
    return [{**base, "world_size": world_size, "rank": m, "worker": None, "num_workers": None,
             "runs": r, "position": 0, "skipped": 0, **({"batch_size": states[0]["batch_size"]}
                                                        if "batch_size" in states[0] else {})}
            for m, r in enumerate(runs)]


def padding_of(state: dict) -> int:
    """How many of a rank state's positions are repeats that even out the ranks (virtual positions)."""
    return sum(stop - start for start, stop in state["runs"] if start >= state["samples"])


def rank_state(loader_states: Iterable[dict], rank: int, world_size: int, batch_size: int | None = None) -> dict:
    """``elastic_states(loader_states, world_size, batch_size)[rank]``: what rank ``rank`` of ``world_size`` loads."""
    return elastic_states(loader_states, world_size, batch_size)[rank]
