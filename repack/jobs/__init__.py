"""Jobs: one module per modality (plan -> tasks, run_task -> record, finalize -> manifest),
and the engine that runs any of them."""

JOBS: dict[str, str] = {
    "images": "repack.jobs.images:ImagesJob",
    "text": "repack.jobs.text:TextJob",
    "video": "repack.jobs.video:VideoJob",
}
