"""In-memory datasets given to the Python API, read lazily where they were given.

`Engine.train(dataset=...)` accepts objects that a topology (plain data, written to YAML
and into checkpoints) cannot hold: a torch `Dataset` / `IterableDataset` or a Hugging
Face `datasets.Dataset` / `IterableDataset` (streaming). The data source runs in the
process that called the API (the coordinator runs on the Engine's thread), so the object
is neither copied, pickled nor written out: `register(obj)` files it in this module's
table and returns a handle, "memory:<n>", which the topology carries as
`data.options.source`; the prompts source resolves it with `lookup`.

    MapRecords      len() and [i]: a torch Dataset with __len__, an HF Dataset. Row i is
                    read when a step needs it, in the order of `epoch_order`.
    StreamRecords   iter(): a torch IterableDataset, an HF IterableDataset. Records are
                    read in stream order, never ahead of the step that needs them; at the
                    end of the stream the next epoch starts it again (HF: `set_epoch`).

Resume. The run's data position is its step number, so prompt k of the run must be
found from k alone:
  - map-style: prompt k is row epoch_order(n, seed, k // n)[k % n]: nothing is read
    before it, whatever k is;
  - iterable: prompt k is record k of the stream. In the same process the cursor is
    already there (a second `train` call reads on). Behind the cursor, or in a fresh
    process, the stream restarts from the nearest known state and reads and drops the
    records up to k: a torch IterableDataset from its start (the cost of resuming at
    prompt k is k records read), an HF IterableDataset from its own `state_dict()`,
    snapshotted at every step boundary (kept here and, by the Engine, in each
    checkpoint as data-stream.json): no record is read again. Exception: HF restores a
    shuffle buffer (`.shuffle(buffer_size=...)`) empty, which would change the order,
    so a buffer-shuffled stream is resumed by counting (exact: its order is fixed by
    its seed and epoch).

Invariants: records are Mappings (a bare string is taken as {"prompt": s}); values with
`.tolist()` (tensors, NumPy) become plain lists/numbers so metadata stays JSON; a handle
names the same object, and the same cursor, for the life of the process (the table
holds the object: give the API the same object again, not a copy, to continue a stream).
"""

from __future__ import annotations

import copy
import itertools
import sys
import threading
from collections.abc import Mapping
from typing import Any

from hybridflow.data.sources import Record
from hybridflow.errors import ConfigError

PREFIX = "memory:"
_TABLE: dict[str, MapRecords | StreamRecords] = {}
_BY_ID: dict[int, str] = {}
_COUNTER = itertools.count()
_LOCK = threading.Lock()


def is_handle(source: str) -> bool:
    return source.startswith(PREFIX)


def kind_of(obj: Any, path: str = "dataset") -> str | None:
    """ "map", "stream" or "hf-stream" for a dataset object this module reads, else None."""
    hf = sys.modules.get("datasets")  # an HF object exists only if its module is imported
    if hf is not None:
        for name in ("DatasetDict", "IterableDatasetDict"):
            cls = getattr(hf, name, None)
            if isinstance(cls, type) and isinstance(obj, cls):
                splits = _names(obj)
                raise ConfigError(
                    path, f"a {name} holds several splits ({splits}); pass one: ds['train']"
                )
        cls = getattr(hf, "IterableDataset", None)
        if isinstance(cls, type) and isinstance(obj, cls):
            return "hf-stream"
        cls = getattr(hf, "Dataset", None)
        if isinstance(cls, type) and isinstance(obj, cls):
            return "map"
    from torch.utils.data import Dataset, IterableDataset

    if isinstance(obj, IterableDataset):
        return "stream"
    if isinstance(obj, Dataset):
        if not hasattr(obj, "__len__"):
            raise ConfigError(
                path,
                f"{type(obj).__name__} is a map-style torch Dataset without __len__; define "
                "__len__ or make it an IterableDataset",
            )
        return "map"
    return None


def register(obj: Any, path: str = "dataset") -> str:
    """The handle of `obj` (the same one each time the same object is given)."""
    kind = kind_of(obj, path)
    if kind is None:
        raise ConfigError(path, f"{type(obj).__name__} is not a dataset this API reads")
    with _LOCK:
        handle = _BY_ID.get(id(obj))
        if handle is None:
            handle = f"{PREFIX}{next(_COUNTER)}"
            name = f"{path} ({type(obj).__name__})"
            records = MapRecords(obj, name) if kind == "map" else StreamRecords(obj, name, kind)
            _TABLE[handle], _BY_ID[id(obj)] = records, handle
        return handle


def lookup(handle: str, path: str) -> MapRecords | StreamRecords:
    records = _TABLE.get(handle)
    if records is None:
        raise ConfigError(
            path,
            f"no in-memory dataset {handle!r} in this process: torch / Hugging Face dataset "
            "objects are read only in the process they were given to (the Python API); "
            "for `hybridflow run`, write the records to a .jsonl or .parquet file",
        )
    return records


