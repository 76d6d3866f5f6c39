"""The one compiled piece: the host route's C step, built at install time when a C compiler is
there (``optional``: without one the install still succeeds and CPU steps take the general path;
attnpool logs once which route runs). Python's headers only, no torch headers: one build per
CPython, whatever torch the user brings."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("attnpool.update.host._lane",
                             ["src/attnpool/update/host/host_lane.c"],
                             extra_compile_args=["-O2"], optional=True)])
