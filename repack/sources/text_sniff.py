"""Is a byte stream UTF-8 text? The check that keeps binary files and UTF-16 text out of a token
corpus (packed, they become documents of byte-fallback or unknown tokens).

``binary_reason(head)`` judges the first ``SNIFF_BYTES`` of a segment (decompressed); a reason
means the whole segment is quarantined with it:

- a UTF-16 or UTF-32 byte-order mark; or NUL bytes in every other position (UTF-16 without
  one): "UTF-16 text ...", with the iconv command that converts it;
- NUL bytes count with the control characters below (a stray one costs its document, not the file);
- more than ``MAX_NON_TEXT`` (10 %) of the characters undecodable as UTF-8 or C0 control
  characters other than tab, newline, carriage return, form feed and vertical tab: binary
  data. ANSI escape sequences (``ESC [ 1;31 m``, colours in a log) are text: not counted. A UTF-8 file with a few bad lines stays below it (those lines are quarantined one by
  one, as before).

``has_nul(text)`` is the per-document rule: a document holding U+0000 (a JSON ``"\\u0000"``,
a parquet string) is binary data too.
"""

from __future__ import annotations

import codecs
import re

SNIFF_BYTES = 1 << 16
MAX_NON_TEXT = 0.10
_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32LE"), (codecs.BOM_UTF32_BE, "UTF-32BE"),
         (codecs.BOM_UTF16_LE, "UTF-16LE"), (codecs.BOM_UTF16_BE, "UTF-16BE"))
_CONTROLS = frozenset(chr(c) for c in range(32)) - set("\t\n\r\f\v")
_TEXT_BYTES = bytes(b for b in range(256) if chr(b) not in _CONTROLS)  # deleted: what is left is control bytes
_NON_TEXT = re.compile("[" + "".join(sorted(_CONTROLS)) + "\ufffd]")  # what the 10 % rule counts, found in C
# An ANSI escape sequence (ECMA-48): CSI ``ESC [ params intermediates final`` (colours, cursor), or a
# two-byte ``ESC X``; short ones only, so a run of escape bytes in binary data is still counted.
ANSI_SEQUENCE = re.compile(r"\x1b(?:\[[0-?]{0,32}[ -/]{0,4}[@-~]|[@-Z\\-_])")


def _utf16(encoding: str, how: str) -> str:
    return (f"UTF-16 text ({how}), not UTF-8: convert it first, e.g. iconv -f {encoding} -t UTF-8"
            if encoding.startswith("UTF-16") else f"{encoding} text ({how}), not UTF-8: convert it first, e.g. "
                                                  f"iconv -f {encoding} -t UTF-8")


def binary_reason(head: bytes) -> str | None:
    """Why ``head`` (the first bytes of a text segment) is not UTF-8 text, or None if it is."""
    for bom, encoding in _BOMS:
        if head.startswith(bom):
            return _utf16(encoding, f"byte-order mark {bom.hex(' ').upper()}")
    size = len(head)
    nuls = head.count(0)
    if nuls:
        even, odd = head[0::2].count(0), head[1::2].count(0)
        half = max(1, size // 2)
        if max(even, odd) >= 0.3 * half and min(even, odd) <= 0.05 * half:
            return _utf16("UTF-16LE" if odd > even else "UTF-16BE", "no byte-order mark, a NUL byte in every other "
                                                                     "position")
    if head.isascii() and b"\x1b" not in head:  # the common case, counted on the bytes in C
        bad = len(head.translate(None, _TEXT_BYTES))
        return None if bad <= MAX_NON_TEXT * size else (
            f"binary data, not UTF-8 text: {bad} of the first {size} characters are undecodable bytes or "
            f"control characters (over {MAX_NON_TEXT:.0%})")
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head, final=False)
    if "\x1b" in text:
        text = ANSI_SEQUENCE.sub("", text)  # colour and cursor escapes are text (a log line), not binary
    if not text:
        return None
    bad = len(_NON_TEXT.findall(text))
    if bad > MAX_NON_TEXT * len(text):
        return (f"binary data, not UTF-8 text: {bad} of the first {len(text)} characters are undecodable bytes or "
                f"control characters (over {MAX_NON_TEXT:.0%})")
    return None


def plain_text(data: bytes) -> str | None:
    """``data`` (a whole small file, at most ``SNIFF_BYTES``) decoded, when it is UTF-8 text with no NUL and no
    ESC byte that ``binary_reason`` accepts; None otherwise (then ``binary_reason`` and the slow path say
    what it is). The same rule counted on the bytes, without an incremental decoder or a regex: in valid
    UTF-8 a control byte is a control character, and U+FFFD is the bytes EF BF BD."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if len(data) > SNIFF_BYTES or "\x00" in text or "\x1b" in text:
        return None
    bad = len(data.translate(None, _TEXT_BYTES)) + (0 if len(text) == len(data) else data.count(_REPLACEMENT))
    return None if bad > MAX_NON_TEXT * len(text) else text


_REPLACEMENT = "\ufffd".encode()


def has_nul(text: str) -> bool:
    """True if a document holds U+0000 (binary data)."""
    return "\x00" in text


FRAGMENT_CHARS = 16  # a document this short holding a C0 control character (not ESC) is a fragment of binary data
_FRAGMENT_CONTROLS = re.compile("[" + "".join(sorted(_CONTROLS - {"\x1b"})) + "]")


def may_hold_a_fragment(text: str) -> bool:
    """Whether ``text`` (a whole file, its line ends included) is short enough and holds a control character, so
    that one of its documents may be a binary fragment (``binary_document``): a fast path leaves it to the
    general one, which checks document by document."""
    return len(text) < FRAGMENT_CHARS + 2 and _FRAGMENT_CONTROLS.search(text) is not None


def binary_document(text: str) -> str | None:
    """Why a decoded document is binary data rather than text (its own check, whatever its file's first bytes
    said: a damaged stretch in the middle of a file), or None: U+0000, or a short document holding a C0 control
    character other than tab, form feed, vertical tab and ESC (random bytes that happen to decode as UTF-8 come
    as such short lines). Decided by the document alone: the same whatever the chunking."""
    if has_nul(text):
        return "binary data, not text: the document holds NUL (U+0000) characters"
    if len(text) < FRAGMENT_CHARS and _FRAGMENT_CONTROLS.search(text) is not None:
        return f"binary data, not text: a {len(text)}-character fragment holding control characters"
    return None