def as_record(x: Any, k: int, where: str) -> Record:
    if isinstance(x, str):
        return {"prompt": x}
    if not isinstance(x, Mapping):
        raise ConfigError(
            f"{where} record {k}",
            f"must be a dict (a prompt record) or a prompt string, got {type(x).__name__}",
        )
    return {str(key): _plain(v) for key, v in x.items()}


def _plain(v: Any) -> Any:
    if hasattr(v, "tolist") and not isinstance(v, str | bytes):
        return v.tolist()  # a tensor / NumPy value: JSON has no such type
    return v


class MapRecords:
    """A map-style dataset: row i on demand."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name
        self.n = len(obj)
        if self.n < 1:
            raise ConfigError(name, "the dataset is empty")

    def __len__(self) -> int:
        return self.n

    def record(self, i: int) -> Record:
        return as_record(self.obj[i], i, self.name)


class StreamRecords:
    """An iterable dataset read in order; `position` = records of the run consumed so far.

    `snapshots`: record k -> {"epoch", "state"} (HF streams only): the dataset's own
    state just before record k, at step boundaries; the last `KEEP` are kept."""

    KEEP = 64

    def __init__(self, obj: Any, name: str, kind: str) -> None:
        self.obj, self.name, self.hf = obj, name, kind == "hf-stream"
        self.position = 0  # run record number of the next record the iterator yields
        self.epoch = 0
        self.reads = 0  # records pulled from the stream, skipped ones included
        self.snapshots: dict[int, dict[str, Any]] = {}
        self._it: Any = None
        self._in_epoch = 0  # records yielded by the current epoch's iterator
        self._lock = threading.Lock()  # one reader at a time (jobs may overlap at a stop)
        self._initial = copy.deepcopy(obj.state_dict()) if self.hf else None
        self.exact_state = self.hf and not _buffer_shuffled(obj)  # snapshots usable?
        self._loaded = False  # has a state been loaded into the object?

    def read(self, first: int, count: int) -> list[Record]:
        """Records first .. first+count-1 of the run."""
        with self._lock:
            if self._it is None or first != self.position:
                self._seek(first)
            out = [self._next() for _ in range(count)]
            if self.exact_state:
                self._snapshot()
            return out

    def state_at(self, k: int) -> dict[str, Any] | None:
        """The HF state before record k, if it was snapshotted (else None)."""
        with self._lock:
            return copy.deepcopy(self.snapshots.get(k))

    def restore(self, k: int, snapshot: dict[str, Any]) -> None:
        """Know the HF state before record k (from a checkpoint): a seek to k or past it
        starts there instead of at record 0."""
        if not self.exact_state:
            return
        with self._lock:
            self.snapshots.setdefault(k, copy.deepcopy(snapshot))

    # -- internals -----------------------------------------------------------------------
    def _seek(self, k: int) -> None:
        base = max((s for s in self.snapshots if s <= k), default=None)
        ahead_ok = self._it is not None and self.position <= k
        if ahead_ok and (base is None or base <= self.position):
            pass  # read on from the cursor
        elif base is not None:
            snap = self.snapshots[base]
            self._start(int(snap["epoch"]), snap["state"])
            self.position, self._in_epoch = base, max(base, 1)
        else:
            self._start(0, None)
            self.position = 0
        while self.position < k:  # records before k: read and dropped
            self._pull()

    def _start(self, epoch: int, state: dict[str, Any] | None) -> None:
        """A fresh iterator over `epoch`, from `state` (HF) or the epoch's start."""
        self.epoch, self._in_epoch = epoch, 0
        if self.hf:
            self.obj.set_epoch(epoch)  # a shuffled stream reorders per epoch
            # A state loaded earlier is re-applied by the next iter() of its epoch: after
            # one, load the wanted state (or the start) explicitly.
            if state is not None or self._loaded:
                self.obj.load_state_dict(copy.deepcopy(state or self._initial))
                self._loaded = True
        self._it = iter(self.obj)

    def _pull(self) -> Any:
        try:
            x = next(self._it)
        except StopIteration:
            if self._in_epoch == 0:
                raise ConfigError(
                    self.name,
                    f"the stream yielded no record in epoch {self.epoch} (empty, or an "
                    "iterator that cannot be read twice)",
                ) from None
            self._start(self.epoch + 1, None)
            return self._pull()
        self._in_epoch += 1
        self.position += 1
        self.reads += 1
        return x

    def _next(self) -> Record:
        x = self._pull()
        return as_record(x, self.position - 1, self.name)

    def _snapshot(self) -> None:
        self.snapshots[self.position] = {
            "epoch": self.epoch,
            "state": copy.deepcopy(self.obj.state_dict()),
        }
        for old in sorted(self.snapshots)[: -self.KEEP]:
            del self.snapshots[old]


def _names(splits: Any) -> list[str]:
    return sorted(map(str, splits))


def _buffer_shuffled(obj: Any) -> bool:
    """Does an HF IterableDataset shuffle through a buffer (whose content its state_dict
    leaves out)? Walks its chain of example iterables (private attributes, read
    defensively: an unknown layout counts as unshuffled)."""
    node = getattr(obj, "_ex_iterable", None)
    for _ in range(64):
        if node is None:
            return False
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        node = getattr(node, "ex_iterable", None)
    return False
