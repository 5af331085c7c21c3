"""``StatefulDataLoader`` as the readers' docs use it: torchdata's, with its one stray warning
silenced and its loaded state following the readers' epoch rule.

torchdata 0.11's ``StatefulDataLoader.__init__`` calls ``torch.set_vital``, which torch 2.x
deprecates, so every loader built prints "'set_vital' is deprecated" about torchdata's own code:
nothing the caller does or can change. That warning, attributed to torchdata's module, is filtered
here; every other warning (yours, torch's, torchdata's) still shows.

A loaded state holds, beside the readers' states, the loader's own bookkeeping of the iteration it
was taken in: how many batches it yielded, which worker yielded the last one (the next batch comes
from the worker after it). When ``set_epoch`` chose another epoch than the state's, an iterable
reader (``ImageShardDataset``, ``Mixture``) starts that epoch from its beginning
(``sample_order.continued_epoch``); this loader with workers then starts its iteration from its
beginning too (worker 0 first, nothing yielded), so the epoch's batches come in exactly
the order of an uninterrupted run. torchdata's own class would continue the old iteration's worker
turn: the new epoch's batches would come interleaved from another worker first. (Without workers,
torchdata's exception in docs/reading.md stays: after a short last batch the first pass is empty.)
Without ``set_epoch``, a state whose workers saved different epochs (persistent workers: one had not
started the newest epoch yet) continues the newest: the others start it from its beginning.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning,
                        module=r"torchdata\.")

from torchdata.stateful_dataloader import StatefulDataLoader as _TorchdataLoader  # noqa: E402 - after the filter

from torch.utils.data import IterableDataset  # noqa: E402

from pipelines.sample_order import continued_epoch  # noqa: E402

__all__ = ["StatefulDataLoader", "saved_workers", "saved_epochs", "starts_another_epoch", "fresh_iteration_state",
           "continues_saved_epoch"]


def saved_workers(state: dict) -> int | None:
    """The ``num_workers`` of the loader a ``state`` was taken from (0: no workers; None: not a loader state)."""
    if not isinstance(state, dict):
        return None
    if "_snapshot" in state:
        try:
            return int(state["_snapshot"]["_main_snapshot"]["_num_workers"])
        except (KeyError, TypeError, ValueError):
            return None
    return 0 if "_sampler_iter_state" in state or "_num_yielded" in state else None


def saved_epochs(state: dict) -> set[int]:
    """The epochs of the reader states inside a loader ``state`` (one per worker)."""
    if "_snapshot" in state:  # workers: each worker's reader state
        saved = [w.get("dataset_state") for w in state["_snapshot"]["_worker_snapshots"].values()]
    else:
        saved = [state.get("dataset_state")]
    return {int(s["epoch"]) for s in saved if isinstance(s, dict) and "epoch" in s}


def starts_another_epoch(dataset: Any, state: dict) -> bool:
    """Whether ``dataset`` (an iterable reader with ``chosen_epoch``) starts another epoch from its
    beginning instead of continuing the loader ``state``'s readers' states."""
    chosen = getattr(dataset, "chosen_epoch", None)
    epochs = saved_epochs(state)
    return chosen is not None and bool(epochs) and all(not continued_epoch(e, chosen)[1] for e in epochs)


def states_at_epoch(state: dict, epoch: int) -> dict:
    """A copy of a loader ``state`` whose reader states say ``epoch`` (a finished state, the next epoch chosen)."""
    state = copy.deepcopy(state)
    if "_snapshot" in state:
        found = [w.get("dataset_state") for w in state["_snapshot"]["_worker_snapshots"].values()]
    else:
        found = [state.get("dataset_state")]
    for reader_state in found:
        if isinstance(reader_state, dict) and "epoch" in reader_state:
            reader_state["epoch"] = int(epoch)
    return state


def fresh_iteration_state(state: dict) -> dict:
    """A loader ``state`` with workers, its bookkeeping of its iteration reset to a new iteration's
    (worker 0 first, nothing yielded); the readers' states, which carry the dataset versions, stay."""
    state = copy.deepcopy(state)
    snapshot = state["_snapshot"]
    snapshot["_snapshot_step"] = 0
    snapshot["_last_yielded_worker_id"] = int(snapshot["_main_snapshot"]["_num_workers"]) - 1
    snapshot["_main_snapshot"]["_sampler_iter_yielded"] = 0
    state["_steps_since_snapshot"] = 0
    state["_iterator_finished"] = False
    return state


