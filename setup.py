# The C parts are compiled at install time:
#  - rdmasock._native (cffi): the ring data path for the Python API and the engine;
#  - rdmasock._engine (cffi embedding): the Python control plane for preloaded programs;
#  - rdmasock/librdmasock.so: the LD_PRELOAD front (plain C: no Python until needed).
import glob
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


class BuildWithPreload(build_ext):
    def run(self):
        super().run()
        self.build_preload()

    def build_preload(self):
        out_dir = os.path.dirname(self.get_ext_fullpath("rdmasock._native"))
        sources = sorted(glob.glob("shim/preload/*.c")) + sorted(glob.glob("shim/rs_*.c"))
        engines = glob.glob(os.path.join(out_dir, "_engine*.so"))
        if not engines:
            raise RuntimeError("rdmasock._engine was not built")
        macros = [("RS_PY_VERSION", '"%d.%d"' % sys.version_info[:2]),
                  ("RS_ENGINE_FILE", '"%s"' % os.path.basename(max(engines, key=os.path.getmtime)))]
        objects = self.compiler.compile(sources, output_dir=self.build_temp, macros=macros,
                                        include_dirs=["shim"],
                                        extra_postargs=["-O2", "-std=gnu11", "-fPIC", "-fvisibility=hidden", "-Wall"])
        self.compiler.link_shared_object(objects, os.path.join(out_dir, "librdmasock.so"),
                                         libraries=["dl", "pthread"])


setup(cffi_modules=["rdmasock/_build_native.py:ffibuilder", "rdmasock/_build_engine.py:ffibuilder"],
      cmdclass={"build_ext": BuildWithPreload})
