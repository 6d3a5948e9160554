"""JupyterHub's configuration for one VM and a class: loaded by ``jupyterhub -f course_lib/hub/jupyterhub_config.py``.

Everything comes from the hub's state folder (``$COURSE_HUB_STATE``: the roster, the database, the cookie secret,
written by ``python -m course_lib.hub up``) and from the environment (the passwords, never a file):

* ``COURSE_HUB_PASSWORD``: the learners' shared password (8 characters or more);
* ``COURSE_HUB_ADMIN_PASSWORD``: the instructor's (32 characters or more: it opens every learner's server);
* ``COURSE_HUB_API_TOKEN`` (optional): a token for scripts, with the rights to list, start and stop servers.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .roster import Roster
from .system import COPY, copy_notebooks

SETTINGS = "settings.json"      # in the state folder: the ports and paths `up` chose


def state_dir() -> Path:
    try:
        return Path(os.environ["COURSE_HUB_STATE"])
    except KeyError:
        raise SystemExit("COURSE_HUB_STATE is not set: start the hub with `make hub` "
                         "(python -m course_lib.hub up), which sets it") from None


def settings(state: Path) -> dict:
    return json.loads((state / SETTINGS).read_text(encoding="utf-8"))


def spawner_class():
    from jupyterhub.spawner import LocalProcessSpawner
    from traitlets import Unicode

    class CourseSpawner(LocalProcessSpawner):
        """A learner's JupyterLab as their own user, with their seat's GPUs and ports and their notebook copy."""

        notebooks = Unicode(help="the notebooks each learner gets a copy of, once").tag(config=True)
        roster_file = Unicode(help="the roster: each user's GPUs and port block").tag(config=True)

        def seat(self):
            return Roster.load(Path(self.roster_file)).seat(self.user.name)   # RosterError: not on the roster

        async def start(self):
            self.seat()    # RosterError before anything is copied: not on the roster
            dest, made = copy_notebooks(Path(self.notebooks), self.user.name)
            self.log.info("course: %s's notebooks %s %s", self.user.name, "copied to" if made else "kept in", dest)
            return await super().start()

        def get_env(self):
            env = super().get_env()
            env.update(self.seat().env())
            env["COURSE_NOTEBOOKS"] = os.path.join(os.path.expanduser(f"~{self.user.name}"), COPY)
            return env

    return CourseSpawner


def authenticator_class():
    from jupyterhub.authenticators.shared import SharedPasswordAuthenticator
    from tornado import web

    class CourseAuthenticator(SharedPasswordAuthenticator):
        """The shared password, and a name not on the roster told so (only once the password was right: a
        stranger without it learns nothing about who is on the roster)."""

        def check_allowed(self, username, authentication=None):
            if username in self.allowed_users or username in self.admin_users:
                return True
            raise web.HTTPError(403, f"{username!r} is not on this class's roster: log in with the user name "
                                     "your instructor gave you")

    return CourseAuthenticator


def configure(c, state: Path | None = None) -> None:
    state = state or state_dir()
    s = settings(state)
    roster = Roster.load(state / "roster.json")
    c.JupyterHub.bind_url = f"http://127.0.0.1:{s['port']}"           # this machine only: learners come by SSH
    c.JupyterHub.hub_bind_url = f"http://127.0.0.1:{s['hub_api_port']}"
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{s['proxy_api_port']}"
    c.ConfigurableHTTPProxy.command = [s["proxy"]]
    c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    c.JupyterHub.pid_file = str(state / "jupyterhub.pid")
    c.JupyterHub.cleanup_servers = True    # the hub stops every learner's server when it stops
    c.JupyterHub.cleanup_proxy = True

    c.JupyterHub.authenticator_class = authenticator_class()   # JupyterHub's SharedPasswordAuthenticator
    c.SharedPasswordAuthenticator.user_password = os.environ.get("COURSE_HUB_PASSWORD", "")
    c.SharedPasswordAuthenticator.admin_password = os.environ.get("COURSE_HUB_ADMIN_PASSWORD", "")
    c.Authenticator.allowed_users = {seat.name for seat in roster.learners}
    c.Authenticator.admin_users = {roster.admin.name} if roster.admin else set()
    c.Authenticator.allow_all = False
    c.Authenticator.allow_existing_users = False     # only the roster, even after it shrinks
    token = os.environ.get("COURSE_HUB_API_TOKEN")
    if token:
        c.JupyterHub.services = [{"name": "course-scripts", "api_token": token}]
        c.JupyterHub.load_roles = [{"name": "course-scripts", "services": ["course-scripts"],
                                    "scopes": ["list:users", "read:users", "admin:servers", "admin:server_state",
                                               "servers", "access:servers"]}]

    c.Spawner.cmd = [s["singleuser"]]
    c.Spawner.notebook_dir = f"~/{COPY}"
    c.Spawner.default_url = "/lab"
    c.Spawner.start_timeout = 120          # a busy 2-core machine imports JupyterLab slowly
    c.Spawner.http_timeout = 120
    if s.get("spawner") == "slurm":
        from .slurm import configure_slurm
        configure_slurm(c, s, roster, state)
        return
    c.JupyterHub.spawner_class = spawner_class()
    c.CourseSpawner.notebooks = s["notebooks"]
    c.CourseSpawner.roster_file = str(state / "roster.json")
