"""``python -m course_lib.hub``: one VM, one JupyterHub, a seat (GPUs, ports, a home with the notebooks) per learner.

  prepare       the proxy (npm) and the notebooks every learner gets a copy of, under the prefix
  roster        print the roster a class would get (nothing changes)
  up            roster + users + start: what `make hub` runs (root)
  stop          stop the hub, every learner's server and kernel, and check nothing is left (root)
  status        is it running, and who sits where
  remove-users  remove the users the hub created, with their homes (their work!) (root)

Run from the hub's environment (``make hub-env`` builds it under ``HUB_PREFIX``, default /opt/course-hub).
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from . import system
from .config import SETTINGS
from .install import HubError, paths, prepare
from .roster import ADMIN, PORT_BASE, PORT_BLOCK, Roster, RosterError, plan

MIN_USER_PASSWORD, MIN_ADMIN_PASSWORD = 8, 32   # what JupyterHub's SharedPasswordAuthenticator accepts


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def hub_pid(state: Path) -> int | None:
    try:
        pid = int((state / "jupyterhub.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if system._alive(pid) else None


def check_passwords(env: dict) -> None:
    user, admin = env.get("COURSE_HUB_PASSWORD", ""), env.get("COURSE_HUB_ADMIN_PASSWORD", "")
    if len(user) < MIN_USER_PASSWORD:
        raise HubError(f"set COURSE_HUB_PASSWORD (the learners' shared password, {MIN_USER_PASSWORD}+ characters) "
                       "in the environment, e.g.  export COURSE_HUB_PASSWORD=$(openssl rand -hex 6)")
    if len(admin) < MIN_ADMIN_PASSWORD:
        raise HubError(f"set COURSE_HUB_ADMIN_PASSWORD (the instructor's, {MIN_ADMIN_PASSWORD}+ characters: it "
                       "opens every server), e.g.  export COURSE_HUB_ADMIN_PASSWORD=$(openssl rand -hex 16)")
    if user == admin:
        raise HubError("COURSE_HUB_PASSWORD and COURSE_HUB_ADMIN_PASSWORD must differ")


def start(prefix: Path, port: int, hub_api_port: int, proxy_api_port: int, proxy: str | None = None,
          timeout: float = 120, extra: dict | None = None) -> int:
    p = paths(prefix)
    state = p["state"]
    system.need_root("starting the hub")
    if hub_pid(state):
        raise HubError(f"already running (pid {hub_pid(state)}): make hub-stop first")
    check_passwords(os.environ)
    for what, q in (("hub", port), ("hub API", hub_api_port), ("proxy API", proxy_api_port)):
        if not port_free(q):
            raise HubError(f"port {q} ({what}) is taken on 127.0.0.1: choose another (HUB_PORT=...)")
    proxy = proxy or str(p["proxy"])
    for what, q in (("configurable-http-proxy", proxy), ("jupyterhub-singleuser", p["singleuser"])):
        if not Path(q).exists():
            raise HubError(f"{what} not found at {q}: run make hub-env first")
    (state / SETTINGS).write_text(json.dumps({
        "port": port, "hub_api_port": hub_api_port, "proxy_api_port": proxy_api_port, "proxy": proxy,
        "notebooks": str(p["notebooks"]), "singleuser": str(p["singleuser"]), **(extra or {})}, indent=1) + "\n")
    config = Path(__file__).with_name("jupyterhub_config.py")
    log = open(state / "hub.log", "ab")
    proc = subprocess.Popen([str(p["jupyterhub"]), "-f", str(config)], cwd=state, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "COURSE_HUB_STATE": str(state)})
    url = f"http://127.0.0.1:{port}/hub/api"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    break
        except (OSError, urllib.error.URLError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(prefix, quiet=True)
            tail = (state / "hub.log").read_text(errors="replace")[-3000:]
            raise HubError(f"JupyterHub did not answer on {url} within {timeout:.0f} s; its log ends:\n{tail}")
        time.sleep(0.3)
    return proc.pid


def stop(prefix: Path, quiet: bool = False, grace: float = 60) -> list[str]:
    """Stop the hub (it stops every learner's server and the proxy), then end anything of it still running.
    Returns what was left and had to be ended (empty when the hub cleaned up after itself)."""
    p = paths(prefix)
    state = p["state"]
    pid = hub_pid(state)
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while system._alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    uids = set()
    if (state / "roster.json").exists():
        for seat in Roster.load(state / "roster.json").seats:
            try:
                uids.add(pwd.getpwnam(seat.name).pw_uid)
            except KeyError:
                pass
    marks = (str(state), str(p["proxy"]), str(p["singleuser"]), str(p["jupyterhub"]))
    deadline = time.monotonic() + 15     # kernels whose server has gone notice it within a few seconds, and exit
    while system.processes(uids - {0}, marks) and time.monotonic() < deadline:
        time.sleep(0.3)
    left = [f"{pid} (uid {uid}): {cmd.strip()[:120]}" for pid, uid, cmd in system.processes(uids - {0}, marks)]
    system.end_processes(uids - {0}, marks, grace=10)
    still = system.processes(uids - {0}, marks)
    if still:
        raise HubError("these would not stop: " + "; ".join(f"{q} {c[:80]}" for q, _, c in still))
    if not quiet:
        print(f"hub: {'stopped (pid ' + str(pid) + ')' if pid else 'was not running'}"
              + (f"; ended {len(left)} process(es) it left: " + "; ".join(left) if left else "; nothing left running"))
    return left


def forward_line(port: int) -> str:
    me = os.environ.get("SUDO_USER") or "<you>"
    return (f"each learner, on their laptop:  ssh -N -L {port}:127.0.0.1:{port} {me}@<this VM's address>   "
            f"then open http://localhost:{port}  (the hub listens on 127.0.0.1 only)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.hub", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("command", choices=["prepare", "roster", "up", "stop", "status", "remove-users"])
    ap.add_argument("--prefix", type=Path, default=Path(os.environ.get("HUB_PREFIX") or "/opt/course-hub"))
    ap.add_argument("--learners", type=int, default=None)
    ap.add_argument("--gpus-per-learner", type=lambda s: int(s) if s != "" else None, default=None)
    ap.add_argument("--gpus", type=int, default=None, help="plan for this many GPUs (default: nvidia-smi's count)")
    ap.add_argument("--names", default="", help="the learners' user names, space separated")
    ap.add_argument("--prefix-name", default="learner", help="names learner1..N when --names is not given")
    ap.add_argument("--admin", default=ADMIN)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--hub-api-port", type=int, default=8081)
    ap.add_argument("--proxy-api-port", type=int, default=8001)
    ap.add_argument("--port-base", type=int, default=PORT_BASE)
    ap.add_argument("--port-block", type=int, default=PORT_BLOCK)
    ap.add_argument("--notebooks", type=Path, default=Path("notebooks"))
    ap.add_argument("--proxy-version", default="5")
    ap.add_argument("--proxy", default=os.environ.get("HUB_PROXY") or None)
    ap.add_argument("--spawner", choices=["local", "slurm"], default="local",
                    help="local: servers on this VM; slurm: each server a batch job (batchspawner)")
    ap.add_argument("--partition", default="", help="the SLURM partition (--spawner slurm)")
    a = ap.parse_args(argv)
    prefix = a.prefix.resolve()
    p = paths(prefix)
    try:
        if a.command == "prepare":
            prefix.mkdir(parents=True, exist_ok=True)
            prepare(prefix, a.notebooks, a.proxy_version)
            return 0
        if a.command in ("roster", "up"):
            learners = a.learners if a.learners is not None else 0 if a.names else 2
            gpus, per = a.gpus, a.gpus_per_learner
            if a.spawner == "slurm":    # the cluster's nodes hold the GPUs (--gres), not this machine
                per = per or 0
                gpus = gpus if gpus is not None else (learners or len(a.names.split())) * per
            roster = plan(learners, per, gpus, a.names.split() or None, a.prefix_name, a.admin or None,
                          a.port_base, a.port_block)
            print(f"hub: {len(roster.learners)} learners, {roster.gpus_per_learner} GPU(s) each, "
                  f"on {roster.gpus} GPU(s)")
            print(roster.table())
            if a.command == "roster":
                return 0
            system.need_root("make hub")
            check_passwords(os.environ)          # before anything changes on the machine
            if hub_pid(p["state"]):
                raise HubError(f"already running (pid {hub_pid(p['state'])}): make hub-stop first")
            p["state"].mkdir(parents=True, exist_ok=True)
            p["state"].chmod(0o700)     # the database and the cookie secret
            roster.save(p["state"] / "roster.json")
            made = system.create_users(roster.names, p["state"])
            if made:
                print(f"hub: created users {' '.join(made)} (homes 0700)")
            pid = start(prefix, a.port, a.hub_api_port, a.proxy_api_port, a.proxy,
                        extra={"spawner": a.spawner, "partition": a.partition, "port_base": a.port_base})
            print(f"hub: running (pid {pid}) on http://127.0.0.1:{a.port} (this machine only); log "
                  f"{p['state'] / 'hub.log'}")
            print(forward_line(a.port))
            print(f"learners log in with their name and $COURSE_HUB_PASSWORD; {a.admin} with "
                  "$COURSE_HUB_ADMIN_PASSWORD (admin page: /hub/admin). Stop: make hub-stop")
            return 0
        if a.command == "stop":
            system.need_root("make hub-stop")
            stop(prefix)
            return 0
        if a.command == "status":
            pid = hub_pid(p["state"]) if os.access(p["state"], os.R_OK) else None
            print(f"hub: {'running, pid ' + str(pid) if pid else 'not running'}")
            if os.access(p["state"] / "roster.json", os.R_OK):
                print(Roster.load(p["state"] / "roster.json").table())
            return 0
        if a.command == "remove-users":
            system.need_root("removing users")
            if hub_pid(p["state"]):
                raise HubError("the hub is running: make hub-stop first")
            gone = system.remove_users(p["state"])
            print(f"hub: removed {' '.join(gone) if gone else 'no users (it created none)'}")
            return 0
    except RosterError as e:
        print(f"hub: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
