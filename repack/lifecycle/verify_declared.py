"""`repack verify`: what the manifest declares beside its files, that readers and Megatron act on, held against
the manifest's own shard entries and the rules repack writes by: a token dataset's ``prefixes``, ``data_path``,
``dtype`` and ``fields``; an image dataset's ``fields`` roles (which member is the image, the label, the
metadata) and its ``modality``. A hand edit of one of them changes what training reads while every file still
matches its sha256."""

from __future__ import annotations

from repack.sources.member_kinds import IMAGE_EXTS

ROLES = {"cls": "int", "json": "metadata"}  # an image dataset's members other than its image(s)
LMDB_IMAGE = "img"


def check_declared(data: dict) -> list[str]:
    """Problems of the manifest's declarations (see the module docstring)."""
    modality, fmt = data.get("modality"), data.get("format")
    if fmt == "memmap":
        return _tokens(data)
    if modality == "images":
        return _images(data)
    if modality == "video":
        fields = data.get("fields") or {}
        return [] if "video" in fields else [f"fields {sorted(fields)}: a video dataset's name a 'video' member "
                                             "(modality or fields edited?)"]
    if modality == "text":
        return [f"modality 'text' in format {fmt!r}: repack writes text as memmap"]
    return [f"modality {modality!r}: not one repack writes (images, video, text)"]


def _tokens(data: dict) -> list[str]:
    problems = []
    shards = data.get("shards") or []
    dtype = data.get("dtype")
    if data.get("modality") != "text":
        problems.append(f"modality {data.get('modality')!r}: a memmap dataset holds text")
    if data.get("fields") != {"tokens": dtype}:
        problems.append(f"fields {data.get('fields')!r}: a token dataset's are {{'tokens': {dtype!r}}} (its dtype)")
    odd = [s for s in shards if s.get("dtype") != dtype]
    if odd:
        problems.append(f"dtype {dtype!r}: {odd[0].get('path')} holds {odd[0].get('dtype')!r} tokens"
                        + (f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""))
    prefixes = [s.get("prefix") for s in shards]
    if data.get("prefixes") != prefixes:
        problems.append(f"prefixes {_short(data.get('prefixes'))}: the shards' are {_short(prefixes)} (Megatron and "
                        "the readers would read different parts)")
    weights = " ".join(f"{s.get('tokens')} {s.get('prefix')}" for s in shards)
    if data.get("data_path") != weights:
        problems.append(f"data_path {_short(data.get('data_path'))}: the shards' tokens and prefixes give "
                        f"{_short(weights)}")
    return problems


def _images(data: dict) -> list[str]:
    fields = data.get("fields") or {}
    lmdb = data.get("format") == "lmdb"
    problems = []
    for ext, role in sorted(fields.items()):
        wanted = ROLES.get(ext, "image")
        known = ext in ROLES or (ext == LMDB_IMAGE if lmdb else ext in IMAGE_EXTS)
        if not known:
            problems.append(f"fields: {ext!r} is no member an image dataset holds")
        elif role != wanted:
            problems.append(f"fields: {ext!r} is {role!r}, an image dataset's {ext!r} member is {wanted!r}")
    if not any(role == "image" for role in fields.values()):
        problems.append(f"fields {sorted(fields)}: no image member")
    formats = (data.get("stats") or {}).get("formats")
    if not lmdb and isinstance(formats, dict):  # each image type the shards hold is a member the readers take
        missing = sorted(ext for ext, count in formats.items() if count and fields.get(ext) != "image")
        if missing:
            problems.append(f"fields {sorted(fields)}: the shards hold {', '.join(missing)} images "
                            "(stats.formats) that no 'image' field names (the readers would find no image member)")
    if data.get("classes") and "cls" not in fields:
        problems.append("fields name no 'cls' member while the dataset has a class map (its labels would be dropped)")
    return problems


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
