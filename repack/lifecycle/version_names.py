"""The files every version of a dataset names: the writers' guard against overwriting a published file
(``repack.lifecycle.publish.refuse_names_in_use``) and ``--overwrite``'s wipe (``repack.jobs.engine``) read it.
Apart so that the job engine imports it without the publish module (which imports the engine)."""

from __future__ import annotations

from repack.manifest import MANIFEST_NAME, Manifest, ManifestError, parse_manifest


def version_names(store, up_to: int | None = None) -> set[str]:
    """The version files in ``store`` (``manifest.json``, each ``manifest.vN.json``, those up to version ``up_to``
    where given) and every file each names; one that does not parse names only itself (gc and verify report it)."""
    from repack.manifest.versions import version_number

    found: set[str] = set()
    for rel in [MANIFEST_NAME, *store.list_sizes("manifest.v")]:
        number = version_number(rel)
        if rel != MANIFEST_NAME and (number is None or (up_to is not None and number > up_to)):
            continue
        raw = store.read_bytes(rel)
        if raw is None:
            continue
        found.add(rel)
        try:
            found.update(Manifest(store.scratch, parse_manifest(raw, store.scratch, rel).data).named_files())
        except (TypeError, ValueError, ManifestError):
            continue
    return found
