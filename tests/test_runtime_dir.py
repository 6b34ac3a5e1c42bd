"""shared/runtime/runtime_dir.py: a runtime folder that another user owns or may write into stops every
service at start, and no file is written into it through a planted symlink.

Tests run as root, so "another user" is a folder chowned to nobody."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.model.weight_share import weights_file
from shared.runtime.admin_token import ensure_local_admin_token, local_admin_token_path
from shared.runtime.runtime_dir import UnsafePath, prepare_runtime_dir, write_private_file
from tests.stack import REPO

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")


def test_a_missing_folder_is_created_private(tmp_path):
    folder = tmp_path / "a" / "run"
    prepare_runtime_dir(str(folder))
    assert folder.stat().st_mode & 0o777 == 0o700
    prepare_runtime_dir(str(folder))  # the second service to start finds it made


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755])
def test_a_private_folder_of_ours_is_taken(tmp_path, mode):
    (tmp_path / "run").mkdir(mode=mode)
    os.chmod(tmp_path / "run", mode)
    prepare_runtime_dir(str(tmp_path / "run"))


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777])
def test_a_folder_others_may_write_is_refused(tmp_path, mode):
    (tmp_path / "run").mkdir()
    os.chmod(tmp_path / "run", mode)
    with pytest.raises(UnsafePath, match=f"runtime folder {tmp_path / 'run'} has mode {mode & 0o7777:04o}, writable"):
        prepare_runtime_dir(str(tmp_path / "run"))


@as_root
def test_a_folder_of_another_user_is_refused(tmp_path):
    (tmp_path / "run").mkdir(mode=0o700)
    os.chown(tmp_path / "run", NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=f"belongs to uid {NOBODY}, not to this user"):
        prepare_runtime_dir(str(tmp_path / "run"))


def test_a_symlink_in_place_of_the_folder_is_refused(tmp_path):
    (tmp_path / "ours").mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(tmp_path / "ours")  # even to a good folder: its owner may swap it later
    with pytest.raises(UnsafePath, match="is a symlink or a file"):
        prepare_runtime_dir(str(tmp_path / "run"))


@pytest.mark.e2e
@as_root
@pytest.mark.parametrize("service", ["router", "prefill"])
def test_services_refuse_to_start_in_another_users_folder(tmp_path, service):
    """The real process: it exits 2 with the reason before it loads anything."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chown(run, NOBODY, NOBODY)
    env = {**os.environ, "PDSERVE_ROUTER_RUNTIME_DIR": str(run)}
    done = subprocess.run([sys.executable, "-m", f"services.{service}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"runtime folder {run} belongs to uid {NOBODY}" in done.stderr
    assert not (run / "router.ipc").exists()


def test_the_weights_file_is_written_private_and_whole(tmp_path):
    path = weights_file(str(tmp_path), "prefill-0")
    (tmp_path / f"{path.name}.tmp").write_bytes(b"left by a run that died mid-write")
    write_private_file(path, b"first")
    write_private_file(path, b"second")  # a restarted prefill publishes again
    assert path.read_bytes() == b"second" and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("planted", ["file", "staging"])
def test_a_symlink_planted_where_the_weights_go_is_refused(tmp_path, planted):
    victim = tmp_path / "elsewhere"
    victim.write_bytes(b"not yours")
    path = weights_file(str(tmp_path / "run"), "prefill-0")
    path.parent.mkdir()
    link = path if planted == "file" else path.with_name(f"{path.name}.tmp")
    link.symlink_to(victim)
    with pytest.raises(UnsafePath, match=f"{link} is a symlink"):
        write_private_file(path, b"weights")
    assert victim.read_bytes() == b"not yours" and link.is_symlink()


def test_the_open_itself_follows_no_symlink(tmp_path, monkeypatch):
    """A symlink planted between the check and the open still fails the open (O_EXCL|O_NOFOLLOW)."""
    victim = tmp_path / "elsewhere"
    victim.write_bytes(b"not yours")
    path = tmp_path / "weights.msgpack"
    monkeypatch.setattr(Path, "is_symlink", lambda self: False)  # the check misses it
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: None)
    path.with_name(f"{path.name}.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_private_file(path, b"weights")
    assert victim.read_bytes() == b"not yours"


def test_the_local_admin_token_is_private_and_kept(tmp_path):
    """`make run`'s admin token (shared/runtime/admin_token.py): made 0600, kept while it is private,
    made afresh when others may read it, never written through a symlink."""
    path = ensure_local_admin_token(str(tmp_path))
    token = path.read_text()
    assert path == local_admin_token_path(str(tmp_path)) and os.stat(path).st_mode & 0o777 == 0o600
    assert len(token.strip()) >= 32
    assert ensure_local_admin_token(str(tmp_path)).read_text() == token
    os.chmod(path, 0o644)
    assert ensure_local_admin_token(str(tmp_path)).read_text() != token
    assert os.stat(path).st_mode & 0o777 == 0o600
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePath, match="symlink"):
        ensure_local_admin_token(str(tmp_path))
    assert not (tmp_path / "elsewhere").exists()
