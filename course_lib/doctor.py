"""The preflight: ``python -m course_lib doctor``.

An instructor runs it on a workshop VM before class (a learner runs it in notebook 00).  It reports the
versions, the GPUs, the shared memory, a real 2-rank Gloo run, and which notebooks run fully, partly or
not at all here.  It exits non-zero, with the fix, when something a notebook needs is missing.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass

from . import course_map, hardware

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"
SHM_FAIL_MIB = 256   # Docker's default is 64 MiB: DataLoader workers and NCCL run out of it
SHM_WARN_MIB = 1024


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


WHY = {"torch": "the course", "cloudpickle": "course_lib.launch", "matplotlib": "the pictures",
       "ipywidgets": "the explorers", "numpy": "the measurements", "tqdm": "progress bars",
       "jupyterlab": "opening the notebooks", "nbval": "testing the notebooks"}
TOOLS = ("jupyterlab", "nbval")   # needed to open or test the notebooks, not by course_lib itself


def requirements() -> list[str]:
    """The names in ``course_lib/requirements.txt``: the one dependency list (pyproject.toml reads it too)."""
    from importlib.resources import files
    text = (files("course_lib") / "requirements.txt").read_text(encoding="utf-8")
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return [re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0] for line in lines if line]


def _packages() -> list[Check]:
    out = []
    for name in [*requirements(), *TOOLS]:
        try:
            mod = importlib.import_module(name)
            out.append(Check(name, OK, getattr(mod, "__version__", "installed")))
        except ImportError:
            fatal = name not in TOOLS
            out.append(Check(name, FAIL if fatal else WARN, f"missing (needed for {WHY.get(name, 'the course')})",
                             "pip install -e '.[test]'   (or: make setup)"))
    return out


def shm_mib(path: str = "/dev/shm") -> float | None:
    """Size of the shared-memory filesystem in MiB (``None`` where there is none, e.g. macOS)."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_frsize * st.f_blocks / 2**20


def _shm(size_mib: float | None) -> Check:
    if size_mib is None:
        return Check("/dev/shm", INFO, "not present on this system (fine outside Linux)")
    fix = ("in Docker: docker run --shm-size=2g ... (or --ipc=host); "
           "on Kubernetes: mount an emptyDir with medium: Memory")
    if size_mib < SHM_FAIL_MIB:
        return Check("/dev/shm", FAIL, f"{size_mib:.0f} MiB: too small for multi-process training", fix)
    if size_mib < SHM_WARN_MIB:
        return Check("/dev/shm", WARN, f"{size_mib:.0f} MiB: large data loaders may run out", fix)
    return Check("/dev/shm", OK, f"{size_mib / 1024:.1f} GiB")


def _smoke(backend: str, world_size: int, fix: str) -> Check:
    """A real all-reduce on ``world_size`` ranks: each adds its rank + 1, so every rank must end with the
    same triangle number. NCCL's tensors are on each rank's own GPU, Gloo's in CPU memory."""
    from .launch import run

    def smoke(rank, n):
        import torch
        import torch.distributed as dist

        from course_lib.hardware import rank_device
        t = torch.full((1024,), float(rank + 1), device=rank_device())
        dist.all_reduce(t)
        return t[0].item()
    name = f"{backend} {world_size}-rank all_reduce"
    try:
        out = run(smoke, world_size, backend=backend, timeout=180, show_output=False)
    except Exception as e:  # report it: the preflight must finish
        return Check(name, FAIL, f"{type(e).__name__}: {str(e).splitlines()[0]}", fix)
    want = float(sum(range(1, world_size + 1)))
    if out != [want] * world_size:
        return Check(name, FAIL, f"wrong result {out}, expected {[want] * world_size}", fix)
    terms = " + ".join(str(r + 1) for r in range(world_size))
    return Check(name, OK, f"{world_size} rank{'s' if world_size > 1 else ''} agreed on {terms} = {want:g}")


def _gloo_smoke() -> Check:
    return _smoke("gloo", 2, "check that 127.0.0.1 is reachable (loopback) and that no firewall blocks local ports")


def torch_peer_access(i: int, j: int) -> bool:
    import torch
    return torch.cuda.can_device_access_peer(i, j)


