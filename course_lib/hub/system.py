"""What the hub changes on the machine, as root: the learners' users and homes, their notebook copies, and the
processes to end.  Every function here only touches what the roster names or the hub's own state folder holds."""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

COPY = "course"                        # the learner's copy of the notebooks: ~/course
CREATED = "users-created"              # in the state folder: the users this hub created (and may remove)


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise SystemExit(f"hub: {what} needs root (it creates users and starts servers as them): "
                         "run it with sudo, e.g. sudo make hub")


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def create_users(names: list[str], state: Path) -> list[str]:
    """Create each missing user with a private home (0700); return the names created now."""
    made = []
    for name in names:
        if not user_exists(name):
            subprocess.run(["useradd", "--create-home", "--user-group", "--shell", "/bin/bash", name], check=True)
            made.append(name)
        home = Path(pwd.getpwnam(name).pw_dir)
        home.mkdir(parents=True, exist_ok=True)
        os.chmod(home, 0o700)          # a learner cannot read another's home (Debian's default is 0755)
    if made:
        with open(state / CREATED, "a", encoding="utf-8") as f:
            f.writelines(n + "\n" for n in made)
    return made


def remove_users(state: Path) -> list[str]:
    """Remove the users this hub created (and their homes, with their work). Users it found in place stay."""
    path = state / CREATED
    names = list(dict.fromkeys(path.read_text().split())) if path.exists() else []
    removed = []
    for name in names:
        if user_exists(name):
            end_processes(uids={pwd.getpwnam(name).pw_uid})
            subprocess.run(["userdel", "--remove", name], check=True, capture_output=True)
            removed.append(name)
    path.unlink(missing_ok=True)
    return removed


def copy_notebooks(src: Path, name: str) -> tuple[Path, bool]:
    """``src`` copied once into ``~name/course``, owned by ``name``; an existing copy is never overwritten.
    Returns the copy's path and whether it was made now."""
    user = pwd.getpwnam(name)
    dest = Path(user.pw_dir) / COPY
    if dest.exists():
        return dest, False
    tmp = dest.with_name(f".{COPY}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    for root, dirs, files in os.walk(tmp):
        for p in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.lchown(p, user.pw_uid, user.pw_gid)
    tmp.rename(dest)
    return dest, True


def _procs():
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                uid = int(next(line.split()[1] for line in open(f"/proc/{d}/status") if line.startswith("Uid:")))
                cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, StopIteration, ValueError):
                continue
            yield int(d), uid, cmd


def processes(uids: set[int] = frozenset(), marks: tuple[str, ...] = ()) -> list[tuple[int, int, str]]:
    """(pid, uid, command line) of every process run by one of ``uids`` or whose command line holds a mark."""
    me = os.getpid()
    return [(pid, uid, cmd) for pid, uid, cmd in _procs()      # a zombie has ended: only its parent's wait is due
            if pid != me and (uid in uids or any(m in cmd for m in marks)) and _alive(pid)]


def end_processes(uids: set[int] = frozenset(), marks: tuple[str, ...] = (), grace: float = 10) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace`` seconds, each of :func:`processes`; returns the pids ended."""
    found = [pid for pid, _, _ in processes(uids, marks)]
    for pid in found:
        with _gone():
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in found):
        time.sleep(0.2)
    for pid in found:
        if _alive(pid):
            with _gone():
                os.kill(pid, signal.SIGKILL)
    return found


class _gone:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is ProcessLookupError


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return False
