"""One GPU VM for a whole class: JupyterHub with a seat per learner (``make hub``; README's instructor section).

* :mod:`.roster`: each learner's GPUs and port block (plain Python: planned and tested anywhere);
* :mod:`.system`: the learners' users, homes and notebook copies, and ending what the hub leaves (root);
* :mod:`.config`: JupyterHub's configuration (the spawner, the shared-password login, 127.0.0.1 only);
* ``python -m course_lib.hub``: prepare, roster, up, stop, status, remove-users.
"""
from .roster import Roster, RosterError, Seat, plan

__all__ = ["Roster", "RosterError", "Seat", "plan"]
