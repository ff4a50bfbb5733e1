"""Where the preload engine's Python modules come from, worked out at run time.

librdmasock.so finds the directory that holds this package (`root`) and the interpreter
of the installation it belongs to (`exe`: a venv's python, an interpreter's own, or the
system's; shim/preload/rs_pyworld.c).  The engine imports `rdmasock` from `root` and
nothing else of it, then its dependencies (_cffi_backend, pyverbs) from the site
directories of that installation: the venv's, plus the base interpreter's when the venv
was made with --system-site-packages, as that venv's own python would.

Standard library only: this runs before anything else can be imported.  The same code is
compiled into the engine library (rdmasock/_build_engine.py) and used by `rdmasock doctor`.
"""
import os
import sys

VERSION = "%d.%d" % sys.version_info[:2]


def venv_dir(exe):
    """The virtual environment exe belongs to (its pyvenv.cfg is in the directory of exe
    or the one above), or None."""
    d = os.path.dirname(os.path.abspath(exe))
    for cand in (d, os.path.dirname(d)):
        if os.path.isfile(os.path.join(cand, "pyvenv.cfg")):
            return cand
    return None


def venv_config(venv):
    cfg = {}
    try:
        with open(os.path.join(venv, "pyvenv.cfg"), encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition("=")
                if sep:
                    cfg[key.strip().lower()] = value.strip()
    except OSError:
        pass
    return cfg


def _prefix_sites(prefix):
    """Site directories an interpreter of this version keeps under prefix (the standard
    layout and Debian's)."""
    return [os.path.join(prefix, "lib", "python" + VERSION, "site-packages"),
            os.path.join(prefix, "local", "lib", "python" + VERSION, "dist-packages"),
            os.path.join(prefix, "lib", "python3", "dist-packages"),
            os.path.join(prefix, "lib", "python" + VERSION, "dist-packages")]


def site_dirs(exe, root):
    """The directories the engine imports from, in order: root, then the installation's
    site directories that exist."""
    prefixes = []
    venv = venv_dir(exe)
    if venv:
        prefixes.append(venv)
        cfg = venv_config(venv)
        if cfg.get("include-system-site-packages", "false").lower() == "true" and cfg.get("home"):
            prefixes.append(os.path.dirname(cfg["home"]))
    else:
        prefixes.append(os.path.dirname(os.path.dirname(os.path.realpath(exe))))
    out = [root]
    for p in prefixes:
        for d in _prefix_sites(p):
            if os.path.isdir(d) and d not in out:
                out.append(d)
    return out


class _Sink:
    """sys.stdout/sys.stderr of an interpreter the engine started itself: the host
    program's descriptors 1 and 2 are never written to.  Text goes to RDMASOCK_LOG_FILE."""
    encoding = "utf-8"
    errors = "replace"

    def write(self, text):
        try:
            if text.strip():
                from rdmasock import log
                log.line("python: " + " | ".join(text.strip().splitlines()), level=1)
        except BaseException:
            pass
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False


def _load_package(root):
    """Imports the rdmasock package that lives in root, whatever else sys.path holds."""
    import importlib.util
    pkg = os.path.join(root, "rdmasock")
    have = sys.modules.get("rdmasock")
    if have is not None:
        where = os.path.dirname(os.path.realpath(getattr(have, "__file__", "") or "/"))
        if where != os.path.realpath(pkg):
            raise ImportError("the program already imported another rdmasock (%s), not %s" % (where, pkg))
        return have
    spec = importlib.util.spec_from_file_location("rdmasock", os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    if spec is None:
        raise ImportError("no rdmasock package in %s" % root)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rdmasock"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["rdmasock"]
        raise
    return mod


def enter(exe, root, own):
    """Makes the engine importable.  own: the engine started this interpreter (the host
    program is not Python), so its stdio and site processing are the engine's to set.
    Raises ImportError saying what is missing."""
    if own:
        sys.stdout = sys.stderr = _Sink()
    # The directories only, without their .pth files: those import what other packages
    # want at start-up (pathlib, urllib, ...), memory in every preloaded process, and the
    # engine needs none of it.  In a Python program its own modules come first; ours are
    # only a fallback.
    for d in site_dirs(exe, root)[0 if own else 1:]:
        if d not in sys.path:
            sys.path.append(d)
    try:
        import _cffi_backend  # noqa: F401  (what every cffi module needs)
    except ImportError as exc:
        raise ImportError("%s (python %s, sys.path=%s)" % (exc, sys.version.split()[0], sys.path)) from None
    _load_package(root)
