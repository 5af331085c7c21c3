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

Each input is a ``MemberItem``: the shard's path and fingerprint, the image member's data offset
and size (a task reads exactly those bytes), rel ``<shard rel>/<member name>`` and the metadata
``source_file`` (shard rel) and ``source_key`` (sample key).
"""

from __future__ import annotations

import dataclasses
import tarfile
from dataclasses import dataclass

from repack.errors import UsageError
from repack.sources.base import FieldChoice, MemberItem, Scan, again_name, quarantine_record
from repack.sources.confine import Confinement
from repack.sources.containers import Container, list_containers, open_container
from repack.sources.walk import is_junk

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm", "pnm")
LABEL_EXTS = ("cls", "label", "class")
MAX_LABEL_BYTES = 1024
MAX_HEADER_BYTES = 1 << 20   # a pax or GNU long-name header; a larger one ends the shard's listing
MAX_MEMBERS = 1_000_000      # members listed per shard (tarfile keeps each one's TarInfo while listing)
MAX_CLASS_INDEX = 999_999_999  # an integer label kept as the class index: 9 digits (DALI's int32 label sum)
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


def _samples(container: Container, quarantine: list[dict], counts: dict[str, int]):
    """(samples in tar order, open tar) of one shard; members that are not regular files quarantined, a
    member whose size points outside the shard, a header over the cap or more than MAX_MEMBERS
    members end the shard's listing (quarantined by name); ``tarfile``'s errors quarantine the shard."""
    fh = open_container(container)
    shard_bytes = container.fingerprint[0] if container.fingerprint else None
    try:
        tar = tarfile.open(fileobj=_BoundedReads(fh), mode="r:")
    except (tarfile.TarError, OSError, ValueError, OverflowError) as exc:
        fh.close()
        quarantine.append(quarantine_record(container.rel, f"not a readable tar shard: {exc}"))
        return [], None, None
    samples: dict[str, _Sample] = {}
    last_key = None
    seen_again: dict[str, int] = {}
    members = 0
    ended = False  # the listing ran to where tarfile stopped by itself (not a refusal's break)
    try:
        for info in tar:  # each refusal that ends the listing breaks before tarfile seeks past this member
            members += 1
            if members > MAX_MEMBERS:
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
            if key in samples and key != last_key:  # WebDataset's rule: a sample is a run of members of one key; a
                # key again after another is another sample (its members never join the first: a label of the later
                # image given to the earlier one)
                quarantine.append(quarantine_record(again_name(f"{container.rel}/{info.name}", seen_again),
                                                    f"sample {key!r} again after other samples (WebDataset reads it "
                                                    "as another sample of the same key): not read"))
                continue
            last_key = key
            sample = samples.setdefault(key, _Sample(key, {}, len(samples)))
            if ext in sample.members:
                quarantine.append(quarantine_record(again_name(f"{container.rel}/{info.name}", seen_again),
                                                    f"second {ext!r} member of sample {key!r}: not read"))
                continue
            sample.members[ext] = info
        else:
            ended = True
        cut = _unclean_end(fh, tar.offset, shard_bytes) if ended and shard_bytes is not None else None
        if cut is not None:
            quarantine.append(quarantine_record(container.rel, f"tar shard {cut} (byte {tar.offset} of {shard_bytes}): "
                                                               f"{len(samples)} sample(s) listed before it"))
    except (tarfile.TarError, OSError, ValueError, OverflowError) as exc:
        quarantine.append(quarantine_record(container.rel, f"tar shard damaged after {len(samples)} sample(s): {exc}"))
    return list(samples.values()), tar, fh


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


def _read_label(tar: tarfile.TarFile, info: tarfile.TarInfo) -> tuple[str | None, str | None]:
    """(class name, None) from a label member's text, or (None, reason)."""
    if info.size > MAX_LABEL_BYTES:
        return None, f"label member {info.name!r} is {info.size} bytes (over {MAX_LABEL_BYTES}): not a label"
    raw = tar.extractfile(info).read().removeprefix(b"\xef\xbb\xbf")  # a byte order mark is no part of the name
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"label member {info.name!r} is not UTF-8 text"
    return (text, None) if text else (None, f"label member {info.name!r} is empty")


def is_index_label(label: str) -> bool:
    """A label written as a class index: ASCII digits ("0", "17", and zero-padded "017", as repack's own
    ``.cls`` members are; not "+1", "1.0")."""
    return label.isascii() and label.isdigit()


