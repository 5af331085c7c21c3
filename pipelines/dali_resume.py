"""Exact mid-epoch resume for the bundled DALI pipelines: a loader whose position is plain data.

``ResumableDALILoader`` wraps one built pipeline in a ``DALIGenericIterator`` (dicts of torch
tensors, as before) and adds ``state_dict()`` / ``load_state_dict()``. The state is a JSON-safe
dict, so it sits in the same training checkpoint as the PyTorch loaders' states::

    {"kind": "dali_webdataset", "version": 1, "dataset": {"version": 2, "digest": "..."},
     "epoch": 3, "batch": 41, "options": {...}, "dali": "<base64 of Pipeline.checkpoint()>"}

``epoch`` and ``batch`` count the epochs and the batches of the current epoch the caller has
*taken* from the loader (prefetched batches do not count). Pipelines with a DALI reader
(webdataset, video) carry DALI's own checkpoint in ``dali``: the reader's position and shuffle
buffer and every random generator, taken by the iterator for the last batch it handed out.
Pipelines fed by an external source (LMDB) carry no ``dali``: ``epoch`` and ``batch`` are the
source's position and the builder rebuilds the source there (its order is a function of the
seed and the epoch). ``options`` are the settings that shape the sample order (batch size,
shard, seed, shuffling): restoring into a loader built with others is an error naming them.
``dataset`` is the identity of the dataset version the state was taken on
(``pipelines.dataset_identity``): a loader of another version re-opens the state's version when it
is still kept and continues exactly there, else it refuses naming both versions.

DALI restores a pipeline only while it is built, so ``load_state_dict`` rebuilds the pipeline
from the state (a fraction of a second); a new process builds its loader with ``state=``.
"""

from __future__ import annotations

import base64
import binascii
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from pipelines.dataset_identity import describe, resolve, same
from pipelines.sample_order import checked_count

STATE_VERSION = 1
LAST_BATCH = ("partial", "drop", "fill")
RESUME = ("dali", "source", "none")

Builder = Callable[["dict | None"], Any]  # state (or None) -> a built DALI pipeline


@dataclass(frozen=True)
class OpenedVersion:
    """One dataset version as a loader reads it: its identity (``dataset_identity.identity``), the
    order-shaping options of its pipeline, the builder of that pipeline and (for an external
    source) its batches per epoch."""

    dataset: dict
    options: dict
    build: Builder
    epoch_batches: int | None = None
    padding: int = 0  # an external source's repeated samples per epoch (equal steps); a reader's: the loader's cut
    # (a pipeline failure, the loader's epoch) -> the error to raise from it (None: re-raise it as it is)
    diagnose: Callable[[BaseException, int], BaseException | None] | None = None


Opener = Callable[["int | None"], OpenedVersion]  # version (None: the loader's own) -> that version opened


def shard_range(count: int, shard_id: int, num_shards: int) -> tuple[int, int]:
    """[start, stop) of the ``count`` samples pipeline ``shard_id`` of ``num_shards`` reads (DALI's readers'
    contiguous share)."""
    return count * shard_id // num_shards, count * (shard_id + 1) // num_shards


def dali_checkpoint(state: dict | None) -> bytes | None:
    """The DALI checkpoint inside a loader ``state`` (None when there is none)."""
    if state is None or state.get("dali") is None:
        return None
    try:
        return base64.b64decode(state["dali"].encode("ascii"), validate=True)
    except (AttributeError, UnicodeEncodeError, binascii.Error) as error:
        raise ValueError(f"{state.get('kind')} state: 'dali' is not a base64 DALI checkpoint ({error})") from None


def restore_bytes(checkpoint: dict | bytes | None, kind: str, options: dict, enabled: bool,
                  dataset: dict | None = None) -> bytes | None:
    """The DALI checkpoint to build a pipeline with: ``checkpoint`` as given (bytes of
    ``Pipeline.checkpoint()``) or out of a loader state (dict) checked against ``options`` and the
    pipeline's ``dataset`` identity."""
    if isinstance(checkpoint, dict):
        checkpoint = dali_checkpoint(check_state(checkpoint, kind, options, dataset))
    if checkpoint is not None and not enabled:
        raise ValueError("restoring a checkpoint needs enable_checkpointing=True")
    return checkpoint


def builder_args(builder: Callable, given: dict) -> dict:
    """Every keyword of ``builder``: ``given`` where given, else its default (a loader's view of
    the options its pipeline is built with); refuses ``checkpoint`` (a loader takes ``state=``)."""
    if "checkpoint" in given:
        raise ValueError("pass a loader state as state=, not checkpoint=")
    return {name: given.get(name, parameter.default)
            for name, parameter in inspect.signature(builder).parameters.items()}


