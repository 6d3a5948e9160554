# JupyterHub reads this file (jupyterhub -f ...); what it sets is in course_lib/hub/config.py.
from course_lib.hub.config import configure

configure(get_config())  # noqa: F821  (get_config is JupyterHub's, given to its config files)
