# The C parts are compiled at install time:
#  - rdmasock._native (cffi): the ring data path for the Python API and the engine;
#  - rdmasock._engine (cffi embedding): the Python control plane for preloaded programs;
#  - rdmasock/librdmasock.so: the LD_PRELOAD front (plain C: no Python until needed).
#
# RDMA needs the libibverbs headers at build time (libibverbs-dev); the library itself
# loads no libibverbs unless a connection uses RDMA.  A build without the headers stops
# with instructions; RDMASOCK_BUILD_RDMA=0 builds a shm-only library on purpose.
import glob
import os
import sys
import sysconfig

import cffi
from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
VERBS_HEADER = "infiniband/verbs.h"


def have_verbs_headers(compiler):
    dirs = list(compiler.include_dirs) + ["/usr/include", "/usr/local/include"]
    return any(os.path.exists(os.path.join(d, VERBS_HEADER)) for d in dirs)


class BuildWithPreload(build_ext):
    def finalize_options(self):
        super().finalize_options()
        # Always compile: build/ in the source tree outlives builds, and an extension whose
        # sources look older than its output (a changed header, RDMASOCK_BUILD_RDMA) would
        # otherwise be packaged stale.
        self.force = True

    def run(self):
        self.check_verbs()
        super().run()
        self.build_preload()

    def check_verbs(self):
        from setuptools._distutils.ccompiler import new_compiler
        if have_verbs_headers(new_compiler()):
            return
        msg = ("rdmasock: <%s> not found: this build would have no RDMA transport.\n"
               "  Install the headers (Debian/Ubuntu: apt-get install libibverbs-dev) and build again,\n"
               "  or set RDMASOCK_BUILD_RDMA=0 to build a shm-only library on purpose." % VERBS_HEADER)
        if os.environ.get("RDMASOCK_BUILD_RDMA", "1") != "0":
            sys.exit(msg)
        sys.stderr.write("WARNING: " + msg.replace("\n", "\nWARNING: ") + "\n")
        try:                                    # pip hides build output unless -v
            with open("/dev/tty", "w") as tty:
                tty.write("WARNING: rdmasock is being built without RDMA support (RDMASOCK_BUILD_RDMA=0)\n")
        except OSError:
            pass

    def build_preload(self):
        out_dir = os.path.dirname(self.get_ext_fullpath("rdmasock._native"))
        sources = sorted(glob.glob("shim/preload/*.c")) + sorted(glob.glob("shim/rs_*.c"))
        engines = glob.glob(os.path.join(out_dir, "_engine*.so"))
        if not engines:
            raise RuntimeError("rdmasock._engine was not built")
        macros = [("RS_PY_VERSION", '"%d.%d"' % sys.version_info[:2]),
                  ("RS_ENGINE_FILE", '"%s"' % os.path.basename(max(engines, key=os.path.getmtime)))]
        if os.environ.get("RDMASOCK_BUILD_RDMA") == "0":
            macros.append(("RS_NO_VERBS", "1"))
        objects = self.compiler.compile(sources, output_dir=self.build_temp, macros=macros,
                                        include_dirs=["shim"],
                                        extra_postargs=["-O2", "-std=gnu11", "-fPIC", "-fvisibility=hidden", "-Wall",
                                                        "-ffile-prefix-map=%s=." % ROOT])
        self.compiler.link_shared_object(objects, os.path.join(out_dir, "librdmasock.so"),
                                         libraries=["dl", "pthread"])


setup(cffi_modules=["rdmasock/_build_native.py:ffibuilder", "rdmasock/_build_engine.py:ffibuilder"],
      cmdclass={"build_ext": BuildWithPreload},
      # The generated modules need a cffi backend at least as new as the generator.
      install_requires=["cffi>=%s" % cffi.__version__, "psutil>=5.9"])
