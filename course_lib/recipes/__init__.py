"""Training scripts that run unchanged under ``torchrun``:
``python -m torch.distributed.run ... -m course_lib.recipes.NAME``."""
from __future__ import annotations

import shlex
import sys


def command_line(args: list[str], env: dict | None = None) -> str:
    """The command a learner types for ``args`` (what the course's launch helpers ran): this kernel's
    ``python -m torch.distributed.run`` is written ``torchrun``, its Python ``python``; ``env`` goes in front."""
    args = [str(a) for a in args]
    if args[:3] == [sys.executable, "-m", "torch.distributed.run"]:
        args = ["torchrun", *args[3:]]
    elif args and args[0] == sys.executable:
        args = ["python", *args[1:]]
    prefix = [f"{k}={v}" for k, v in (env or {}).items() if v is not None]
    return shlex.join([*prefix, *args]) if not prefix else " ".join(prefix) + " " + shlex.join(args)
