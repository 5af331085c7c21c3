"""Tar shards written by other tools (webdataset's ShardWriter, img2dataset, ...) as image inputs.

Members are grouped into samples by the WebDataset rule: the key is the member name up to the
first dot of its last component, the extension is the rest (``000/00042.seg.png``: key
``000/00042``, extension ``seg.png``). Member names are data, never paths: nothing is extracted,
a name with ``..`` or a leading ``/`` is just a string in the sample's metadata. Only regular
members are read (a symlink, hard link or device member is quarantined); no member is ever
unpickled (``.pyd``/``.pickle`` members are not carried, like captions and per-sample JSON).

Per sample: the image member is the one named by ``--image-field EXT``, else the one whose
extension is an image type (a sample with two is quarantined: name one); the label member is the
one named by ``--label-field EXT``, else ``cls``/``label``/``class`` when present. A label's text
is the class name; when every label is a decimal integer its value is the class index (so the
indices of the original dataset are kept). Compressed shards (``.tar.gz``) are quarantined:
their members cannot be read at an offset.

The inputs are a ``MemberTable`` (``repack.sources.member_table``: columns, no object per sample): per input
the shard (its path and fingerprint), the image member's data offset and size (a task reads exactly those
bytes), rel ``<shard rel>/<member name>`` and the metadata ``source_file`` (shard rel) and ``source_key``
(sample key). A plain shard's headers are read by ``repack.sources.tar_headers`` (``tarfile``'s answer,
~10x faster), any other by ``tarfile``.
"""

from __future__ import annotations

import dataclasses
import tarfile
from dataclasses import dataclass

import numpy as np

from repack.errors import UsageError
from repack.store import is_remote
from repack.sources.base import FieldChoice, Scan, again_name, quarantine_record
from repack.sources.confine import Confinement
from repack.sources.containers import Container, list_containers, open_container
from repack.sources.class_index import bound_table_labels, numeric_class_index, sorted_labels
from repack.sources.columns import NO_LABEL
from repack.sources.member_kinds import IMAGE_EXTS, LABEL_EXTS
from repack.sources.member_table import MemberRows
from repack.sources.scan_pool import scan_pool
from repack.sources.tar_headers import NotPlain, PlainMembers
from repack.sources.walk import is_junk

MAX_LABEL_BYTES = 1024
MAX_HEADER_BYTES = 1 << 20   # a pax or GNU long-name header; a larger one ends the shard's listing
MAX_MEMBERS = 1_000_000      # members listed per shard (tarfile keeps each one's TarInfo while listing)
COMPRESSED = {suffix: f"compressed tar shard ({suffix}): members cannot be read at an offset; decompress it"
              for suffix in (".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2", ".tbz", ".tar.zst", ".tzst",
                             ".tar.lz4", ".tar.lzma", ".tar.br")}  # (webdataset reads some: never skipped unnamed)


