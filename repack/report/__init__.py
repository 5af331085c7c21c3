"""Reports on a finished dataset: `repack inspect` text, JSON and a self-contained HTML page.
Standard library only (plus the manifest and sinks modules); nothing here loads at `repack --help`."""
