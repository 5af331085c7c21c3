"""One rank of a real torch.distributed (gloo) run that counts the batches each reader yields:
``python -m tests.tools.ddp_steps RANK WORLD INIT_FILE SPEC_JSON`` prints {name: batches} as JSON after
checking, with an all_gather, that every rank yields as many (a DDP loop would block otherwise)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader


def loaders(spec: dict):
    from pipelines.mixture import Mixture
    from pipelines.sampler_resume import ResumableSampler
    from pipelines.torch_lmdb import LmdbImageDataset
    from pipelines.torch_webdataset import ImageShardDataset

    for workers in (0, 2):
        for drop_last in (False, True):
            images = ImageShardDataset(spec["images"], decode=False, drop_last=drop_last)  # rank from dist
            yield f"images w{workers} drop{drop_last}", StatefulDataLoader(images, batch_size=4, num_workers=workers,
                                                                          collate_fn=list)
            batched = ImageShardDataset(spec["images"], decode=False, drop_last=drop_last, batch_size=4)
            yield f"batches w{workers} drop{drop_last}", StatefulDataLoader(batched, batch_size=None, num_workers=workers)
            lmdb = LmdbImageDataset(spec["lmdb"], decode=False)
            sampler = ResumableSampler(len(lmdb), rank=dist.get_rank(), world_size=dist.get_world_size(),
                                       drop_last=drop_last)
            yield f"lmdb w{workers} drop{drop_last}", StatefulDataLoader(lmdb, batch_size=4, sampler=sampler,
                                                                        num_workers=workers, collate_fn=list)
        parts = [LmdbImageDataset(spec["lmdb"], decode=False), ImageShardDataset(spec["images"], decode=False)]
        mixture = Mixture([(parts[0], 1), (parts[1], 2)], seed=3)
        yield f"mixture w{workers}", StatefulDataLoader(mixture, batch_size=4, num_workers=workers, collate_fn=list)


def main() -> None:
    rank, world, init, spec = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    counts = {}
    for name, loader in loaders(spec):
        counts[name] = sum(1 for _ in loader)
    gathered = [None] * world
    dist.all_gather_object(gathered, counts)
    dist.destroy_process_group()
    print(json.dumps(gathered))


if __name__ == "__main__":
    main()
