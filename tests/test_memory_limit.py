"""hotstart/system.py's memory reader on /proc and cgroup trees written as the kernel lays them out (a
folder standing in for /proc, files with the kernel's formats), and on this machine's own."""

from __future__ import annotations

from pathlib import Path

from hotstart import system
from hotstart.system import read_memory_limit

GiB = 1 << 30
MEMINFO = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n"


def _proc(tmp: Path, cgroup: str, mounts: list[tuple[str, str, str, str]], meminfo: str = MEMINFO) -> str:
    """A /proc stand-in: self/cgroup, self/mountinfo (MOUNTS: fstype, root, mount point, super options),
    meminfo."""
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    lines = [f"{30 + i} 23 0:{40 + i} {root} {point} rw,relatime - {fs} {fs} {opts}"
             for i, (fs, root, point, opts) in enumerate(mounts)]
    root_fs = "25 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
    (proc / "self" / "mountinfo").write_text(root_fs + "\n".join(lines) + "\n")
    (proc / "meminfo").write_text(meminfo)
    return str(proc)


def _files(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_v2_limit_of_an_ancestor_binds_with_its_working_set(tmp_path):
    cg = tmp_path / "cg2"
    _files(cg / "kubepods" / "pod1", memory_max=str(8 * GiB), memory_current=str(3 * GiB),
           memory_stat=f"anon {GiB}\nfile {2 * GiB}\ninactive_file {GiB}\n")
    _files(cg / "kubepods" / "pod1" / "ctr", memory_max="max", memory_current=str(2 * GiB),
           memory_stat="inactive_file 0\n")
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n", [("cgroup2", "/", str(cg), "rw,nsdelegate")])
    m = read_memory_limit(proc)
    assert m.limit == 8 * GiB and m.total == 8 * GiB
    assert [c.name for c in m.cgroups] == ["/kubepods/pod1"]
    available, source = m.available(MEMINFO)
    assert available == 8 * GiB - (3 * GiB - GiB)  # the limit minus the usage that cannot be dropped
    assert source.startswith("cgroup /kubepods/pod1's room (v2 limit 8.00 GiB - working set 2.00 GiB)")
    assert m.oom_folders() == [(2, str(cg / "kubepods" / "pod1"))]


def test_v1_inside_a_container_sees_its_cgroup_as_the_mount_root(tmp_path):
    mem = tmp_path / "memory"  # the container's own cgroup, mounted as the hierarchy's root
    _files(mem, memory_limit_in_bytes=str(int(2.5 * GiB)), memory_usage_in_bytes=str(GiB),
           memory_stat=f"total_inactive_file {GiB // 4}\nhierarchical_memory_limit {int(2.5 * GiB)}\n")
    proc = _proc(tmp_path, "12:memory:/docker/abc\n5:cpu,cpuacct:/docker/abc\n0::/\n",
                 [("cgroup", "/docker/abc", str(mem), "rw,memory")])
    m = read_memory_limit(proc)
    assert m.limit == int(2.5 * GiB) and len(m.cgroups) == 1 and m.cgroups[0].version == 1
    assert m.available(MEMINFO)[0] == int(2.5 * GiB) - (GiB - GiB // 4)


def test_v1_an_ancestor_outside_the_view_limits_through_memory_stat(tmp_path):
    mem = tmp_path / "memory"
    _files(mem / "job", memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes=str(GiB),
           memory_stat=f"total_inactive_file 0\nhierarchical_memory_limit {4 * GiB}\n")
    proc = _proc(tmp_path, "4:memory:/job\n", [("cgroup", "/", str(mem), "rw,memory")])
    m = read_memory_limit(proc)
    assert m.limit == 4 * GiB and "an ancestor's" in m.cgroups[0].name
    assert m.available(MEMINFO)[0] == 3 * GiB


def test_no_limit_and_limits_above_the_ram_leave_mem_available(tmp_path):
    mem, cg = tmp_path / "memory", tmp_path / "unified"
    _files(mem / "a", memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes="5")
    _files(cg / "b", memory_max=str(64 * GiB))  # above MemTotal (24 GB): binds nothing
    proc = _proc(tmp_path, "4:memory:/a\n0::/b\n",
                 [("cgroup", "/", str(mem), "rw,memory"), ("cgroup2", "/", str(cg), "rw")])
    m = read_memory_limit(proc)
    assert m.cgroups == () and m.limit is None and m.total == 24000000 * 1024
    assert m.available(MEMINFO) == (20000000 * 1024, "MemAvailable")
    assert m.oom_folders() == [(1, str(mem / "a")), (2, str(cg / "b"))]


def test_a_host_shorter_than_the_cgroup_room_keeps_mem_available_and_says_so(tmp_path):
    cg = tmp_path / "cg2"
    _files(cg / "svc", memory_max=str(16 * GiB), memory_current=str(GiB), memory_stat="inactive_file 0\n")
    proc = _proc(tmp_path, "0::/svc\n", [("cgroup2", "/", str(cg), "rw")])
    available, source = read_memory_limit(proc).available("MemAvailable: 4194304 kB\n")
    assert available == 4 * GiB and source == "MemAvailable (under cgroup /svc's limit 16.00 GiB)"


def test_escaped_mount_points_and_missing_folders(tmp_path):
    cg = tmp_path / "cgroup two"
    _files(cg, memory_max=str(GiB), memory_current="0")
    # the cgroup named by /proc/self/cgroup is not under the mount (another namespace): the mount's root
    proc = _proc(tmp_path, "0::/elsewhere/x\n", [("cgroup2", "/", str(cg).replace(" ", "\\040"), "rw")])
    m = read_memory_limit(proc)
    assert m.limit == GiB and m.cgroups[0].folder == str(cg)
    assert read_memory_limit(str(tmp_path / "nothing")).available("") == (
        None, "unknown (no /proc/meminfo, no cgroup limit)")


def test_this_machine_is_read_once_and_reported():
    assert system.memory_limit() is system.memory_limit()
    available = system.available_memory()
    assert available is not None and 0 < available <= (system.memory_limit().total or available)
    report = system.memory_report()
    assert set(report) == {"limit_bytes", "total_bytes", "available_bytes", "source", "cgroups"}
    assert report["source"].startswith(("MemAvailable", "cgroup "))