def _peer_access(n: int, can_access) -> Check:
    """Can every GPU read every other's memory directly (NVLink or PCIe peer-to-peer)?"""
    missing = [(i, j) for i in range(n) for j in range(n) if i != j and not can_access(i, j)]
    if not missing:
        return Check("GPU peer access", OK, f"all {n * (n - 1)} GPU pairs can access each other directly")
    pairs = ", ".join(f"{i}->{j}" for i, j in missing[:6]) + (" ..." if len(missing) > 6 else "")
    return Check("GPU peer access", WARN, f"no direct access for {pairs}: NCCL goes through host memory there",
                 "check `nvidia-smi topo -m`; in VMs and containers peer-to-peer is often disabled")


def _nccl_smoke(world_size: int) -> Check:
    return _smoke("nccl", world_size,
                  "rerun with NCCL_DEBUG=INFO; in Docker use --ipc=host (or --shm-size) and --gpus all")


def _slurm(found) -> Check:
    """Can the SLURM batch script be tried here? (Notebook 05 submits it where a controller answers.)
    ``found``: what :func:`course_lib.launch.slurm.probe` saw."""
    from .launch.slurm import LOCAL_CLUSTER
    if found is None:
        return Check("SLURM", INFO, "absent: notebook 05 shows the batch script's commands instead of running them; "
                     f"to try them on this machine (Debian/Ubuntu, root): {LOCAL_CLUSTER}")
    if found.name is None:
        return Check("SLURM", WARN, f"{found.version}, but no controller answers ({found.error})",
                     f"start slurmctld and slurmd, or a local cluster: {LOCAL_CLUSTER}")
    nodes = ", ".join(f"{n} {state}" for n, state in found.nodes.items()) or "no nodes"
    return Check("SLURM", OK, f"{found.version}, cluster {found.name!r}: {nodes}")


def _slurm_here() -> Check:
    # the launch package needs cloudpickle, which may be what is missing
    try:
        from .launch import slurm
    except ImportError as e:
        return Check("SLURM", INFO, f"not checked ({e})")
    return _slurm(slurm.probe())


