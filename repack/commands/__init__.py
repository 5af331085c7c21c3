"""One module per `repack` command; `options` holds what the job commands share.
Modules here import nothing heavy at import time (`repack --help` stays fast)."""