def check_state(state: Any, kind: str, options: dict, dataset: dict | None = None) -> dict:
    """``state`` after checking it is a version-1 ``kind`` state saved with the same ``options``
    (each key of ``options``; a loader's state may record more than its pipeline builder checks)
    and, when ``dataset`` (an identity) is given, taken on that dataset version."""
    if not isinstance(state, dict):
        raise ValueError(f"a {kind} loader state must be a dict, got {type(state).__name__}")
    if state.get("kind") != kind:
        raise ValueError(f"this state is for a {state.get('kind')!r} loader, not {kind!r}")
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"{kind} state version {state.get('version')!r} is not supported (this reader: "
                         f"{STATE_VERSION})")
    for field in ("epoch", "batch"):
        checked_count(state.get(field), f"{kind} state's {field!r}")
    saved = state.get("options")
    if not isinstance(saved, dict):
        raise ValueError(f"{kind} state: 'options' must be a dict, got {type(saved).__name__}")
    differ = sorted(k for k in options if saved.get(k) != options[k])
    if differ:
        changes = ", ".join(f"{k}: saved {saved.get(k)!r}, now {options.get(k)!r}" for k in differ)
        raise ValueError(f"the {kind} state was saved by a loader with other options ({changes}); "
                         "build the loader with the saved options to resume")
    if dataset is not None and not same(state.get("dataset"), dataset):
        raise ValueError(f"this {kind} state was taken on {describe(state.get('dataset'))}, this pipeline "
                         f"reads {describe(dataset)}: build it with the state's version= (a loader "
                         "re-opens that version itself)")
    return state


