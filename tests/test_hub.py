"""`make hub` as a class meets it: JupyterHub on one machine, two learners, each with their own user, GPUs, ports
and copy of the notebooks; started through the hub's REST API, then logged in through headless Chromium.

Needs root (it creates the users hubtest1, hubtest2, hubtestadmin and removes them after), Linux, and the hub's
environment built by ``make hub-env HUB_PREFIX=$COURSE_HUB_PREFIX`` (default /var/tmp/course-hub-test): a venv of a
system Python with JupyterHub, course_lib installed non-editable, and configurable-http-proxy from npm.  Skipped
without them, unless ``COURSE_HUB=required`` (``.ci/run`` sets it and builds the environment), which makes their
absence a failure.  The browser part also needs Chromium and Playwright (see tests/browser).  The machine has no
GPU: the roster plans for 4 (``--gpus 4``), so the test sees each learner's own ``CUDA_VISIBLE_DEVICES``; the
learners' port blocks (24000-24299) lie below the ephemeral range, where no other test's port (the OS's pick)
can fall.
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

from course_lib.hub import system
from course_lib.launch import free_port

REQUIRED = os.environ.get("COURSE_HUB") == "required"
BROWSER_REQUIRED = os.environ.get("COURSE_BROWSER_TEST") == "required"
PREFIX = Path(os.environ.get("COURSE_HUB_PREFIX", "/var/tmp/course-hub-test"))
HUB_PY = PREFIX / "venv" / "bin" / "python"
LEARNERS, ADMIN = ["hubtest1", "hubtest2"], "hubtestadmin"
SEATS = {"hubtest1": ("0,1", 24000), "hubtest2": ("2,3", 24100)}
MEET = Path("/tmp/course-hub-test-meet")   # where the two learners' Gloo jobs wait for each other
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LAB_SETTINGS = {"@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                                   "checkForUpdates": False},
                "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"}}


def missing() -> list[str]:
    out = []
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        out.append("root on Linux (it creates users)")
    if not shutil.which("useradd") or not shutil.which("runuser"):
        out.append("useradd and runuser")
    if not HUB_PY.exists():
        out.append(f"the hub's environment in {PREFIX} (make hub-env HUB_PREFIX={PREFIX})")
    elif not (PREFIX / "node" / "node_modules" / ".bin" / "configurable-http-proxy").exists():
        out.append(f"configurable-http-proxy in {PREFIX}/node (make hub-env HUB_PREFIX={PREFIX})")
    return out


class Hub:
    def __init__(self, port: int, token: str, passwords: tuple[str, str]):
        self.port, self.token, self.passwords = port, token, passwords
        self.base = f"http://127.0.0.1:{port}"

    def api(self, path: str, method: str = "GET", body=None, prefix: str = "/hub/api"):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base}{prefix}/{path}", data=data, method=method,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def contents(self, user: str, path: str, method: str = "GET", body=None):
        return self.api(f"contents/{path}", method, body, prefix=f"/user/{user}/api")

    def log(self) -> str:
        return (PREFIX / "state" / "hub.log").read_text(errors="replace")[-4000:]


def cli(*args, env=None, timeout=240):
    return subprocess.run([str(HUB_PY), "-m", "course_lib.hub", *args, "--prefix", str(PREFIX)], cwd="/",
                          capture_output=True, text=True, timeout=timeout, env=env)


def hub_processes() -> list:
    uids = {pwd.getpwnam(n).pw_uid for n in [*LEARNERS, ADMIN] if system.user_exists(n)}
    return [p for p in system.processes(uids, (str(PREFIX),)) if system._alive(p[0])]


@pytest.fixture(scope="module")
def hub():
    gaps = missing()
    if gaps:
        (pytest.fail if REQUIRED else pytest.skip)(f"the hub test needs {'; '.join(gaps)}")
    there = [n for n in [*LEARNERS, ADMIN] if system.user_exists(n)]
    created = (PREFIX / "state" / system.CREATED)
    if there and not (created.exists() and set(there) <= set(created.read_text().split())):
        pytest.fail(f"users {there} exist and this test did not create them: it will not touch them")
    if there:   # left by an interrupted run of this test
        cli("stop", timeout=120)
        cli("remove-users", timeout=120)
    passwords = ("learners-" + os.urandom(6).hex(), "instructor-" + os.urandom(16).hex())
    token = os.urandom(24).hex()
    env = {**os.environ, "COURSE_HUB_PASSWORD": passwords[0], "COURSE_HUB_ADMIN_PASSWORD": passwords[1],
           "COURSE_HUB_API_TOKEN": token}
    port = free_port()
    shutil.rmtree(MEET, ignore_errors=True)
    MEET.mkdir(mode=0o1777)
    MEET.chmod(0o1777)
    up = cli("up", "--names", " ".join(LEARNERS), "--admin", ADMIN, "--gpus", "4", "--gpus-per-learner", "2",
             "--port", str(port), "--hub-api-port", str(free_port()), "--proxy-api-port", str(free_port()),
             "--port-base", "24000", env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"ssh -N -L {port}:127.0.0.1:{port}" in up.stdout
        yield Hub(port, token, passwords)
    finally:
        cli("stop", timeout=180)
        cli("remove-users", timeout=120)
        shutil.rmtree(MEET, ignore_errors=True)


def start_servers(hub: Hub, timeout: float = 180) -> dict[str, dict]:
    for name in LEARNERS:
        status, body = hub.api(f"users/{name}/server", "POST")
        assert status in (201, 202, 400), (status, body, hub.log())   # 400: already running
    deadline, ready = time.monotonic() + timeout, {}
    while len(ready) < len(LEARNERS):
        for name in LEARNERS:
            status, user = hub.api(f"users/{name}")
            server = (user or {}).get("servers", {}).get("")
            if server and server.get("ready"):
                ready[name] = server
        assert time.monotonic() < deadline, f"servers not ready: {ready.keys()}\n{hub.log()}"
        time.sleep(0.5)
    return ready


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def uid_of(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Uid:"))
    return int(line.split()[1])


def test_two_learners_started_through_the_rest_api_run_as_themselves_with_their_own_seat(hub):
    servers = start_servers(hub)
    for name, (gpus, master_port) in SEATS.items():
        pid = servers[name]["state"]["pid"]
        assert uid_of(pid) == pwd.getpwnam(name).pw_uid, f"{name}'s server runs as uid {uid_of(pid)}"
        env = environ(pid)
        assert env["CUDA_VISIBLE_DEVICES"] == gpus and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert env["MASTER_PORT"] == str(master_port)
        assert env["COURSE_PORTS"] == f"{master_port}-{master_port + 99}"
        copy = Path(pwd.getpwnam(name).pw_dir) / "course"
        assert (copy / "00_welcome.ipynb").stat().st_uid == pwd.getpwnam(name).pw_uid
        assert sorted(p.name for p in copy.glob("*.ipynb")) == sorted(p.name for p in
                                                                     (PREFIX / "notebooks").glob("*.ipynb"))
    status, _ = hub.api("users/mallory/server", "POST")
    assert status == 404, "a user not on the roster got a server"
    assert hub.api(f"users/{ADMIN}")[1]["admin"] is True                 # the instructor administers the hub
    assert [hub.api(f"users/{n}")[1]["admin"] for n in LEARNERS] == [False, False]


def test_one_learners_edit_leaves_the_others_copy_alone_and_the_other_cannot_read_it(hub):
    start_servers(hub)
    name = "00_welcome.ipynb"
    status, model = hub.contents("hubtest1", name)
    assert status == 200, model
    nb = model["content"]
    nb["cells"].append({"cell_type": "markdown", "metadata": {}, "source": "hubtest1 was here", "id": "hubtest1"})
    status, _ = hub.contents("hubtest1", name, "PUT", {"type": "notebook", "format": "json", "content": nb})
    assert status == 200
    mine = Path(pwd.getpwnam("hubtest1").pw_dir) / "course" / name
    assert "hubtest1 was here" in mine.read_text()
    status, theirs = hub.contents("hubtest2", name)
    assert status == 200 and "hubtest1 was here" not in json.dumps(theirs["content"])
    theirs_on_disk = Path(pwd.getpwnam("hubtest2").pw_dir) / "course" / name
    assert theirs_on_disk.read_bytes() == (PREFIX / "notebooks" / name).read_bytes()   # as it was copied
    peek = subprocess.run(["runuser", "-u", "hubtest2", "--", "cat", str(mine)], capture_output=True, text=True)
    assert peek.returncode != 0 and "Permission denied" in peek.stderr, peek
    # the copy is made once: a later start keeps the learner's work
    path, made = system.copy_notebooks(PREFIX / "notebooks", "hubtest1")
    assert not made and "hubtest1 was here" in mine.read_text()


PROBE_CELLS = [
    "import json, os, torch\n"
    "print('SEAT ' + json.dumps({'user': os.environ['USER'], 'gpus': os.environ['CUDA_VISIBLE_DEVICES'],\n"
    "      'master_port': os.environ['MASTER_PORT'], 'ports': os.environ['COURSE_PORTS']}))",
    # A 2-rank Gloo job on the learner's MASTER_PORT. Rank 0 waits until the other learner's job is up too,
    # so both jobs hold their ports at the same time: a clash would fail one of them.
    "from course_lib.launch import run\n"
    "def job(rank, world_size, port, meet, me, other):\n"
    "    import os, time, torch, torch.distributed as dist\n"
    "    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world_size)\n"
    "    if rank == 0:\n"
    "        open(os.path.join(meet, me), 'w').close()\n"
    "        deadline = time.time() + 150\n"
    "        while not os.path.exists(os.path.join(meet, other)) and time.time() < deadline:\n"
    "            time.sleep(0.2)\n"
    "    met = os.path.exists(os.path.join(meet, other))\n"
    "    t = torch.tensor([float(rank + 1)])\n"
    "    dist.all_reduce(t)\n"
    "    dist.barrier()\n"
    "    dist.destroy_process_group()\n"
    "    return {'port': port, 'sum': t.item(), 'met': met}\n"
    "other = {'hubtest1': 'hubtest2', 'hubtest2': 'hubtest1'}[os.environ['USER']]\n"
    f"out = run(job, 2, int(os.environ['MASTER_PORT']), {str(MEET)!r}, os.environ['USER'], other,\n"
    "          init=False, backend='gloo', timeout=240)\n"
    "print('GLOO ' + json.dumps(out))",
]


@pytest.fixture(scope="module")
def chromium():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    sys.path.insert(0, str(Path(__file__).parent / "browser"))
    from test_lab import chromium_path
    gaps = [w for w, ok in (("chromium", chromium_path()), ("playwright", sync_playwright)) if not ok]
    if gaps:
        (pytest.fail if (REQUIRED or BROWSER_REQUIRED) else pytest.skip)(f"the hub's browser test needs {gaps}")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def login(browser, hub: Hub, user: str, password: str):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(f"{hub.base}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", password)
    page.click("#login_submit")
    page.wait_for_load_state()
    return context, page


def login_error(page) -> str:
    page.wait_for_selector(".login_error, #login_error, .alert-danger", timeout=30_000)
    return page.locator(".login_error, #login_error, .alert-danger").first.inner_text()


@pytest.mark.browser
def test_a_wrong_password_and_a_name_not_on_the_roster_are_refused_with_a_message(hub, chromium):
    context, page = login(chromium, hub, "hubtest1", "not-the-password")
    assert "Invalid username or password" in login_error(page)
    context.close()
    context, page = login(chromium, hub, "mallory", hub.passwords[0])
    assert "'mallory' is not on this class's roster" in login_error(page)
    context.close()
    status, _ = hub.api("users/mallory")
    assert status == 404, "a refused name was added to the hub"


def wait_kernel_idle(hub: Hub, user: str, path: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, sessions = hub.api("sessions", prefix=f"/user/{user}/api")
        s = next((s for s in sessions or [] if s["path"] == path), None) if status == 200 else None
        if s and s["kernel"]["execution_state"] == "idle":
            return
        time.sleep(0.5)
    raise AssertionError(f"{user}'s kernel for {path} never became idle")


@pytest.mark.browser
def test_two_learners_in_the_browser_see_their_own_gpus_and_port_and_run_gloo_jobs_at_once(hub, chromium):
    sys.path.insert(0, str(Path(__file__).parent / "browser"))
    from labpage import run_all_from_menu
    start_servers(hub)
    for f in MEET.iterdir():
        f.unlink()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in PROBE_CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    pages = {}
    try:
        for user in LEARNERS:
            home = pwd.getpwnam(user)
            for name, value in LAB_SETTINGS.items():     # no news pop-up over the menu
                path = Path(home.pw_dir) / ".jupyter/lab/user-settings" / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(value))
                for q in [path, *path.parents]:
                    if q == Path(home.pw_dir):
                        break
                    os.chown(q, home.pw_uid, home.pw_gid)
            status, _ = hub.contents(user, "probe.ipynb", "PUT",
                                     {"type": "notebook", "format": "json", "content": json.loads(nbformat.writes(nb))})
            assert status in (200, 201)
            context, page = login(chromium, hub, user, hub.passwords[0])
            page.wait_for_url(f"**/user/{user}/lab**", timeout=90_000)
            page.goto(f"{hub.base}/user/{user}/lab/tree/probe.ipynb")
            page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=90_000)
            wait_kernel_idle(hub, user, "probe.ipynb")
            pages[user] = (context, page)
        for user in LEARNERS:                      # both jobs start before either is looked at
            run_all_from_menu(pages[user][1])
        results = {}
        for user in LEARNERS:
            page = pages[user][1]
            page.wait_for_function("() => [...document.querySelectorAll('.jp-OutputArea-output')].some("
                                   "e => /GLOO |Error|Traceback/.test(e.innerText))", timeout=240_000)
            text = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
            lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith(("SEAT ", "GLOO "))}
            assert "GLOO" in lines, f"{user}'s notebook:\n{text}"
            results[user] = lines
    finally:
        for context, _ in pages.values():
            context.close()
    for user, (gpus, port) in SEATS.items():
        seat, gloo = results[user]["SEAT"], results[user]["GLOO"]
        assert seat == {"user": user, "gpus": gpus, "master_port": str(port), "ports": f"{port}-{port + 99}"}
        assert [r["port"] for r in gloo] == [port, port] and [r["sum"] for r in gloo] == [3.0, 3.0]
        assert gloo[0]["met"], f"{user}'s job finished before the other's started"
    assert {f.name for f in MEET.iterdir()} == set(LEARNERS)


def test_the_hub_stops_with_nothing_left(hub):
    assert hub_processes(), "the hub's processes were not found while it runs"
    out = cli("stop", timeout=180)
    assert out.returncode == 0 and "hub: stopped" in out.stdout, out.stdout + out.stderr
    assert hub_processes() == []
    with socket.socket() as s:                 # nobody listens on the hub's port any more (the browser's closed
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # connections may linger in TIME_WAIT)
        s.bind(("127.0.0.1", hub.port))


def test_too_many_learners_for_the_gpus_is_refused_before_anything_changes():
    if missing():
        (pytest.fail if REQUIRED else pytest.skip)(f"the hub test needs {'; '.join(missing())}")
    out = cli("up", "--names", "hubtestx1 hubtestx2 hubtestx3", "--gpus", "4", "--gpus-per-learner", "2")
    assert out.returncode == 2 and "3 learners x 2 GPUs need 6 GPUs; this machine has 4" in out.stderr
    assert not system.user_exists("hubtestx1")