def index_labels(labels: set[str]) -> bool:
    """Whether ``labels`` are the source's class indices: every one an index label, no two of one value
    ("01" beside "1" makes every label a name)."""
    return bool(labels) and all(is_index_label(label) for label in labels) and \
        len({label.lstrip("0") for label in labels}) == len(labels)


def numeric_class_index(labels: set[str]) -> tuple[tuple[str, int], ...]:
    """The source's own indices when ``labels`` are class indices (``index_labels``), else () (sorted
    names). Indices over MAX_CLASS_INDEX are the caller's to quarantine first (``index_refusal``)."""
    if index_labels(labels):
        return tuple(sorted(((label, int(label)) for label in labels), key=lambda kv: kv[1]))
    return ()


def index_refusal(label: str) -> str | None:
    """Why an index label cannot be a class index (over MAX_CLASS_INDEX), else None."""
    digits = label.lstrip("0") or "0"
    if len(digits) > len(str(MAX_CLASS_INDEX)) or int(digits) > MAX_CLASS_INDEX:
        shown = label if len(label) <= 40 else f"{label[:20]}...({len(label)} digits)"
        return f"label {shown} is over the largest class index {MAX_CLASS_INDEX} (the readers' int32 labels)"
    return None


def bound_index_labels(items: list, quarantine: list[dict]) -> list:
    """``items`` whose labels can be the class indices: when every label is an index label, the items
    whose index is over the bound are quarantined (by name); otherwise labels are names: all kept."""
    labels = {item.label for item in items if item.label is not None}
    if not index_labels(labels):
        return items
    kept = []
    for item in items:
        reason = index_refusal(item.label) if item.label is not None else None
        if reason is None:
            kept.append(item)
        else:
            quarantine.append(quarantine_record(item.rel, reason, item.label))
    return kept


def scan_tar_shards(source: str, fields: FieldChoice, confinement: Confinement | None = None) -> Scan:
    """Samples of every ``.tar`` under ``source`` (shards in byte order, samples in tar order); see module doc."""
    conf = confinement or Confinement()
    # member extensions are compared lower-cased (``split_name``): so are the fields naming them (--image-field JPG)
    fields = dataclasses.replace(fields, image=fields.image.lower() if fields.image else fields.image,
                                 label=fields.label.lower() if fields.label else fields.label)
    listing = list_containers(source, (".tar",), COMPRESSED, conf.without_size_cap())  # the cap is per member
    quarantine = list(listing.quarantine)
    counts: dict[str, int] = {}
    picked: list[tuple[Container, _Sample, str, str | None]] = []  # container, sample, image ext, label
    for container in listing.containers:
        samples, tar, fh = _samples(container, quarantine, counts)
        try:
            for sample in samples:
                rel_key = f"{container.rel}/{sample.key}"
                ext, reason = _pick_image(sample, fields)
                if ext is None:
                    quarantine.append(quarantine_record(rel_key, reason))
                    continue
                label_ext = _pick_label(sample, fields)
                label = None
                if label_ext is not None:
                    label, reason = _read_label(tar, sample.members[label_ext])
                    if reason is not None:
                        quarantine.append(quarantine_record(f"{container.rel}/{sample.members[ext].name}", reason))
                        continue
                for other in sample.members:
                    if other not in (ext, label_ext):
                        counts[other] = counts.get(other, 0) + 1
                picked.append((container, sample, ext, label))
        finally:
            if fh is not None:
                fh.close()
    labeled = fields.label is not None or any(label is not None for *_, label in picked)
    items: list[MemberItem] = []
    for container, sample, ext, label in picked:
        info = sample.members[ext]
        rel = f"{container.rel}/{info.name}"
        if labeled and label is None:
            quarantine.append(quarantine_record(rel, f"no label member{f' {fields.label!r}' if fields.label else ''} "
                                                     "in a labeled dataset"))
            continue
        too_big = conf.size_refusal(info.size)
        if too_big is not None:
            quarantine.append(quarantine_record(rel, too_big, label))
            continue
        items.append(MemberItem(container.path, rel, label, info.size, container=container.fingerprint,
                                member=(("offset", info.offset_data), ("size", info.size)),
                                meta=(("source_file", container.rel), ("source_key", sample.key))))
    items = bound_index_labels(items, quarantine)
    if not items and not quarantine:
        raise UsageError(f"source {source!r}: its tar shards hold no samples")
    labels = {item.label for item in items if item.label is not None}
    return Scan(tuple(items), tuple(quarantine), labeled, listing.skipped,
                class_index=numeric_class_index(labels), not_carried=tuple(sorted(counts.items())))
