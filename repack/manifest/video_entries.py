"""A video manifest's entries checked against its class map and their own sizes: what the video readers
refuse (``pipelines.torch_video``, DALI's video pipeline) and ``repack verify`` names. A hand edit or a flipped
byte of ``manifest.json`` changes these while every video file still matches its sha256."""

from __future__ import annotations


def video_entries(data: dict) -> list[dict]:
    """The video entries of a video manifest's ``data``: a WebDataset's ``videos``, else its ``shards`` (one
    video each); entries that are no objects with a path are left to the manifest's own checks."""
    videos = data.get("videos") if data.get("format") == "webdataset" else data.get("shards")
    return [v for v in videos or () if isinstance(v, dict) and isinstance(v.get("path"), str)]


def entry_problem(classes: dict, entry: dict) -> str | None:
    """What a reader would read wrong in one video ``entry`` (None: nothing): a frame count that is not a count
    or that no file of its size holds, a class index that is not one of ``classes``' (the class map) or not its
    own label's, no class while its label is one of the map's."""
    frames, size = entry.get("frames"), entry.get("bytes")
    if not isinstance(frames, int) or isinstance(frames, bool) or frames < 0 or \
            (isinstance(size, int) and frames > max(size, 0)):  # a frame takes at least a byte
        return f"frames {frames!r} is not a frame count its {size} bytes can hold"
    cls, label = entry.get("cls"), entry.get("label")
    if cls is None:
        if isinstance(label, str) and label in classes:
            return f"no class, but its label {label!r} is one of the class map's"
        return None
    indices = {index for index in classes.values() if isinstance(index, int)}
    if not isinstance(cls, int) or isinstance(cls, bool) or (indices and cls not in indices):
        return f"class {cls!r} is not an index of the dataset's class map"
    if isinstance(label, str) and label in classes and classes[label] != cls:
        return f"class {cls} is not its label {label!r}'s ({classes[label]})"
    return None
