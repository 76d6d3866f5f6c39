"""The one compiled piece: the host route's C step, built at install time when a C compiler is
there (``optional``: without one the install still succeeds and CPU steps take the general path;
attnpool logs once which route runs). Python's headers only, no torch headers: one build per
CPython, whatever torch the user brings."""

from __future__ import annotations

import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class ReplacingBuildExt(build_ext):
    """An editable install copies the built step into the source tree: here by writing a new
    file and renaming it into place, never by rewriting the old one, so that a process that
    has loaded it (another environment's tests running from the same tree while this one
    installs) keeps its mapping of the old file."""

    def copy_file(self, infile: str, outfile: str, *args: object, **kwargs: object
                  ) -> tuple[str, bool]:
        if os.path.isdir(outfile):
            outfile = os.path.join(outfile, os.path.basename(infile))
        tmp = f"{outfile}.{os.getpid()}.tmp"
        shutil.copyfile(infile, tmp)
        shutil.copymode(infile, tmp)
        os.replace(tmp, outfile)
        return outfile, True


_HOST = "src/attnpool/update/host"
setup(ext_modules=[Extension("attnpool.update.host._lane",
                             [f"{_HOST}/host_lane.c", f"{_HOST}/slots.c", f"{_HOST}/tensors.c"],
                             depends=[f"{_HOST}/lane.h"], include_dirs=[_HOST],
                             extra_compile_args=["-O2"], optional=True)],
      cmdclass={"build_ext": ReplacingBuildExt})