def _position(loader) -> Any:
    """The ``OrderPosition`` of a map-style loader's resumable sampler (``pipelines.sampler_resume``), or None."""
    for sampler in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        for candidate in (sampler, getattr(sampler, "sampler", None)):
            if hasattr(candidate, "position") and hasattr(candidate.position, "chosen"):
                return candidate.position
    return None


def continues_saved_epoch(loader, state: dict) -> bool | None:
    """Whether iterating ``loader`` continues the epoch its loaded ``state`` was taken in (no ``set_epoch``,
    or ``set_epoch`` of that epoch); None when its dataset and sampler are not the readers' (torchdata's rule
    then)."""
    position = _position(loader)
    if position is None:  # the reader's own epoch (an iterable reader, or PackedTokenDataset's own order)
        return not starts_another_epoch(loader.dataset, state) if hasattr(loader.dataset, "chosen_epoch") else None
    from pipelines.sampler_resume import find_state

    try:
        saved = int(find_state(state, position.kind)["epoch"])
    except (LookupError, KeyError, TypeError, ValueError):
        return None
    return position.chosen is None or continued_epoch(saved, position.chosen)[1]


def _counts_at_iteration(loader, state: dict) -> bool:
    """Whether a map-style ``loader``'s sampler takes the reader's length when an iteration starts (torch's
    sequential or random sampler over it), or re-counts it when its state is loaded (the readers' resumable
    samplers holding it, where the loaded ``state`` holds theirs: torch's own BatchSampler around one is only
    fast-forwarded, its sampler never loads a state): only then may the reader be moved to a loaded state's
    version under it."""
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler
    from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler
    from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

    from pipelines.sampler_resume import find_state

    position = _position(loader)
    if position is not None:
        if getattr(position, "dataset", None) is not loader.dataset:
            return False
        try:
            find_state(state, position.kind)
        except (LookupError, KeyError, TypeError):
            return False
        return True
    batches = getattr(loader, "batch_sampler", None)
    sampler = batches.sampler if isinstance(batches, (BatchSampler, StatefulBatchSampler)) else \
        batches if batches is not None else loader.sampler
    if isinstance(sampler, SequentialSampler):
        return sampler.data_source is loader.dataset
    # shuffle=True: torchdata's own RandomSampler (no subclass of torch's)
    return isinstance(sampler, (RandomSampler, StatefulRandomSampler)) and sampler.data_source is loader.dataset \
        and getattr(sampler, "_num_samples", None) is None


class _UndoneOnRefusal:
    """The first iterator after a loaded state moved this process's reader to the state's dataset version (the
    readers check their states as it starts): a ValueError before its first batch (a refused state) moves the reader
    back first (``undo``, what ``follow_state`` returned), so a caller that starts fresh reads the version it built.
    Once a batch came the state was taken: a later ValueError (a batch the loop skips) changes no version."""

    def __init__(self, iterator, undo) -> None:
        self._iterator, self._undo = iterator, undo

    def __iter__(self):
        return self

    def __next__(self):
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._undo = None
            raise
        except ValueError:
            undo, self._undo = self._undo, None
            if undo is not None:
                undo()
            raise
        self._undo = None
        return batch

    def __len__(self) -> int:
        return len(self._iterator)

    def __getattr__(self, name: str):
        return getattr(self._iterator, name)


