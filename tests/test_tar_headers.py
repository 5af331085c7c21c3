"""A foreign shard's members listed without ``tarfile`` (``repack.sources.tar_headers.PlainMembers``) are
``tarfile``'s members, or the shard is left to ``tarfile`` (``NotPlain``)."""

from __future__ import annotations

import io
import tarfile

import pytest

from repack.sources.tar_headers import NotPlain, PlainMembers


def _tar(fmt: int, members: list[tuple[str, bytes, bytes]]) -> bytes:
    """A tar of ``members`` (name, data, type) in ``fmt``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            info.type, info.size, info.mtime, info.mode = kind, len(data) if kind == tarfile.REGTYPE else 0, 1_700_000_000, 0o644
            if kind == tarfile.SYMTYPE:
                info.linkname = "a.jpg"
            tf.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return out.getvalue()


def _tarfile_listing(raw: bytes):
    """What ``tarfile`` lists of ``raw``: each member's (name, data offset, size, folder) and where it stopped;
    or the exception that refused it."""
    try:
        tar = tarfile.open(fileobj=io.BytesIO(raw), mode="r:")
        return [(m.name, m.offset_data, m.size, m.isdir()) for m in tar], tar.offset
    except tarfile.TarError as exc:
        return type(exc)


def _plain_listing(raw: bytes):
    members = PlainMembers(io.BytesIO(raw), len(raw), 1000)
    try:
        return [(m.name, m.offset_data, m.size, m.isdir()) for m in members], members.end
    except NotPlain:
        return None


LONG = "d" * 90 + "/" + "e" * 60 + "/x.jpg"  # ustar: a prefix field; GNU: a long-name member; pax: a pax header
FILES = [("dir", b"", tarfile.DIRTYPE), ("dir/a.jpg", b"\xff\xd8" * 300, tarfile.REGTYPE),
         ("dir/a.cls", b"3", tarfile.REGTYPE), ("dir/b.jpg", b"x" * 512, tarfile.REGTYPE),
         ("dir/c.json", b"", tarfile.REGTYPE), (LONG, b"y" * 700, tarfile.REGTYPE)]


def _damaged(raw: bytes, at: int, patch: bytes) -> bytes:
    return raw[:at] + patch + raw[at + len(patch):]


def test_plain_members_are_tarfiles_members_or_left_to_tarfile():
    ustar = _tar(tarfile.USTAR_FORMAT, FILES)
    second = 512 + 0  # the second header (the folder has no data)
    cases = {
        "ustar, a prefix name": (ustar, True),
        "GNU, no long name": (_tar(tarfile.GNU_FORMAT, FILES[:-1]), True),
        "v7 folder (a regular type, a trailing slash)": (_damaged(ustar, 156, b"\0"), None),
        "GNU long name": (_tar(tarfile.GNU_FORMAT, FILES), False),
        "pax header": (_tar(tarfile.PAX_FORMAT, FILES), False),
        "symlink member": (_tar(tarfile.USTAR_FORMAT, FILES[:2] + [("dir/l.jpg", b"", tarfile.SYMTYPE)]), False),
        "bad checksum in the second header": (_damaged(ustar, second + 148, b"0000001\0"), False),
        "a mode field that is not octal": (_damaged(ustar, second + 100, b"00006x4\0"), False),
        "a mode field with spaces": (_damaged(ustar, second + 100, b"   644 \0"), None),
        "base-256 size": (_damaged(ustar, second + 124, b"\x80" + bytes(11)), False),
        "cut inside the second member's data": (ustar[:second + 512 + 100], False),
        "cut at a member boundary (no end marker)": (ustar[:second + 512 + 1024], True),
        "cut inside a header": (ustar[:second + 200], False),
        "cut inside the last member's padding": (ustar[:5120 + 700], False),  # tarfile: "unexpected end of data"
        "empty file": (b"", False),
        "only zeros": (bytes(10240), False),
        "data after the end marker": (ustar + b"junk", True),
    }
    for what, (raw, plain) in cases.items():
        if what == "v7 folder (a regular type, a trailing slash)":  # the folder's header as old writers wrote it
            head = bytearray(raw[:512])
            head[:100] = b"dir/".ljust(100, b"\0")
            head[156:157] = b"\0"
            head[148:156] = b" " * 8
            head[148:156] = b"%06o\0 " % sum(head)
            raw = bytes(head) + raw[512:]
        if what == "a mode field with spaces":  # checksum mended: only the field's spelling differs
            head = bytearray(raw[second:second + 512])
            head[148:156] = b" " * 8
            head[148:156] = b"%06o\0 " % sum(head)
            raw = raw[:second] + bytes(head) + raw[second + 512:]
        listed, reference = _plain_listing(raw), _tarfile_listing(raw)
        if plain is False:
            assert listed is None, what
        else:
            assert listed == reference, what
            if plain:
                assert listed[0] and not isinstance(reference, type), what
    with pytest.raises(NotPlain):  # more members than the limit: tarfile's path quarantines the rest
        list(PlainMembers(io.BytesIO(ustar), len(ustar), 3))
