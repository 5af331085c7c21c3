"""Parquet files with an image-bytes column (Hugging Face ``datasets`` exports) as image inputs.

The image column is the one named by ``--image-field``, else the one column holding bytes: a
binary column, or a struct with a binary ``bytes`` field (the ``datasets`` Image feature,
``{bytes, path}``). The label column is ``--label-field``, else the one the file's ``datasets``
metadata calls a ClassLabel, else ``label``/``labels``/``class``/``cls``. ClassLabel names and
indices are kept as the class map; integer labels without names keep their values as indices;
string labels are class names (sorted). Other columns are not carried (counted in the manifest).

Scanning reads the image column once for its lengths (the planner needs each input's size), in
bounded record batches (``repack.sources.parquet_batches``: a large file or row group is packed,
never read whole); tasks read their rows the same way. A ClassLabel value outside its names is
quarantined; string labels are stripped. An ``--image-field`` or label column of another type (a
nested list, a struct without ``bytes``) is refused with one line. A row whose image is null, or only a path (not
embedded), is quarantined. The inputs are a ``MemberTable`` (columns, no object per row; its items are
``MemberItem`` items): the file's path and fingerprint, the row number and column; rel ``<file rel>/<row>``;
metadata ``source_file``, ``source_key`` (the row) and ``source_path`` (the Image feature's path, when set).
"""

from __future__ import annotations

import json
from array import array

import numpy as np

from repack.errors import SourceUnavailable, UsageError
from repack.sources.base import FieldChoice, Scan, quarantine_record
from repack.sources.confine import Confinement
from repack.sources.containers import Container, list_containers, open_container
from repack.sources.parquet_batches import iter_group_batches, open_parquet
from repack.sources.class_index import bound_table_labels, numeric_class_index, sorted_labels
from repack.sources.columns import NO_LABEL
from repack.sources.member_table import MemberRows

LABEL_COLUMNS = ("label", "labels", "class", "cls")


def _is_bytes(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type)


def _holds_image(arrow_type) -> bool:
    """Binary, or a struct with a binary ``bytes`` field (the ``datasets`` Image feature)."""
    import pyarrow as pa

    return _is_bytes(arrow_type) or (pa.types.is_struct(arrow_type) and arrow_type.get_field_index("bytes") >= 0
                                     and _is_bytes(arrow_type.field("bytes").type))


def _holds_labels(arrow_type) -> bool:
    """Integers or strings (a ClassLabel is int64)."""
    import pyarrow as pa

    return pa.types.is_integer(arrow_type) or pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def _image_column(schema, fields: FieldChoice, where: str) -> str:
    if fields.image is not None:
        if fields.image not in schema.names:
            raise UsageError(f"{where}: no column {fields.image!r} (--image-field; columns: {', '.join(schema.names)})")
        kind = schema.field(fields.image).type
        if not _holds_image(kind):
            raise UsageError(f"{where}: column {fields.image!r} is {kind}, not image bytes (--image-field names a "
                             "binary column or a struct with a binary 'bytes' field)")
        return fields.image
    found = [f.name for f in schema if _holds_image(f.type)]
    if len(found) != 1:
        what = f"several image columns ({', '.join(found)})" if found else "no image-bytes column"
        raise UsageError(f"{where}: {what}; name it with --image-field")
    return found[0]


