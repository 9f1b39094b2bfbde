"""What hotstart loads from $HOTSTART_HOME is ours (hotstart/trust.py, hotstart/diskio.py): a home another
user owns or may write is not trusted (one warning, nothing written to it or loaded from it); an artifact
loads only if it, its folder and the home are ours and its bytes hash to the record published with it;
temporary names never collide across pods, and only a dead writer's leftovers are swept."""

from __future__ import annotations

import os
import time

import pytest

from hotstart import diskio, trust

ROOT = os.getuid() == 0


def artifact(home, name: str = "lib.so", data: bytes = b"\x7fELF not really"):
    folder = home / "kernels"
    trust.make_private_dir(folder)
    tmp = diskio.temp_name(folder / name)
    tmp.write_bytes(data)
    diskio.publish_recorded(tmp, folder / name)
    return folder / name


def test_a_home_others_may_write_or_own_is_not_trusted(tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.delenv(diskio.HOME_ENV, raising=False)
    assert diskio.check_home(home) is None and (home.stat().st_mode & 0o777) == 0o700  # created private
    for mode in (0o775, 0o757, 0o777):
        home.chmod(mode)
        why = diskio.check_home(home)
        err = capsys.readouterr().err.splitlines()
        assert why and "not trusted" in why and "open to other users" in why, why
        assert len(err) == 1 and "no CPU kernels, no compiled graphs" in err[0], err
        assert not diskio.home_writable()  # nothing is written to it either
    home.chmod(0o755)  # readable by others is fine: they cannot plant anything
    assert diskio.check_home(home) is None and diskio.home_writable()
    link = tmp_path / "link"
    link.symlink_to(home)  # a symlink counts by its target
    assert trust.trust_problem(link) is None
    home.chmod(0o770)
    assert "open to other users" in trust.trust_problem(link)
    home.chmod(0o700)
    if ROOT:  # another user's home (only root can make one here)
        os.chown(home, 4242, -1)
        assert "owned by uid 4242" in trust.trust_problem(home)
        os.lchown(link, 4242, -1)
        assert "symlink owned by uid 4242" in trust.trust_problem(link)


def test_an_artifact_loads_only_if_it_is_ours_and_matches_its_record(tmp_path):
    home = tmp_path / "home"
    trust.make_private_dir(home)
    lib = artifact(home)
    fd = trust.open_verified(lib, home)
    os.close(fd)
    assert trust.verified_problem(lib, home) is None
    lib.write_bytes(lib.read_bytes() + b"planted")  # changed after it was recorded
    assert "does not match its recorded hash" in trust.verified_problem(lib, home)
    lib = artifact(home, "b.so")
    trust.record_path(lib).unlink()
    assert "has no recorded hash" in trust.verified_problem(lib, home)
    lib = artifact(home, "c.so")
    lib.chmod(0o666)
    assert "open to other users" in trust.verified_problem(lib, home)
    lib.chmod(0o644)
    (home / "kernels").chmod(0o777)
    assert "open to other users" in trust.verified_problem(lib, home)
    (home / "kernels").chmod(0o700)
    real = artifact(home, "d.so")
    link = home / "kernels" / "e.so"
    link.symlink_to(real)
    trust.record_path(link).write_text(trust.record_path(real).read_text())
    assert "is a symlink" in trust.verified_problem(link, home)
    home.chmod(0o777)  # the home itself open: nothing under it loads
    assert "open to other users" in trust.verified_problem(real, home)
    home.chmod(0o700)
    trust.discard_recorded(real)
    assert not real.exists() and not trust.record_path(real).exists()


def test_temp_names_are_unique_across_pods_and_only_dead_writers_are_swept(tmp_path):
    target = tmp_path / "cpu-0123.so"
    names = {diskio.temp_name(target).name for _ in range(100)}
    assert len(names) == 100
    host, pid = os.uname().nodename, str(os.getpid())
    assert all(n.startswith(".cpu-0123.so.") and pid in n and n.endswith(".tmp") for n in names)
    assert host.split(".")[0] in next(iter(names))
    mine = diskio.temp_name(target, ".pt2")
    assert mine.name.endswith(".tmp.pt2") and not diskio.stale_temp(mine)  # this process lives
    dead = str((1 << 22) + 1)  # above the largest pid_max Linux allows: never a live process
    ours_dead = tmp_path / mine.name.replace(f"-{pid}-", f"-{dead}-")
    other_new = tmp_path / ".cpu-0123.so.pod-b7f9-1-0badcafe.tmp"
    other_old = tmp_path / ".cpu-0123.so.pod-x2k4-1-deadbeef.tmp"
    for f in (mine, ours_dead, other_new, other_old):
        f.write_bytes(b"partial")
    old = time.time() - diskio.STALE_TEMP_S - 60
    os.utime(other_old, (old, old))
    diskio.remove_stale_temps(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other_new.name])


@pytest.mark.skipif(not ROOT, reason="the zygote's runtime folder must be exactly ours: only root can chown")
def test_the_runtime_folder_check_is_the_same_rule_stricter(tmp_path):
    from hotstart.forkserver.runtime import check_private_dir

    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    assert check_private_dir(str(d)) is None
    d.chmod(0o750)
    assert "needs 700" in check_private_dir(str(d))
    d.chmod(0o700)
    os.chown(d, 0, -1)
    assert check_private_dir(str(d), uid=4242) == f"{d} is owned by uid 0, not 4242"  # root is not enough
