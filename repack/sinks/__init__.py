"""Output formats as plugins: a registry keyed by the --to value."""

from __future__ import annotations

import importlib

from repack.errors import UsageError

SINKS: dict[str, str] = {
    "webdataset": "repack.sinks.webdataset:WebDatasetSink",
    "lmdb": "repack.sinks.lmdb_sink:LmdbSink",
    "memmap": "repack.sinks.megatron:MemmapSink",
    "videos": "repack.sinks.videos:VideosSink",
}


def get_sink(name: str):
    """The sink class registered under ``name``."""
    if name not in SINKS:
        raise UsageError(f"unknown output format --to {name!r}; choose from {', '.join(sorted(SINKS))}")
    module_name, _, cls_name = SINKS[name].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)
