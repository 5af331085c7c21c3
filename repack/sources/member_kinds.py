"""Which tar member extensions are images and labels: the one rule the shard scan (``repack.sources.tar_shards``)
and ``repack verify``'s member check (``repack.lifecycle.verify_declared``) share. No imports: verify forks its
hashing before it imports numpy."""

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm", "pnm")
LABEL_EXTS = ("cls", "label", "class")