def _label_column(schema, metadata: dict, fields: FieldChoice, where: str) -> tuple[str | None, list[str] | None]:
    """(label column or None, ClassLabel names or None)."""
    info = metadata.get("info") if isinstance(metadata, dict) else None
    features = info.get("features") if isinstance(info, dict) else None
    features = features if isinstance(features, dict) else {}  # metadata of another shape names no ClassLabel
    if fields.label is not None:
        if fields.label not in schema.names:
            raise UsageError(f"{where}: no column {fields.label!r} (--label-field; columns: {', '.join(schema.names)})")
        column = fields.label
    else:
        class_labels = [n for n, f in features.items()  # the metadata may name a column the file no longer has
                        if isinstance(f, dict) and f.get("_type") == "ClassLabel" and n in schema.names]
        column = class_labels[0] if class_labels else next((c for c in LABEL_COLUMNS if c in schema.names), None)
    if column is not None and schema.names.count(column) > 1:
        raise UsageError(f"{where}: {schema.names.count(column)} columns are named {column!r}: which holds the labels "
                         "is not known")
    if column is not None and not _holds_labels(schema.field(column).type):
        raise UsageError(f"{where}: label column {column!r} is {schema.field(column).type}, not labels (integers "
                         "or strings; name another with --label-field)")
    feature = features.get(column) if column else None
    names = feature.get("names") if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" else None
    if names is not None:  # the class map: one distinct name per index, stripped as every label is
        cleaned = [n.strip() for n in names if isinstance(n, str)] if isinstance(names, list) else []
        if len(cleaned) != len(names) or not all(cleaned) or len(set(cleaned)) != len(cleaned):
            raise UsageError(f"{where}: the ClassLabel names of column {column!r} are not distinct non-empty "
                             f"strings ({str(names)[:200]}); fix the metadata, or name the labels with --label-field "
                             "of a string column")
        names = cleaned
    return column, names


def _hf_metadata(schema) -> dict:
    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        metadata = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return metadata if isinstance(metadata, dict) else {}


def _label_name(value, names: list[str] | None) -> tuple[str | None, str | None]:
    """(class name or None, None), or (None, why the row's label is refused): a ClassLabel value outside
    its names; a string label is stripped (empty: no label)."""
    if value is None:
        return None, None
    if names is not None and isinstance(value, int):
        if 0 <= value < len(names):
            return names[value], None
        return None, f"label {value} is outside the ClassLabel's {len(names)} names (0..{len(names) - 1})"
    if isinstance(value, int) and value < 0:  # the datasets convention for a row without a label
        return None, f"label {value} (negative: no class index; datasets marks an unlabeled row -1)"
    text = str(value).strip()
    return text or None, None


class _RowColumns:
    """A file's rows with embedded image bytes as columns (row, size, label id, Image path): no tuple per row;
    iterated as (row, size, label, source path) tuples, made one at a time."""

    def __init__(self, labels: dict[str, int]) -> None:
        self.labels = labels  # label name -> id, shared by the files of a scan
        self.rows, self.sizes, self.label_ids = array("q"), array("q"), array("i")
        self.paths, self.path_ends = bytearray(), array("q")  # each row's Image path ("" for none), and its end

    def append(self, row: int, size: int, label: str | None, source_path: str | None) -> None:
        self.rows.append(row)
        self.sizes.append(size)
        self.label_ids.append(-1 if label is None else self.labels.setdefault(label, len(self.labels)))
        self.paths += (source_path or "").encode("utf-8", "surrogateescape")  # a path may hold a NUL: no separator
        self.path_ends.append(len(self.paths))

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        names = list(self.labels)
        start = 0
        for row, size, lid, end in zip(self.rows, self.sizes, self.label_ids, self.path_ends):
            path = self.paths[start:end].decode("utf-8", "surrogateescape")
            start = end
            yield row, size, (names[lid] if lid >= 0 else None), path or None


