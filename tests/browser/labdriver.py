"""A JupyterLab server for the browser test, which notebooks to open in it, and a side door into their kernels.

The server serves a temporary copy of the notebooks (running them must not write outputs into the repository),
with `course_lib` importable from the checkout, fresh settings (every cell in the page, no news pop-up) and a
runtime folder of its own, whose kernel connection files let `KernelProbe` ask a notebook's kernel what it holds.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat

from course_lib.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("kernel_probe.py")
SETTINGS = {  # JupyterLab user settings: all cells in the page (no virtual scrolling), no pop-ups
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                       "checkForUpdates": False},
}


def widget_classes(package: Path = ROOT / "course_lib") -> set[str]:
    """Names of the classes defined in the course_lib modules that import ipywidgets."""
    names = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if "ipywidgets" in imported:
            names |= {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    return names


def widget_notebooks(folder: Path = ROOT / "notebooks") -> list[Path]:
    """The notebooks whose code uses a course_lib widget class or ipywidgets itself: the ones to open."""
    pattern = re.compile(r"\b({}|ipywidgets)\b".format("|".join(sorted(widget_classes()))))
    found = []
    for path in sorted(folder.glob("*.ipynb")):
        code = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        if pattern.search(code):
            found.append(path)
    return found


def _get(url: str, timeout: float = 5):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.status, reply.read()


class JupyterLab:
    """``python -m jupyter lab`` on a free port over a copy of ``notebooks``; ``stop()`` ends it and its kernels."""

    def __init__(self, workdir: Path, notebooks: list[Path], start_timeout: float = 60):
        self.dir, self.token, self.port = workdir / "served", "browser-test", free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.runtime = workdir / "runtime"
        self.dir.mkdir(parents=True)
        for nb in notebooks:
            shutil.copy(nb, self.dir / nb.name)
        for name, value in SETTINGS.items():
            path = workdir / "settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(workdir / "settings"),
               "JUPYTERLAB_WORKSPACES_DIR": str(workdir / "workspaces"), "JUPYTER_RUNTIME_DIR": str(self.runtime),
               "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(
                   os.pathsep))])}
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.dir}"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log = workdir / "jupyterlab.log"
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                self.api("status")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"JupyterLab did not start; its log:\n{self.log.read_text()[-3000:]}") from None
                time.sleep(0.2)

    def api(self, path: str, method: str = "GET"):
        request = urllib.request.Request(f"{self.base}/api/{path}?token={self.token}", method=method)
        with urllib.request.urlopen(request, timeout=10) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    def url(self, notebook: str) -> str:
        """The notebook in a workspace of its own (no tabs restored from an earlier one)."""
        return f"{self.base}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}?token={self.token}"

    def session(self, notebook: str) -> dict | None:
        return next((s for s in self.api("sessions") if s["path"] == notebook), None)

    def wait_idle(self, notebook: str, timeout: float, settle: float = 1.0) -> None:
        """Until the notebook's kernel has been idle for ``settle`` seconds."""
        deadline, idle_since = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            s = self.session(notebook)
            if s and s["kernel"]["execution_state"] == "idle":
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= settle:
                    return
            else:
                idle_since = None
            time.sleep(0.2)
        raise TimeoutError(f"{notebook}: the kernel was still busy (or never started) after {timeout:.0f} s")

    def shutdown_kernel(self, notebook: str) -> None:
        s = self.session(notebook)
        if s:
            self.api(f"sessions/{s['id']}", method="DELETE")

    def stop(self) -> None:
        """SIGTERM to JupyterLab (it shuts its kernels down), then SIGKILL to what is left of its group."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class KernelProbe:
    """A second client of a notebook's kernel (through its connection file) that runs `kernel_probe` in it."""

    def __init__(self, lab: JupyterLab, notebook: str):
        from jupyter_client import BlockingKernelClient

        kernel_id = lab.session(notebook)["kernel"]["id"]
        self.client = BlockingKernelClient(connection_file=str(lab.runtime / f"kernel-{kernel_id}.json"))
        self.client.load_connection_file()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=30)
        self.run(f"import importlib.util as _u; _s = _u.spec_from_file_location('kernel_probe', {str(PROBE)!r}); "
                 "__browser_probe__ = _u.module_from_spec(_s); _s.loader.exec_module(__browser_probe__); "
                 "__browser_probe__.install(); del _u, _s")

    def run(self, code: str, timeout: float = 30) -> str:
        """Run ``code`` in the kernel; what it printed. Raises with the traceback if it failed."""
        printed, errors = [], []

        def hook(msg):
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                errors.append("\n".join(msg["content"]["traceback"]))

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook, store_history=False)
        if reply["content"]["status"] != "ok" or errors:
            raise RuntimeError(f"the probe failed in the kernel:\n{''.join(errors)}")
        return "".join(printed)

    def json(self, call: str):
        return json.loads(self.run(f"__browser_probe__.{call}").strip().splitlines()[-1])

    def close(self) -> None:
        self.client.stop_channels()
