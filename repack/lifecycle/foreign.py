"""Files other tools add to a repack dataset on purpose, as ``repack verify`` knows them.

megatron-energon (``energon prepare OUT``) writes, and reads from then on:

  .nv-meta/.info.json        {"energon_version", "shard_counts": {tar path: samples}}: checked
                             against the manifest (every shard, its sample count, nothing else)
  <shard>.tar.idx            beside each tar: native uint64 byte offsets of each sample's first
                             header, then the end of the last member: checked against repack's
                             own index (``<shard>.idx``) of that tar
  .nv-meta/split.yaml        which shards energon trains, validates and tests on: checked where PyYAML
                             is installed (energon needs it) and every entry names shards (a name,
                             or energon's brace range ``shard-{000000..000004}.tar``; a glob is not
                             checked): only the manifest's tars, each in one split part at most
                             (``exclude`` filters: tars, or ``<tar>/<sample>``)
  .nv-meta/*.yaml|yml|json|sqlite|uuid|py
                             dataset.yaml, the sample index (sqlite), its uuid, a sample loader:
                             energon's own configuration, not checked (reported as such)

wids (``wids.ShardListDataset``) reads a shard index a user writes from the manifest:

  shardindex.json            ``repack.manifest.wids_shard_index(manifest)``: checked (it must be
                             exactly that, every shard's URL, sample count and size)

Nothing else is accepted: any other unlisted file stays a problem.
"""

from __future__ import annotations

import json
import re
import struct

from repack.manifest import WIDS_INDEX_NAME, ManifestError, wids_shard_index
from repack.sinks.tar_format import BLOCK

ENERGON_META = ".nv-meta/"
ENERGON_INFO = ".nv-meta/.info.json"
ENERGON_SPLIT = ".nv-meta/split.yaml"
ENERGON_NAME = re.compile(r"\.?[A-Za-z0-9_-][A-Za-z0-9_.-]*\.(yaml|yml|json|sqlite|uuid|py)")
ENERGON_INDEX_SUFFIX = ".tar.idx"


def _tars(manifest) -> dict[str, dict]:
    return {s["path"]: s for s in manifest.data["shards"] if s["path"].endswith(".tar")}


def foreign_kind(rel: str, manifest) -> str | None:
    """"energon" for a file ``energon prepare`` writes into this dataset, "wids" for its shard index,
    else None."""
    if rel == WIDS_INDEX_NAME and manifest.format == "webdataset":
        return "wids"
    if rel.startswith(ENERGON_META) and ENERGON_NAME.fullmatch(rel[len(ENERGON_META):]):
        return "energon"
    if rel.endswith(ENERGON_INDEX_SUFFIX) and rel[:-len(".idx")] in _tars(manifest):
        return "energon"
    return None


def check_foreign(files, manifest, rels: list[str]) -> tuple[list[str], list[str]]:
    """(problems, files accepted unchecked) for the foreign files ``rels`` (``foreign_kind`` not None)."""
    problems: list[str] = []
    unchecked: list[str] = []
    tars = _tars(manifest)
    for rel in rels:
        if rel == WIDS_INDEX_NAME:
            with files.local([rel]) as (root, fetch_problems):
                problems += fetch_problems + wids_problems(rel, (root / rel).read_bytes(), manifest)
        elif rel == ENERGON_INFO:
            with files.local([rel]) as (root, fetch_problems):
                problems += fetch_problems + info_problems(rel, (root / rel).read_bytes(), manifest)
        elif rel.endswith(ENERGON_INDEX_SUFFIX):
            shard = tars[rel[:-len(".idx")]]
            if not shard.get("index"):
                unchecked.append(f"{rel} (megatron-energon's tar index; no repack index to check it against)")
                continue
            with files.local([rel, shard["index"]]) as (root, fetch_problems):
                problems += fetch_problems
                problems += tar_index_problems(rel, (root / rel).read_bytes(), (root / shard["index"]).read_text())
        else:
            found = None
            if rel == ENERGON_SPLIT:
                with files.local([rel]) as (root, fetch_problems):
                    found = fetch_problems or split_problems(rel, (root / rel).read_bytes(), manifest)
            if found is None:
                unchecked.append(f"{rel} (megatron-energon's configuration, written by energon prepare)")
            else:
                problems += found
    return problems, unchecked