class ResumableDALILoader:
    """A ``DALIGenericIterator`` over ``build(state)``'s pipeline with ``state_dict``/``load_state_dict``.

    ``kind`` names the pipeline in the state; ``open_version(version)`` opens a dataset version of
    ``root`` (None: the one the loader was asked for) as an ``OpenedVersion``: its identity, the
    order-shaping options checked on restore (``last_batch`` is added), its pipeline builder and,
    for an external source, its batches per epoch (else ``len()`` of the iterator). A state of
    another version makes the loader re-open the state's version (``dataset_identity.resolve``).
    ``resume`` says how the position is kept: ``"dali"`` (the pipeline is built with
    ``enable_checkpointing``; the state carries DALI's checkpoint), ``"source"`` (``build(state)``
    starts the pipeline's source at the state's epoch and batch) or ``"none"`` (built without
    checkpointing: ``state_dict`` and restoring refuse).
    Iterating yields what ``DALIGenericIterator`` yields: a list with one dict of torch tensors
    per batch.

    Equal steps: with ``last_batch="partial"`` over a DALI reader that pads its shard
    (``pad_last_batch=True``, the bundled builders' default) every rank yields as many batches per
    epoch, the largest rank's share in batches, and none is empty: DALI's own PARTIAL policy would
    hand a rank whose share is a whole number of batches a last batch of 0 samples (a NaN loss
    under DDP). The iterator runs with FILL instead and each batch is cut to the rank's real samples
    (its share this epoch: DALI moves every rank to the next shard each epoch), keeping one repeat of
    the rank's last sample where the cut would leave none (``padding``: how many this epoch).
    """

    def __init__(self, kind: str, open_version: Opener, names: list[str], *, root: str,
                 reader_name: str | None, last_batch: str = "partial", auto_reset: bool = True,
                 resume: str = "dali", state: dict | None = None) -> None:
        if resume not in RESUME:
            raise ValueError(f"resume must be one of {list(RESUME)}, not {resume!r}")
        if last_batch not in LAST_BATCH:
            raise ValueError(f"last_batch must be one of {list(LAST_BATCH)}, not {last_batch!r}")
        self.kind, self._open, self.names, self.root = kind, open_version, names, str(root)
        self._reader_name, self._last_batch, self._auto_reset = reader_name, last_batch, auto_reset
        self._resume = resume
        self._version = open_version(None)
        self.epoch = self.batch = 0
        self._start(state)

    @property
    def options(self) -> dict:
        """The order-shaping options of the version read, as a state records them."""
        return {**self._version.options, "last_batch": self._last_batch}

    @property
    def dataset(self) -> dict:
        """The identity of the dataset version read (``dataset_identity.identity``)."""
        return self._version.dataset

    def _start(self, state: dict | None) -> None:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        if state is not None:
            self._refuse_without_checkpointing()
            check_state(state, self.kind, {})
            version = resolve(state.get("dataset"), self.dataset, self.root, self.kind)
            if version is not None:
                self._version = self._open(version)
            state = check_state(state, self.kind, self.options, self.dataset)
            if self._resume == "dali" and state.get("dali") is None:
                raise ValueError(f"the {self.kind} state holds no DALI checkpoint ('dali')")
        self.pipe = self._version.build(state)
        self.epoch, self.batch = (state["epoch"], state["batch"]) if state else (0, 0)
        policy = {"partial": LastBatchPolicy.PARTIAL, "drop": LastBatchPolicy.DROP,
                  "fill": LastBatchPolicy.FILL}[self._last_batch]
        self._share = self._reader_share() if self._last_batch in ("partial", "drop") else None
        self._drop_batches = None
        if self._share is not None:
            policy = LastBatchPolicy.FILL  # cut to the real samples in __next__ (the class docstring)
            if self._last_batch == "drop":  # every rank's full batches of the smallest share; the rest drained
                self._drop_batches = self._share.smallest // self.pipe.max_batch_size
                self._share = None
                if not self._drop_batches:
                    raise ValueError(f"{self.root}: batch_size {self.pipe.max_batch_size} is more than a rank's "
                                     "samples with last_batch='drop': every epoch would be empty")
        try:  # the iterator runs the pipeline's first batches already: their failure, named as __next__'s is
            self._iterator = DALIGenericIterator([self.pipe], self.names, reader_name=self._reader_name,
                                                 last_batch_policy=policy, auto_reset=self._auto_reset)
        except RuntimeError as exc:
            self._raise_named(exc)
        # a state taken after the epoch's last batch restores to the next epoch's start (DALI's
        # checkpoint does so; a source builder must): the caller has yet to see this epoch end,
        # so the first next() ends it (and reset() then has nothing to reset)
        if state and len(self) and state["batch"] > len(self):  # a hand edit: DALI's checkpoint is elsewhere
            raise ValueError(f"the {self.kind} state's batch {state['batch']} is past the epoch's {len(self)} "
                             "batches: the state was edited, or is not this loader's")
        # (with "drop" DALI's checkpoint is at the epoch's end only where no padded batch is left: else __next__
        # drains them)
        self._end_pending = bool(state and 0 < len(self) <= state["batch"]) and \
            (self._drop_batches is None or self._drop_batches == len(self._iterator))
        self._ended_early = False

    def __iter__(self):
        return self

    def _raise_named(self, exc: RuntimeError):
        """DALI's "Critical error in pipeline": what failed, named (the shard and sample) where it can be."""
        named = self._version.diagnose(exc, self.epoch) if self._version.diagnose is not None else None
        if named is None:
            raise exc
        raise named from exc

    def __next__(self):
        try:
            if self._end_pending:
                self._end_pending, self._ended_early = False, True
                raise StopIteration
            if self._drop_batches is not None and self.batch >= self._drop_batches:
                while True:  # the padded batches past every rank's full ones: never handed out, and never the
                    next(self._iterator)  # next epoch's first (DALI's DROP left them there); ends in StopIteration
            batch = next(self._iterator)
        except StopIteration:
            self.epoch, self.batch = self.epoch + 1, 0
            raise
        except RuntimeError as exc:
            self._raise_named(exc)
        self._ended_early = False
        if self._share is not None:
            batch = self._cut(batch)
        self.batch += 1
        return batch

    def _reader_share(self):
        """For the equal-steps cut: epoch -> the rank's real samples that epoch, from the reader's metadata;
        None where DALI's own PARTIAL policy stays (no named reader, or one that does not pad its shard)."""
        if self._reader_name is None:
            return None
        meta = self.pipe.reader_meta(self._reader_name)
        if not meta.get("pad_last_batch"):
            return None
        size, shards, shard = int(meta["epoch_size"]), int(meta["number_of_shards"]), int(meta["shard_id"])
        stick = bool(meta.get("stick_to_shard"))

        def share(epoch: int) -> int:
            start, stop = shard_range(size, shard if stick else (shard + epoch) % shards, shards)
            return stop - start

        share.smallest = min(stop - start for start, stop in (shard_range(size, part, shards)
                                                              for part in range(shards)))  # any rank's, any epoch
        return share

    @property
    def padding(self) -> int:
        """Repeated samples this rank yields in the current epoch (0 or 1; see the class docstring; an external
        source's: its ``OpenedVersion.padding``)."""
        if self._drop_batches is not None:
            return 0
        if self._share is None:
            return self._version.padding
        return int(self._share(self.epoch) <= (len(self) - 1) * self.pipe.max_batch_size)

    def _cut(self, batch: list) -> list:
        """``batch`` (a FILL batch: the rank's real samples, then repeats of its last) cut to its real samples,
        at least one."""
        size = self.pipe.max_batch_size
        keep = max(1, min(size, self._share(self.epoch) - self.batch * size))
        if keep == size:
            return batch
        return [{name: value[:keep] for name, value in outputs.items()} for outputs in batch]

    def __len__(self) -> int:
        """Batches per epoch."""
        if self._drop_batches is not None:
            return self._drop_batches
        batches = self._version.epoch_batches
        return len(self._iterator) if batches is None else batches

    def reset(self) -> None:
        """Start the next epoch (only needed with ``auto_reset=False``)."""
        if not self._ended_early:
            self._iterator.reset()
        self._ended_early = False

    def state_dict(self) -> dict:
        """The loader's position after the last batch taken, as JSON-safe data."""
        state = {"kind": self.kind, "version": STATE_VERSION, "dataset": dict(self.dataset), "epoch": self.epoch,
                 "batch": self.batch, "options": self.options}
        self._refuse_without_checkpointing()
        if self._resume == "dali":
            state["dali"] = base64.b64encode(self._iterator.checkpoints()[0]).decode("ascii")
        return state

    def _refuse_without_checkpointing(self) -> None:
        if self._resume == "none":
            raise ValueError(f"this {self.kind} loader was built with enable_checkpointing=False: it has no state")

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from ``state_dict``): rebuilds the pipeline there, on the state's
        dataset version (re-opened when it is not the one read and still kept)."""
        self._start(state)