class StatefulDataLoader(_TorchdataLoader):
    """torchdata's ``StatefulDataLoader``; a loaded state whose epoch the dataset does not continue
    (``set_epoch`` chose another, before or after ``load_state_dict``) starts a new iteration. A loaded state
    taken after its epoch's last batch (the loop ran to its end) ends that epoch: the first pass that
    continues it yields nothing (torchdata would start the epoch again: every sample read twice); the state
    stays for the next pass, which ``set_epoch`` moves to another epoch (a pass after that still in the
    saved epoch starts it again, as a second pass of an uninterrupted loop does)."""

    _ended_once: dict | None = None  # the finished state whose empty pass was given
    _unfollow = None  # puts the reader back on its version where the workers refuse the state just loaded

    def __iter__(self):
        state = self.next_iter_state
        if state is not None and state.get("_iterator_finished") and state is not self._ended_once \
                and continues_saved_epoch(self, state):
            self._ended_once = state  # kept in next_iter_state: set_epoch(e + 1) then starts from it
            return iter(())
        if state is not None and state is self._ended_once and continues_saved_epoch(self, state):
            self.next_iter_state = None  # a second pass in the same epoch: torchdata's fresh iteration
        elif state is not None and state.get("_iterator_finished") and continues_saved_epoch(self, state) is False \
                and not isinstance(self.dataset, IterableDataset) and _position(self) is None:
            # a map-style reader ordering its own epochs (PackedTokenDataset): torchdata starts a finished state's
            # sampler over, so the epoch set_epoch chose runs from its start; its reader states say that epoch
            self.next_iter_state = states_at_epoch(state, self.dataset.chosen_epoch)
        self._ended_once = None
        unfollow, self._unfollow = self._unfollow, None
        try:
            iterator = super().__iter__()  # the workers start here, and load (or refuse) their states
        except ValueError:
            if unfollow is not None:
                unfollow()
            raise
        return _UndoneOnRefusal(iterator, unfollow) if unfollow is not None else iterator

    def load_state_dict(self, state_dict: dict) -> None:
        saved = saved_workers(state_dict)
        if saved is not None and saved != self.num_workers:  # torchdata would fail on a bare assertion, or not
            raise ValueError(f"a loader state taken with num_workers={saved} loaded into a loader with "
                             f"num_workers={self.num_workers}: each worker's position is its own; build the "
                             f"loader with num_workers={saved} to continue")
        self._ended_once = None
        if self._unfollow is not None:  # a state loaded before and not iterated: its reader back first
            unfollow, self._unfollow = self._unfollow, None
            unfollow()
        super().load_state_dict(state_dict)
        follow = getattr(self.dataset, "follow_state", None)
        if not isinstance(self.dataset, IterableDataset) and not _counts_at_iteration(self, state_dict):
            follow = None  # a sampler that counted the reader when it was built would hand out the built version's
            # indices over the state's version: the workers' own checks refuse such a state instead
        if "_snapshot" in state_dict:  # the workers read the state's dataset version: this process counts its
            # samples too, and the workers a later epoch forks from it read it (a reader's state names its version
            # under "dataset", a Mixture's its sources' under "sources")
            saved = [worker.get("dataset_state") for worker in state_dict["_snapshot"]["_worker_snapshots"].values()]
        else:  # no workers: a map-style reader is moved before its own state loads, under a sampler that counts it
            saved = [state_dict.get("dataset_state")] if not isinstance(self.dataset, IterableDataset) else []
        for reader_state in saved if follow is not None else ():
            if isinstance(reader_state, dict) and ("dataset" in reader_state or "sources" in reader_state):
                self._unfollow = follow(reader_state)
                break

    def state_dict(self) -> dict:
        if self._ended_once is not None and self.next_iter_state is self._ended_once:
            return copy.deepcopy(self._ended_once)  # still the end of the saved epoch
        return super().state_dict()

    def _get_iterator(self):
        epochs = saved_epochs(self.next_iter_state) if self.next_iter_state else set()
        if len(epochs) > 1 and hasattr(self.dataset, "chosen_epoch") and self.dataset.chosen_epoch is None:
            # persistent workers: a worker that had not started the newest epoch saved the one before
            self.dataset.set_epoch(max(epochs))
        if (self.next_iter_state and "_snapshot" in self.next_iter_state
                and starts_another_epoch(self.dataset, self.next_iter_state)):
            self.next_iter_state = fresh_iteration_state(self.next_iter_state)
        return super()._get_iterator()