def split_problems(rel: str, raw: bytes, manifest) -> list[str] | None:
    """energon's split must name only the manifest's tars, each in one split part at most (``exclude``, energon's
    filter, may name tars and ``<tar>/<sample>``); None where it cannot be checked (no PyYAML, or a glob). A
    tar no part lists is energon's choice (``energon prepare --split-parts`` holds shards out)."""
    try:
        import yaml
    except ImportError:
        return None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError:
        return [f"{rel}: not YAML"]
    parts = data.get("split_parts") if isinstance(data, dict) else None
    exclude = data.get("exclude") if isinstance(data, dict) else None
    if not isinstance(parts, dict) or not all(isinstance(v, (list, type(None))) for v in parts.values()) \
            or not isinstance(exclude, (list, type(None))):
        return [f"{rel}: no split_parts mapping of part names to shard lists"]
    listed = [name for names in parts.values() for name in (names or [])]
    excluded = list(exclude or [])
    if not all(isinstance(name, str) for name in listed + excluded):
        return [f"{rel}: an entry is not a shard name"]
    if any(mark in name for name in listed + excluded for mark in "{}"):  # energon's ranges: shard-{000000..000004}.tar
        try:
            from braceexpand import braceexpand  # webdataset's, as energon expands them
        except ImportError:
            return None
        listed = [name for entry in listed for name in braceexpand(entry)]
        excluded = [name for entry in excluded for name in braceexpand(entry)]
    if any(mark in name for name in listed + excluded for mark in "*?["):
        return None
    counts: dict[str, int] = {}
    for name in listed:
        counts[name] = counts.get(name, 0) + 1
    tars = set(_tars(manifest))
    problems = [f"{rel}: lists {name} {count} times (energon would read it {count} times an epoch)"
                for name, count in sorted(counts.items()) if count > 1]
    # an exclude naming a sample (energon: ``<shard>/<key>``, matched against the shard's samples' keys) names its shard
    unknown = sorted((set(counts) | {name.split("/", 1)[0] if ".tar/" in name else name for name in excluded}) - tars)
    if unknown:
        problems.append(f"{rel}: names {len(unknown)} shard(s) the manifest does not hold ({', '.join(unknown[:3])}): "
                        "run `repack gc OUT --keep 1` (energon prepares every tar of the folder, superseded ones "
                        "too), then energon prepare again")
    return problems


def wids_problems(rel: str, raw: bytes, manifest) -> list[str]:
    """A wids shard index must hold what the manifest gives (``wids_shard_index``): its kind, and each shard's
    url, sample count and size, in order; what wids' own ``widsindex create`` adds (a name, each shard's md5sum)
    is its own and not compared."""
    try:
        found = json.loads(raw)
        expected = wids_shard_index(manifest)
        shards = found["shardlist"] if isinstance(found, dict) else None
        found = {**{key: found.get(key) for key in expected if key != "shardlist"},
                 "shardlist": [{key: shard.get(key) for key in ("url", "nsamples", "filesize")}
                               for shard in shards]} if isinstance(shards, list) and \
            all(isinstance(shard, dict) for shard in shards) else None
    except (ValueError, KeyError, ManifestError):
        found, expected = None, {}
    if found != expected:
        return [f"{rel}: not the wids shard index of this manifest (write it with "
                "repack.manifest.wids_shard_index)"]
    return []


def info_problems(rel: str, raw: bytes, manifest) -> list[str]:
    """energon's shard counts must be the manifest's, shard for shard."""
    try:
        counts = json.loads(raw).get("shard_counts")
    except (ValueError, AttributeError):
        counts = None
    if not isinstance(counts, dict):
        return [f"{rel}: not energon's info (a JSON object with shard_counts)"]
    expected = {s["path"]: s["samples"] for s in manifest.data["shards"]}
    if counts != expected:
        wrong = sorted(set(counts.items()) ^ set(expected.items()))[:3]
        return [f"{rel}: energon's shard counts differ from the manifest's (first differences: {wrong})"]
    return []


def tar_index_problems(rel: str, raw: bytes, dali_index: str) -> list[str]:
    """energon's offsets must be the sample starts (and the end) that repack's index gives."""
    expected = []
    end = 0
    for line in dali_index.splitlines()[1:]:
        fields = line.split(" ")
        offsets, sizes = [int(x) for x in fields[1::4]], [int(x) for x in fields[2::4]]
        expected.append(offsets[0] - BLOCK)
        end = offsets[-1] + sizes[-1] + (-sizes[-1] % BLOCK)
    expected.append(end)
    if len(raw) % 8 or list(struct.unpack(f"{len(raw) // 8}Q", raw)) != expected:
        return [f"{rel}: energon's tar index does not give the sample offsets of the tar "
                f"({len(raw) // 8} entries, {len(expected)} expected)"]
    return []


def refresh_views(store, manifest) -> list[str]:
    """Other loaders' files brought up to the published version ``manifest`` (after a publish, and by each command
    that takes the dataset's lock): the wids shard index, where the dataset has one, rewritten when it is another
    version's (it is the manifest's, nothing else); an energon preparation that lists other shard counts named in
    the returned warnings (energon would still read the samples this version removed, and miss the new ones)."""
    warnings = []
    held = store.read_bytes(WIDS_INDEX_NAME) if manifest.format == "webdataset" else None
    if held is not None and wids_problems(WIDS_INDEX_NAME, held, manifest):  # another version's: rewritten
        store.put_bytes(WIDS_INDEX_NAME, json.dumps(wids_shard_index(manifest), indent=1).encode())
    info = store.read_bytes(ENERGON_INFO)
    if info is not None and info_problems(ENERGON_INFO, info, manifest):
        warnings.append(f"{store.url}/{ENERGON_META} (megatron-energon) was prepared for another version: energon "
                        "still reads the shards it listed (samples removed since included, samples added missing); "
                        f"run `repack gc {store.url} --keep 1` (energon prepares every tar of the folder), then "
                        "`energon prepare` again")
    return warnings
