"""course_lib: the tested code behind the notebooks of the distributed-training course.

Start with :func:`course_lib.launch.run` (a function on N ranks from a notebook cell) and
:mod:`course_lib.hardware` (what this machine has). ``python -m course_lib doctor`` is the preflight.
"""
__version__ = "0.1.0"
