"""Who gets what on a shared VM: each learner's GPUs and port block, planned before anyone logs in.

A *seat* is one learner's share of the machine: a set of GPUs (``CUDA_VISIBLE_DEVICES``) and a block of TCP ports
(the first is their ``MASTER_PORT``), both disjoint from every other seat's.  The blocks lie below the kernel's
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), where the OS never hands out a port on its own, so a
learner's rendezvous port cannot be taken by someone's outgoing connection.

On a machine without GPUs, ``gpus_per_learner=0`` gives every learner the CPU (``CUDA_VISIBLE_DEVICES`` empty):
the class still gets one JupyterLab, one home and one port block each.  Plain Python, no JupyterHub needed.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,30}$")   # what useradd accepts everywhere (lower case, no dots)
PORT_BASE, PORT_BLOCK = 20000, 100
ADMIN = "instructor"


class RosterError(ValueError):
    """A roster the machine cannot serve, or a name it does not know; the message says what to change."""


@dataclass(frozen=True)
class Seat:
    name: str
    gpus: tuple[int, ...]
    first_port: int
    last_port: int
    admin: bool = False

    @property
    def master_port(self) -> int:
        return self.first_port

    def env(self) -> dict[str, str]:
        """What the learner's server (and so every kernel and terminal in it) starts with."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.master_port),
                "COURSE_PORTS": f"{self.first_port}-{self.last_port}"}


@dataclass
class Roster:
    gpus: int                       # GPUs on the machine
    gpus_per_learner: int
    seats: list[Seat] = field(default_factory=list)

    @property
    def learners(self) -> list[Seat]:
        return [s for s in self.seats if not s.admin]

    @property
    def admin(self) -> Seat | None:
        return next((s for s in self.seats if s.admin), None)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.seats]

    def seat(self, name: str) -> Seat:
        for s in self.seats:
            if s.name == name:
                return s
        raise RosterError(f"{name!r} is not on the roster ({', '.join(self.names)}): "
                          "ask the instructor to add you (make hub LEARNERS=... or LEARNER_NAMES=...)")

    def to_json(self) -> str:
        return json.dumps({"gpus": self.gpus, "gpus_per_learner": self.gpus_per_learner,
                           "seats": [asdict(s) for s in self.seats]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Roster:
        d = json.loads(text)
        return cls(d["gpus"], d["gpus_per_learner"],
                   [Seat(s["name"], tuple(s["gpus"]), s["first_port"], s["last_port"], s["admin"])
                    for s in d["seats"]])

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> Roster:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def table(self) -> str:
        rows = [f"  {'user':20} {'CUDA_VISIBLE_DEVICES':22} {'MASTER_PORT':12} ports"]
        for s in self.seats:
            gpus = ",".join(map(str, s.gpus)) or "(none: CPU)"
            rows.append(f"  {s.name + (' (admin)' if s.admin else ''):20} {gpus:22} {s.master_port:<12} "
                        f"{s.first_port}-{s.last_port}")
        return "\n".join(rows)


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port the kernel hands out on its own (32768 on Linux by default)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def gpus_here() -> int:
    """GPUs on this machine: ``nvidia-smi -L`` (every GPU, whatever CUDA_VISIBLE_DEVICES says), else torch's count."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return sum(line.startswith("GPU ") for line in out.stdout.splitlines())
        except (OSError, subprocess.TimeoutExpired):
            pass
    from ..hardware import gpu_count
    return gpu_count()


def plan(learners: int, gpus_per_learner: int | None = None, gpus: int | None = None, names: list[str] | None = None,
         prefix: str = "learner", admin: str | None = ADMIN, port_base: int = PORT_BASE,
         port_block: int = PORT_BLOCK, port_limit: int | None = None) -> Roster:
    """The roster for ``learners`` learners with ``gpus_per_learner`` GPUs each on a machine with ``gpus`` GPUs.

    ``gpus_per_learner=None``: as many as divide evenly (0 on a CPU machine: a CPU class).  Refuses, with what
    would fit, a roster the GPUs or the ports below the ephemeral range cannot serve.  Names: ``names`` or
    ``prefix1 .. prefixN``; ``admin`` (the instructor) gets the GPUs no learner has, and the next port block.
    """
    gpus = gpus_here() if gpus is None else gpus
    if names:
        learners = len(names) if learners in (None, 0) else learners
        if len(names) != learners:
            raise RosterError(f"LEARNERS={learners} but {len(names)} names were given ({' '.join(names)})")
    if not isinstance(learners, int) or learners < 1:
        raise RosterError(f"LEARNERS must be a whole number of learners, 1 or more (got {learners!r})")
    if gpus_per_learner is None:
        gpus_per_learner = gpus // learners
        if gpus and not gpus_per_learner:
            raise RosterError(f"{learners} learners but only {gpus} GPU{'s' if gpus != 1 else ''}: "
                              f"serve at most {gpus} with a GPU each, or say GPUS_PER_LEARNER=0 for a CPU class")
    if gpus_per_learner < 0:
        raise RosterError(f"GPUS_PER_LEARNER must be 0 (CPU only) or more (got {gpus_per_learner})")
    need = learners * gpus_per_learner
    if need > gpus:
        fits = gpus // gpus_per_learner
        hint = (f"serve {fits} learner{'s' if fits != 1 else ''} with {gpus_per_learner} GPU"
                f"{'s' if gpus_per_learner != 1 else ''} each (LEARNERS={fits})" if fits else "")
        if gpus and learners <= gpus:
            hint += (" or " if hint else "") + f"give each {gpus // learners} (GPUS_PER_LEARNER={gpus // learners})"
        if not gpus:
            raise RosterError(f"{learners} learners x {gpus_per_learner} GPUs need {need} GPUs and this machine has "
                              "none (nvidia-smi sees no GPU): say GPUS_PER_LEARNER=0 for a CPU class")
        raise RosterError(f"{learners} learners x {gpus_per_learner} GPUs need {need} GPUs; this machine has "
                          f"{gpus}: {hint}")
    names = list(names) if names else [f"{prefix}{i + 1}" for i in range(learners)]
    everyone = names + ([admin] if admin else [])
    bad = [n for n in everyone if not NAME.match(n)]
    if bad:
        raise RosterError(f"not a user name useradd takes: {bad} (lower case letters, digits, - and _; "
                          "starting with a letter or _; at most 31 characters)")
    if len(set(everyone)) != len(everyone):
        raise RosterError(f"a name appears twice: {everyone}")
    limit = ephemeral_low() if port_limit is None else port_limit
    if port_base < 1024 or port_block < 2:
        raise RosterError(f"port blocks start at 1024 or above and hold 2 ports or more (got {port_base}, "
                          f"{port_block})")
    end = port_base + len(everyone) * port_block
    if end > limit:
        raise RosterError(f"{len(everyone)} port blocks of {port_block} from {port_base} end at {end - 1}, inside "
                          f"the ephemeral range (from {limit}): lower HUB_PORT_BASE or HUB_PORT_BLOCK")
    seats = []
    for i, name in enumerate(names):
        first = port_base + i * port_block
        seats.append(Seat(name, tuple(range(i * gpus_per_learner, (i + 1) * gpus_per_learner)), first,
                          first + port_block - 1))
    if admin:
        first = port_base + learners * port_block
        seats.append(Seat(admin, tuple(range(need, gpus)), first, first + port_block - 1, admin=True))
    return Roster(gpus, gpus_per_learner, seats)
