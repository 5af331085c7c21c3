"""What a job's terminal summary says of its quarantine, the same on every path (a run, --append):
counts per reason, then the first quarantined inputs by name (the manifest holds them all)."""

from __future__ import annotations

from typing import Callable

REASONS_SHOWN = 10  # reasons counted one per line
NAMED = 10  # quarantined inputs named one per line


def quarantine_lines(quarantine: list[dict], reason_of: Callable[[str], str] = lambda reason: reason,
                     counts: bool = True) -> list[str]:
    """Summary lines for ``quarantine`` (manifest records): with ``counts``, one line per reason (as
    ``reason_of`` groups them), most frequent first; then the first NAMED inputs with their reason."""
    lines = []
    if counts:
        per_reason: dict[str, int] = {}
        for record in quarantine:
            key = reason_of(str(record.get("reason", "?")))
            per_reason[key] = per_reason.get(key, 0) + 1
        lines += [f"  quarantined {n}: {reason}"
                  for reason, n in sorted(per_reason.items(), key=lambda kv: (-kv[1], kv[0]))[:REASONS_SHOWN]]
    for record in quarantine[:NAMED]:
        line = f":{record['line']}" if record.get("line") is not None else ""
        lines.append(f"  quarantined: {record.get('source', '?')}{line}: {record.get('reason', '?')}")
    if len(quarantine) > NAMED:
        lines.append(f"  ... and {len(quarantine) - NAMED} more (`repack inspect OUT --quarantine` lists every one)")
    return lines