def _hub(prefix: str, gpus: int, cores: int, jupyterhub: str | None, proxy: str | None,
         roster: dict | None) -> Check:
    """On a class's VM (``make hub``): how many learners it can serve, and whether the hub's proxy is there.
    ``prefix``: HUB_PREFIX; ``jupyterhub``: its version (None: not installed); ``proxy``: configurable-http-proxy's
    path (None: missing); ``roster``: the roster ``make hub`` wrote, as JSON (None: none yet)."""
    if jupyterhub is None and proxy is None and roster is None:
        return Check("hub", INFO, f"not set up in {prefix} (one VM for a class: make hub, README's instructor "
                     "section)")
    if gpus:
        serve = (f"{gpus} GPU{'s' if gpus != 1 else ''}: up to {gpus} learner{'s' if gpus != 1 else ''} with 1 GPU "
                 f"each" + (f", {gpus // 2} with 2" if gpus >= 4 else ""))
    else:
        n = max(1, cores // 2)
        serve = (f"no GPU: a CPU class (GPUS_PER_LEARNER=0), about {n} learner{'s' if n != 1 else ''} running "
                 f"2-rank jobs at once on {cores} cores")
    detail = [f"JupyterHub {jupyterhub}" if jupyterhub else "JupyterHub missing", serve]
    status, fix = OK, ""
    if roster:
        learners = [s for s in roster["seats"] if not s["admin"]]
        need = len(learners) * roster["gpus_per_learner"]
        detail.append(f"roster: {len(learners)} learner{'s' if len(learners) != 1 else ''} x "
                      f"{roster['gpus_per_learner']} GPUs")
        if need > gpus:
            status, fix = FAIL, f"the roster needs {need} GPUs and this machine has {gpus}: make hub LEARNERS=..."
    detail.append(f"proxy {proxy}" if proxy else "configurable-http-proxy missing")
    if not proxy or not jupyterhub:
        status, fix = FAIL, f"make hub-env HUB_PREFIX={prefix} (needs Node.js 20+ and npm for the proxy)"
    return Check("hub", status, "; ".join(detail), fix)


def _hub_here() -> Check:
    import json
    import shutil
    from pathlib import Path
    prefix = Path(os.environ.get("HUB_PREFIX") or "/opt/course-hub")
    try:
        import jupyterhub
        version = jupyterhub.__version__
    except ImportError:
        version = None
    venv = prefix / "venv" / "bin" / "jupyterhub"
    if version is None and venv.exists():   # the hub's own venv: its version from the installed metadata
        found = sorted(prefix.glob("venv/lib/python3*/site-packages/jupyterhub-*.dist-info"))
        version = (found[-1].name.split("-")[1].removesuffix(".dist") if found else "?") + f" in {prefix / 'venv'}"
    proxy = prefix / "node" / "node_modules" / ".bin" / "configurable-http-proxy"
    proxy = str(proxy) if proxy.exists() else shutil.which("configurable-http-proxy")
    try:
        roster = json.loads((prefix / "state" / "roster.json").read_text())
    except (OSError, ValueError):
        roster = None
    try:
        from .hub.roster import gpus_here
        gpus = gpus_here()
    except Exception:   # the preflight must finish
        gpus = hardware.gpu_count()
    return _hub(str(prefix), gpus, hardware.cpu_count(), version, proxy, roster)


def checks(smoke: bool = True) -> list[Check]:
    """Every check, in the order they are printed."""
    v = hardware.versions()
    out = [Check("python", OK if sys.version_info >= (3, 10) else FAIL, v["python"], "use Python 3.10 or newer")]
    out += _packages()
    b = hardware.backends()
    out.append(Check("torch.distributed gloo", OK if b["gloo"] else FAIL,
                     "available" if b["gloo"] else "missing", "install an official torch build (pip install torch)"))
    gpu_list = hardware.gpus()
    if gpu_list:
        out.append(Check("GPUs", OK, f"{len(gpu_list)}: " + "; ".join(map(str, gpu_list))))
        out.append(Check("CUDA / NCCL", OK if b["nccl"] else WARN, f"CUDA {v['cuda']}, NCCL {v['nccl']}",
                         "" if b["nccl"] else "this torch has no NCCL: GPU ranks will use Gloo"))
        if len(gpu_list) > 1:
            out.append(_peer_access(len(gpu_list), torch_peer_access))
        if b["nccl"] and smoke:
            out.append(_nccl_smoke(min(2, len(gpu_list))))
    else:
        out.append(Check("GPUs", INFO, "none: every notebook runs on the CPU, GPU cells fall back and say so"))
    out.append(Check("CPU cores", OK if hardware.cpu_count() >= 2 else WARN, str(hardware.cpu_count()),
                     "2+ cores make the multi-rank timings meaningful"))
    out.append(_shm(shm_mib()))
    out.append(_notebooks())
    out.append(_slurm_here())
    out.append(_hub_here())
    if smoke and b["gloo"]:
        out.append(_gloo_smoke())
    return out


def notebook_table(gpu_count: int | None = None, failed: bool = False) -> list[tuple[str, str]]:
    """(notebook, 'full' / 'partial' / 'no' [+ why]) for this machine."""
    n = hardware.gpu_count() if gpu_count is None else gpu_count
    rows = []
    for nb in course_map.NOTEBOOKS:
        if failed:
            rows.append((nb.file, "no (fix the FAIL lines above first)"))
        else:
            s = course_map.support(nb, n)
            gpus = f"{nb.gpus_for_all} GPU" + ("" if nb.gpus_for_all == 1 else "s")
            why = {"full": "", "partial": f": cells that need {gpus} fall back to the CPU"}.get(
                s, f" (its cells need {gpus})")
            rows.append((nb.file, s + why))
    return rows


def _notebooks() -> Check:
    found = course_map.notebook_dir()
    if found:
        return Check("notebooks", OK, f"in {found}")
    looked = ", ".join(map(str, course_map.searched()))
    return Check("notebooks", WARN, f"not found (looked in: {looked})",
                 "run from the course's folder (the one holding notebooks/), "
                 "or set COURSE_NOTEBOOKS=/path/to/notebooks")


def report(smoke: bool = True) -> tuple[str, bool]:
    """The preflight's text, and whether everything a notebook needs is present."""
    results = checks(smoke)
    ok = all(c.status != FAIL for c in results)
    lines = ["course preflight", "================"]
    for c in results:
        lines.append(f"[{c.status:>4}] {c.name}: {c.detail}")
        if c.fix and c.status in (WARN, FAIL):
            lines.append(f"       fix: {c.fix}")
    lines += ["", "notebooks on this machine:"]
    lines += [f"  {name:40} {status}" for name, status in notebook_table(failed=not ok)]
    lines.append("")
    lines.append("ready: every notebook can run here" if ok else "NOT READY: fix the FAIL lines above")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m course_lib doctor", description=__doc__.splitlines()[0])
    p.add_argument("--no-smoke", action="store_true", help="skip the 2-rank Gloo run")
    args = p.parse_args(argv)
    text, ok = report(smoke=not args.no_smoke)
    print(text)
    return 0 if ok else 1
