"""The manifest as a wids shard index (``wids.ShardListDataset``'s JSON descriptor).

wids (the indexed reader of the webdataset project) needs each shard's URL and sample count, and
takes its size too: the manifest records both (``samples``, ``bytes``). Written as
``OUT/shardindex.json`` (the name wids' own ``widsindex create`` uses), the shard URLs are relative
to it, as wids resolves them against the descriptor's folder; ``repack verify`` knows the file and
checks it against the manifest.
"""

from __future__ import annotations

from repack.manifest.schema import Manifest, ManifestError

WIDS_INDEX_NAME = "shardindex.json"


def wids_shard_index(manifest: Manifest) -> dict:
    """``{"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": [{url, nsamples, filesize}]}``
    for a WebDataset manifest (ManifestError for another format)."""
    if manifest.format != "webdataset":
        raise ManifestError(f"{manifest.where}: format {manifest.format!r}; wids reads webdataset tars only")
    return {"__kind__": "wids-shard-index-v1", "wids_version": 1,
            "shardlist": [{"url": s["path"], "nsamples": s["samples"], "filesize": s["bytes"]}
                          for s in manifest.data["shards"]]}
