"""The manifest, made and checked alike by every storage: its format and version, the generation
it names, one-line errors that say what to do."""

from __future__ import annotations

import pytest

from ragbudget.errors import IndexCorruptError
from ragbudget.retrieval.manifest import FORMAT_VERSION, check_manifest, new_manifest


def test_a_new_manifest_carries_the_writers_fields_and_the_storages_parts() -> None:
    m = new_manifest({"dim": 8, "counts": {"chunks": 2}}, generation=4, approx=None, sqlite={"file": "meta.4.sqlite"})
    assert m == {
        "dim": 8,
        "counts": {"chunks": 2},
        "format": "ragbudget-index",
        "format_version": FORMAT_VERSION,
        "generation": 4,
        "approx": None,
        "sqlite": {"file": "meta.4.sqlite"},
    }
    assert check_manifest(m, "here", generation=4) is m


@pytest.mark.parametrize(
    ("data", "generation", "said"),
    [
        ([1, 2], None, "not a ragbudget manifest"),
        ({"format": "other", "generation": 1, "format_version": 1}, None, "not a ragbudget manifest"),
        ({"format": "ragbudget-index", "format_version": 1}, None, "'generation'"),
        ({"format": "ragbudget-index", "generation": 2, "format_version": 1}, 3, "names generation 2, the storage 3"),
        ({"format": "ragbudget-index", "generation": 1}, None, "'format_version'"),
        ({"format": "ragbudget-index", "generation": 1, "format_version": 0}, None, "rebuild the index"),
        ({"format": "ragbudget-index", "generation": 1, "format_version": 9}, None, "upgrade ragbudget"),
    ],
)
def test_what_is_not_a_manifest_this_version_reads_is_refused_in_one_line(
    data: object, generation: int | None, said: str
) -> None:
    with pytest.raises(IndexCorruptError) as exc:
        check_manifest(data, "the manifest row in schema s", generation=generation)
    msg = str(exc.value)
    assert msg.startswith("the manifest row in schema s") and said in msg and "\n" not in msg
