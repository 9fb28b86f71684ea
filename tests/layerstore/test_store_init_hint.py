"""`layerctl store init` is named in an error only where it is the fix (issue 30): a new directory
under an existing parent, an empty location. A mistyped path, a file, a location full of other
things, or one the client may not list get what is wrong instead."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.cli_helpers import layerctl

from layerstore.errors import NotFound, PermissionDenied
from layerstore.store import Store


def _check_error(url: str) -> str:
    with Store.open(url) as s, pytest.raises(NotFound) as e:
        s.check()
    return str(e.value)


def test_a_new_directory_under_an_existing_parent_names_init(tmp_path: Path) -> None:
    msg = _check_error(str(tmp_path / "store"))
    assert "does not exist" in msg and "layerctl store init" in msg


def test_a_path_whose_parent_is_missing_says_check_the_path(tmp_path: Path) -> None:
    msg = _check_error(str(tmp_path / "typo" / "store"))
    assert "nor does its parent directory" in msg and str(tmp_path / "typo") in msg
    assert "store init" not in msg


def test_a_file_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    msg = _check_error(str(tmp_path / "file"))
    assert "is not a directory" in msg and "store init" not in msg


def test_an_empty_directory_names_init(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    msg = _check_error(str(tmp_path / "empty"))
    assert "not a layerstore store" in msg and "empty" in msg and "layerctl store init" in msg


def test_a_directory_of_other_objects_says_check_the_url(tmp_path: Path) -> None:
    (tmp_path / "other" / "tags").mkdir(parents=True)
    (tmp_path / "other" / "tags" / "something").write_text("{}")
    msg = _check_error(str(tmp_path / "other"))
    assert "holds other objects" in msg and "tags/something" in msg and "store init" not in msg


def test_a_location_the_client_may_not_list_names_its_admin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "s").mkdir()
    with Store.open(str(tmp_path / "s")) as s:
        def refuse(prefix: str = "") -> None:
            raise PermissionDenied("listing needs the gc scope")

        monkeypatch.setattr(s.backend, "list", refuse)
        with pytest.raises(NotFound, match=r"an admin creates a store with `layerctl store init`"):
            s.check()


def test_the_default_store_on_a_fresh_machine_names_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody typed the default store's path, and on a fresh machine its parents are missing too:
    `layerctl store init` (which makes them) is the fix, not checking the path."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "fresh" / "share"))
    from layerstore.config import default_store_path

    msg = _check_error(str(default_store_path()))
    assert "is the default store" in msg and "layerctl store init" in msg and "check the path" not in msg
    assert layerctl("env", "ls", env={"XDG_DATA_HOME": str(tmp_path / "fresh" / "share")}).err == \
        f"layerctl: error: {msg}\n"
