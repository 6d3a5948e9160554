"""``make hub-env``'s last step: the proxy from npm, the notebooks every learner copies, and the checks that the
learners can run what is installed (not under /root)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

PROXY_NODE = {"5": 20, "4": 10}     # configurable-http-proxy's major version -> the oldest Node.js it runs on


class HubError(SystemExit):
    def __init__(self, msg: str):
        super().__init__(f"hub: {msg}")


def paths(prefix: Path) -> dict[str, Path]:
    return {"state": prefix / "state", "venv": prefix / "venv", "notebooks": prefix / "notebooks",
            "proxy": prefix / "node" / "node_modules" / ".bin" / "configurable-http-proxy",
            "singleuser": prefix / "venv" / "bin" / "jupyterhub-singleuser",
            "jupyterhub": prefix / "venv" / "bin" / "jupyterhub"}


def node_major() -> int | None:
    node = shutil.which("node")
    if not node:
        return None
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        return int(out.lstrip("v").split(".")[0])
    except ValueError:
        return None


def install_proxy(prefix: Path, version: str = "5") -> Path:
    """configurable-http-proxy from npm into ``prefix/node``, after checking Node.js is new enough for it."""
    proxy = paths(prefix)["proxy"]
    need = PROXY_NODE.get(version.split(".")[0])
    if need is None:
        raise HubError(f"HUB_PROXY_VERSION={version}: the course knows configurable-http-proxy 4 and 5")
    major = node_major()
    if major is None or not shutil.which("npm"):
        raise HubError("configurable-http-proxy needs Node.js and npm, and this machine has "
                       f"{'no node' if major is None else 'no npm'}: apt-get install nodejs npm (Debian 13 and "
                       "Ubuntu 24.04 ship Node 20), or Node.js from nodejs.org; or point HUB_PROXY at a "
                       "configurable-http-proxy you have")
    if major < need:
        older = [v for v, n in PROXY_NODE.items() if n <= major]
        raise HubError(f"node v{major} is older than configurable-http-proxy {version} needs (Node {need} or newer). "
                       "Either install a newer Node.js (nodejs.org, or your distribution's backports), or "
                       + (f"use configurable-http-proxy {older[0]} (make hub HUB_PROXY_VERSION={older[0]}), "
                          if older else "")
                       + "or point HUB_PROXY at a configurable-http-proxy you already have")
    if not proxy.exists():
        subprocess.run(["npm", "install", "--prefix", str(prefix / "node"), "--no-audit", "--no-fund",
                        "--loglevel=error", f"configurable-http-proxy@{version}"], check=True)
    return proxy


def unreadable_for_others(path: Path) -> Path | None:
    """The first of ``path`` and its folders that another user cannot enter or read (e.g. /root), else None."""
    path = Path(path).resolve()
    for q in [*reversed(path.parents), path]:
        mode = q.stat().st_mode
        if not mode & 0o001 or (q == path and not mode & 0o004):
            return q
    return None


def check_learners_can_run(python: str = sys.executable) -> None:
    """The learners' servers run this environment's Python: its interpreter and standard library must not sit
    where they cannot go (a pyenv or conda Python under /root)."""
    for what in (Path(python), Path(sys.base_prefix) / "lib"):
        blocked = unreadable_for_others(what)
        if blocked:
            raise HubError(f"the learners cannot run this environment's Python ({what} is inside {blocked}, "
                           "closed to other users): rebuild it from a system Python, e.g. "
                           "make hub HUB_PYTHON=/usr/bin/python3 (Debian: apt-get install python3-venv)")


def prepare(prefix: Path, notebooks: Path, proxy_version: str) -> None:
    p = paths(prefix)
    check_learners_can_run()
    blocked = unreadable_for_others(prefix)
    if blocked:
        raise HubError(f"HUB_PREFIX={prefix} is inside {blocked}, closed to the learners: choose another")
    install_proxy(prefix, proxy_version)
    if not notebooks.is_dir():
        raise HubError(f"no notebooks in {notebooks}: run it from the course's folder")
    tmp = p["notebooks"].with_name(".notebooks.new")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(notebooks, tmp, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    shutil.rmtree(p["notebooks"], ignore_errors=True)    # the hub's source copy; learners' copies are their own
    tmp.rename(p["notebooks"])
    for root, dirs, files in os.walk(prefix):
        if Path(root) == p["state"] or p["state"] in Path(root).parents:
            continue
        for n in dirs + files:
            q = Path(root) / n
            if not q.is_symlink() and q != p["state"]:
                q.chmod(q.stat().st_mode | 0o444 | (0o111 if q.is_dir() or q.stat().st_mode & 0o100 else 0))
    prefix.chmod(0o755)
    print(f"hub: proxy {p['proxy']}; notebooks copied to {p['notebooks']}")