def _rows(container: Container, fields: FieldChoice, quarantine: list[dict], labels: dict[str, int]):
    """(row, size, label, source path) of every row with embedded image bytes; the image column, the ClassLabel
    names, the columns not carried, and whether the labels are integers without names (class indices)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    with open_container(container) as fh:
        try:
            pf = open_parquet(fh)
        except SourceUnavailable:  # the endpoint's fault, not the file's: the plan fails (a re-run reads it)
            raise
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
            quarantine.append(quarantine_record(container.rel, f"not a readable parquet file: {exc}"))
            return _RowColumns(labels), None, None, (), False
        schema = pf.schema_arrow
        image = _image_column(schema, fields, container.rel)
        label, names = _label_column(schema, _hf_metadata(schema), fields, container.rel)
        columns = [image] + ([label] if label else [])
        rows, row = _RowColumns(labels), 0
        try:  # a damaged page: the rows before it are kept, the file is named
            for batch in iter_group_batches(pf, columns):
                values = batch.column(0)
                paths = None
                if hasattr(values.type, "get_field_index"):  # the Image feature's struct {bytes, path}
                    paths = values.field("path").to_pylist() if values.type.get_field_index("path") >= 0 else None
                    values = values.field("bytes")
                sizes = pc.binary_length(values).to_pylist()
                labels = batch.column(1).to_pylist() if label else [None] * len(sizes)
                for i, size in enumerate(sizes):
                    source_path = paths[i] if paths else None
                    if size is None:
                        reason = (f"image not embedded (only a path: {source_path})" if source_path
                                  else "no image bytes (null)")
                        quarantine.append(quarantine_record(f"{container.rel}/{row}", reason))
                    else:
                        name, refusal = _label_name(labels[i], names)
                        if refusal is None:
                            rows.append(row, size, name, source_path)
                        else:
                            quarantine.append(quarantine_record(f"{container.rel}/{row}", refusal))
                    row += 1
        except (OSError, ValueError, pa.ArrowException) as exc:
            quarantine.append(quarantine_record(container.rel, f"parquet file damaged after {row} row(s): {exc}; "
                                                               "the rest of the file is not read"))
        carried = set(columns)
        indices = bool(label) and names is None and pa.types.is_integer(schema.field(label).type)
        return rows, image, names, tuple(n for n in schema.names if n not in carried), indices


def scan_parquet(source: str, fields: FieldChoice, confinement: Confinement | None = None) -> Scan:
    """Rows of every ``.parquet`` under ``source`` (files in byte order, rows in file order); see module doc."""
    conf = confinement or Confinement()
    listing = list_containers(source, (".parquet",), {}, conf.without_size_cap())  # the cap is per row
    quarantine = list(listing.quarantine)
    taken = MemberRows(rows_of_files=True)  # the rows taken, as columns
    labels: dict[str, int] = {}  # every label read, name -> id (the files' row columns share it)
    not_carried: dict[str, int] = {}
    class_names: list[str] = []  # every file's ClassLabel names: the first file's order, then names new in later ones
    known_names: set[str] = set()
    named_files: list[bool | None] = []  # per container: whether its labels come from ClassLabel names
    read = []
    for container in listing.containers:
        rows, image, names, others, indices = _rows(container, fields, quarantine, labels)
        new = [name for name in dict.fromkeys(names or ()) if name not in known_names]  # a set: 21k names a file
        class_names += new
        known_names.update(new)
        named_files.append(None if indices else names is not None)  # None: integer labels, no names
        read.append((container, rows, image))
        for column in others:
            not_carried[column] = not_carried.get(column, 0) + len(rows)
    for at, named in enumerate(named_files):
        container, rows, image = read[at]
        read[at] = None  # a file's row columns go once its rows are taken
        for row, size, label, source_path in rows:
            rel = f"{container.rel}/{row}"
            if class_names and not named and label is not None and (named is None or label not in known_names):
                # an index without names, or a name the others' ClassLabel names do not hold: which class it is
                # cannot be told (an index 1 is not the name "1")
                quarantine.append(quarantine_record(
                    rel, f"label {label!r} of a file without ClassLabel names ({'an integer index' if named is None else 'not one of theirs'}), "
                         f"beside files with ClassLabel names ({', '.join(class_names[:8])}"
                         f"{', ...' if len(class_names) > 8 else ''})"))
                continue
            too_big = conf.size_refusal(size)
            if too_big is not None:
                quarantine.append(quarantine_record(rel, too_big, label))
                continue
            taken.add(container, rel, str(row), label, row, size, image, source_path or "")
    table = taken.table()
    del taken
    labeled = bool(len(table)) and bool((table.label_ids != NO_LABEL).any())
    if labeled:
        unlabeled = np.flatnonzero(table.label_ids == NO_LABEL)
        quarantine += [quarantine_record(table.rel(row), "no label in a labeled dataset") for row in unlabeled.tolist()]
        if len(unlabeled):
            table = table.take(np.flatnonzero(table.label_ids != NO_LABEL))
    if not class_names:
        table, over = bound_table_labels(table)
        quarantine += over
    table = sorted_labels(table)
    if class_names:
        index = tuple((name, i) for i, name in enumerate(class_names))
    else:
        index = numeric_class_index(table.label_set())
    if not len(table) and not quarantine:
        raise UsageError(f"source {source!r}: its parquet files hold no rows")
    return Scan(table, tuple(quarantine), labeled, listing.skipped, class_index=index,
                not_carried=tuple(sorted(not_carried.items())))
