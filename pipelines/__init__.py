"""Readers for datasets written by repack (the consumer half).

Modules import ``repack.manifest`` and nothing else from ``repack``; torch and DALI are
imported only by the modules that need them. The producer imports one module of these back,
``pipelines.pil_images`` (numpy and Pillow only), so ``--normalize`` and the readers decode a
picture alike:

  pipelines.torch_webdataset   ImageShardDataset: a PyTorch IterableDataset over image shards
  pipelines.dali_webdataset    build_image_pipeline / dali_image_loader: NVIDIA DALI over the same shards
  pipelines.manifest_access    shared helpers: open a manifest, parse DALI index files, split work
"""
