"""ImageShardDataset + StatefulDataLoader as the resume tests build them, and the resumed half of
a run: ``python -m tests.tools.image_resume`` reads [root, cases] as JSON on stdin, loads each
case's saved loader state into a freshly built dataset + loader (a new process), reads on to the
end and prints one JSON list: per case, the batches ([[key, label], ...]) and the bytes read."""

from __future__ import annotations

import json
import sys

from torchdata.stateful_dataloader import StatefulDataLoader

from pipelines.torch_webdataset import ImageShardDataset

BATCH = 8


def keys_and_labels(batch: list[dict]) -> list[list]:
    """collate_fn: a batch as [[key, label], ...] (JSON-friendly, comparable)."""
    return [[s["key"], s["label"]] for s in batch]


def make(root, workers: int, **options):
    """(dataset, loader) of raw-bytes dict samples, batches of BATCH as [[key, label], ...]."""
    dataset = ImageShardDataset(root, output="dict", decode=False, **options)
    return dataset, StatefulDataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=keys_and_labels)


def main() -> None:
    root, cases = json.loads(sys.stdin.read())
    out = []
    for case in cases:
        dataset, loader = make(root, case["workers"], **case["options"])
        dataset.set_epoch(case["epoch"])
        loader.load_state_dict(case["state"])
        out.append({"batches": list(loader), "bytes": dataset.bytes_read})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