def split_name(name: str) -> tuple[str, str]:
    """(key, extension) of a member name by the WebDataset rule (extension lower-cased)."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{folder}/{stem}" if folder else stem
    return key, ext.lower() if dot else ""


@dataclass
class _Sample:
    key: str
    members: dict  # extension -> TarInfo (first of each)
    order: int


class HeaderTooLarge(OSError):
    """A tar header (pax or GNU long name) bigger than MAX_HEADER_BYTES: the shard is not read further."""


class _BoundedReads:
    """A shard's file for ``tarfile``: a read over MAX_HEADER_BYTES raises HeaderTooLarge (tarfile reads
    only headers here, and a pax header's own size is the shard's to choose: a bomb)."""

    def __init__(self, fh) -> None:
        self.fh = fh

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > MAX_HEADER_BYTES:
            raise HeaderTooLarge(f"a tar header of {size} bytes (over {MAX_HEADER_BYTES})")
        return self.fh.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.fh.seek(offset, whence)

    def tell(self) -> int:
        return self.fh.tell()


def _member_refusal(info: tarfile.TarInfo, shard_bytes: int | None) -> tuple[str | None, bool]:
    """(why a member is not read, whether the shard's next members cannot be found either), or (None, False)."""
    if info.size < 0 or (shard_bytes is not None and info.offset_data + info.size > shard_bytes):
        return (f"tar member declares a size of {info.size} bytes at byte {info.offset_data}, outside the shard's "
                f"{shard_bytes} bytes: the shard is not read further"), True
    if info.issparse():
        return "sparse tar member (its bytes are not stored as they read): not read", False
    if not info.isreg():
        return "tar member is not a regular file (link or device): not read", False
    if "\0" in info.name:
        return "tar member name holds a NUL byte (no input path can): not read", False
    return None, False


def _shard_task(container: Container, fields: FieldChoice) -> bytes:
    """A pool task: ``_read_shard`` of one shard, its rows, quarantine records and counts packed
    (``MemberRows.pack``)."""
    rows, quarantine, counts = MemberRows(), [], {}
    _read_shard(container, fields, rows, quarantine, counts)
    return rows.pack(quarantine, counts)


def _read_shard(container: Container, fields: FieldChoice, rows: MemberRows, quarantine: list[dict],
                counts: dict[str, int]) -> None:
    """Add one shard's samples to ``rows`` (in tar order), quarantining what is not read: members that are not
    regular files; a member whose size points outside the shard, a header over the cap or more than MAX_MEMBERS
    members end the shard's listing (quarantined by name); ``tarfile``'s errors quarantine the shard. A plain
    tar is listed by ``tar_headers.PlainMembers`` (``tarfile``'s answer), any other by ``tarfile``."""
    fh = open_container(container)
    shard_bytes = container.fingerprint[0] if container.fingerprint else None
    try:
        if shard_bytes is not None:
            before = (rows.mark(), len(quarantine), dict(counts))
            try:
                return _list_samples(container, fh, PlainMembers(fh, shard_bytes, MAX_MEMBERS), fields, rows,
                                     quarantine, counts)
            except NotPlain:  # listed again by tarfile, from the start: what the members before made is undone
                rows.undo(before[0])
                del quarantine[before[1]:]
                counts.clear()
                counts.update(before[2])
                fh.seek(0)
        try:
            tar = tarfile.open(fileobj=_BoundedReads(fh), mode="r:")
        except (tarfile.TarError, OSError, ValueError, OverflowError) as exc:
            quarantine.append(quarantine_record(container.rel, f"not a readable tar shard: {exc}"))
            return None
        return _list_samples(container, fh, tar, fields, rows, quarantine, counts)
    finally:
        fh.close()


def _list_samples(container: Container, fh, members, fields: FieldChoice, rows: MemberRows,
                  quarantine: list[dict], counts: dict[str, int]) -> None:
    """``_read_shard`` of the shard open as ``fh``, its members listed by ``members`` (a ``PlainMembers``, or a
    ``tarfile.TarFile``). A sample (a run of members of one key) is taken when its run ends; the members'
    quarantine records come first, then the samples' (as when every sample was taken after the listing)."""
    shard_bytes = container.fingerprint[0] if container.fingerprint else None
    seen: set[str] = set()  # the keys of the samples listed so far
    sample: _Sample | None = None
    later: list[dict] = []  # the samples' quarantine records
    seen_again: dict[str, int] = {}
    listed = 0
    ended = False  # the listing ran to where tarfile stopped by itself (not a refusal's break)
    try:
        for info in members:  # each refusal that ends the listing breaks before tarfile seeks past this member
            listed += 1
            if listed > MAX_MEMBERS:
                quarantine.append(quarantine_record(container.rel, f"tar shard holds more than {MAX_MEMBERS} "
                                                                   "members: the rest are not read"))
                break
            if info.isdir():
                continue
            refusal, stop = _member_refusal(info, shard_bytes)
            shown = f"{container.rel}/{info.name}".replace("\0", "\\x00")  # a NUL named as text
            if stop:
                quarantine.append(quarantine_record(shown, refusal))
                break
            base = info.name.rpartition("/")[2]
            if is_junk(base) or base.startswith("__"):
                counts["(hidden)"] = counts.get("(hidden)", 0) + 1
                continue
            if refusal is not None:
                quarantine.append(quarantine_record(shown, refusal))
                continue
            key, ext = split_name(info.name)
            if sample is None or key != sample.key:
                if key in seen:  # WebDataset's rule: a sample is a run of members of one key; a key again after
                    # another is another sample (its members never join the first: a label of the later image given
                    # to the earlier one)
                    quarantine.append(quarantine_record(again_name(f"{container.rel}/{info.name}", seen_again),
                                                        f"sample {key!r} again after other samples (WebDataset reads "
                                                        "it as another sample of the same key): not read"))
                    continue
                if sample is not None:
                    _take_sample(container, fh, sample, fields, rows, later, counts)
                sample = _Sample(key, {}, len(seen))
                seen.add(key)
            if ext in sample.members:
                quarantine.append(quarantine_record(again_name(f"{container.rel}/{info.name}", seen_again),
                                                    f"second {ext!r} member of sample {key!r}: not read"))
                continue
            sample.members[ext] = info
        else:
            ended = True
        end = members.end if isinstance(members, PlainMembers) else members.offset
        cut = _unclean_end(fh, end, shard_bytes) if ended and shard_bytes is not None else None
        if cut is not None:
            quarantine.append(quarantine_record(container.rel, f"tar shard {cut} (byte {end} of {shard_bytes}): "
                                                               f"{len(seen)} sample(s) listed before it"))
    except (tarfile.TarError, OSError, ValueError, OverflowError) as exc:
        quarantine.append(quarantine_record(container.rel, f"tar shard damaged after {len(seen)} sample(s): {exc}"))
    if sample is not None:
        _take_sample(container, fh, sample, fields, rows, later, counts)
    quarantine += later


def _take_sample(container: Container, fh, sample: _Sample, fields: FieldChoice, rows: MemberRows,
                 quarantine: list[dict], counts: dict[str, int]) -> None:
    """Add ``sample`` to ``rows`` (its image member and label), or quarantine it with the reason."""
    ext, reason = _pick_image(sample, fields)
    if ext is None:
        quarantine.append(quarantine_record(f"{container.rel}/{sample.key}", reason))
        return
    image = sample.members[ext]
    label_ext = _pick_label(sample, fields)
    label = None
    if label_ext is not None:
        label, reason = _read_label(fh, sample.members[label_ext])
        if reason is not None:
            quarantine.append(quarantine_record(f"{container.rel}/{image.name}", reason))
            return
    for other in sample.members:
        if other not in (ext, label_ext):
            counts[other] = counts.get(other, 0) + 1
    rows.add(container, f"{container.rel}/{image.name}", sample.key, label, image.offset_data, image.size)


def _unclean_end(fh, offset: int, shard_bytes: int) -> str | None:
    """Why a shard's listing, which ``tarfile`` ended by itself at ``offset``, stopped before the shard's end,
    or None at a clean end: zeros from there to the end (the end-of-archive blocks and the record's padding).
    ``tarfile`` ends a listing silently at a damaged header, a cut one, or a missing end marker (a cut at a
    member boundary) anywhere after the first member, and at the end marker of the first of two tars joined."""
    if offset >= shard_bytes:
        return "ends without the end-of-archive marker (cut short?)"
    fh.seek(offset)
    first = fh.read(512)
    if len(first) < 512:
        return "is cut inside a header"
    if first.strip(b"\0"):
        return "holds a damaged header"
    while True:
        block = fh.read(1 << 20)
        if not block:
            return None
        if block.strip(b"\0"):
            return "holds data after its end-of-archive marker (two tars joined?)"


def _pick_image(sample: _Sample, fields: FieldChoice) -> tuple[str | None, str | None]:
    """(extension, None) of the image member, or (None, reason)."""
    if fields.image is not None:
        if fields.image in sample.members:
            return fields.image, None
        return None, f"no {fields.image!r} member (has: {', '.join(sorted(sample.members)) or 'none'})"
    found = [ext for ext in sample.members if ext.rpartition(".")[2] in IMAGE_EXTS]
    if len(found) == 1:
        return found[0], None
    if not found:
        return None, f"no image member (has: {', '.join(sorted(sample.members)) or 'none'})"
    return None, f"several image members ({', '.join(sorted(found))}): name one with --image-field"


def _pick_label(sample: _Sample, fields: FieldChoice) -> str | None:
    if fields.label is not None:
        return fields.label if fields.label in sample.members else None
    return next((ext for ext in LABEL_EXTS if ext in sample.members), None)


def _read_label(fh, info) -> tuple[str | None, str | None]:
    """(class name, None) from a label member's text (a regular member: its bytes lie at its data offset), or
    (None, reason)."""
    if info.size > MAX_LABEL_BYTES:
        return None, f"label member {info.name!r} is {info.size} bytes (over {MAX_LABEL_BYTES}): not a label"
    fh.seek(info.offset_data)
    raw = fh.read(info.size)
    if len(raw) != info.size:
        return None, f"label member {info.name!r} is cut short ({len(raw)} of {info.size} bytes)"
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte order mark is no part of the name
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"label member {info.name!r} is not UTF-8 text"
    return (text, None) if text else (None, f"label member {info.name!r} is empty")


def scan_tar_shards(source: str, fields: FieldChoice, confinement: Confinement | None = None, workers: int = 1
                    ) -> Scan:
    """Samples of every ``.tar`` under ``source`` (shards in byte order, samples in tar order); see module doc.
    ``workers``: processes that read local shards, a shard a task (``repack.sources.scan_pool``)."""
    conf = confinement or Confinement()
    # member extensions are compared lower-cased (``split_name``): so are the fields naming them (--image-field JPG)
    fields = dataclasses.replace(fields, image=fields.image.lower() if fields.image else fields.image,
                                 label=fields.label.lower() if fields.label else fields.label)
    listing = list_containers(source, (".tar",), COMPRESSED, conf.without_size_cap())  # the cap is per member
    quarantine = list(listing.quarantine)
    counts: dict[str, int] = {}
    rows = MemberRows()  # the samples taken, as columns, a shard at a time
    pool = scan_pool(workers, len(listing.containers), 2, __name__) if not is_remote(source) else None
    if pool is None:
        for container in listing.containers:
            _read_shard(container, fields, rows, quarantine, counts)
    else:
        with pool:
            read = pool.map(_shard_task, listing.containers, [fields] * len(listing.containers))
            for container, raw in zip(listing.containers, read):
                records, found = rows.absorb(raw, container)
                quarantine += records
                for what, count in found.items():
                    counts[what] = counts.get(what, 0) + count
    labeled = fields.label is not None or bool(rows.labels)
    table = rows.table()
    del rows
    unlabeled = (table.label_ids == NO_LABEL) if labeled else np.zeros(len(table), dtype=bool)
    too_big = table.sizes > conf.max_file_bytes if conf.max_file_bytes is not None else np.zeros(len(table), bool)
    refused = unlabeled | too_big
    for row in np.flatnonzero(refused).tolist():
        if unlabeled[row]:
            quarantine.append(quarantine_record(table.rel(row), f"no label member"
                                                f"{f' {fields.label!r}' if fields.label else ''} in a labeled dataset"))
        else:
            quarantine.append(quarantine_record(table.rel(row), conf.size_refusal(int(table.sizes[row])),
                                                table.label(row)))
    if refused.any():
        table = table.take(np.flatnonzero(~refused))
    table, over = bound_table_labels(table)
    quarantine += over
    if not len(table) and not quarantine:
        raise UsageError(f"source {source!r}: its tar shards hold no samples")
    table = sorted_labels(table)
    return Scan(table, tuple(quarantine), labeled, listing.skipped,
                class_index=numeric_class_index(table.label_set()), not_carried=tuple(sorted(counts.items())))
