"""rdmasock command line: run, preload-path, stat, doctor, demo, bench."""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def doctor(args):
    """Says which transports this installation and machine can use, and why not."""
    from . import doctor as _doctor
    return _doctor.main(args)


def preload_path():
    """The LD_PRELOAD library built next to this package."""
    path = os.path.join(HERE, "librdmasock.so")
    if not os.path.exists(path):
        sys.exit("rdmasock: %s is missing (reinstall: pip install .)" % path)
    return path


def run(args):
    """Runs a command with the library preloaded (exec: the command keeps our pid)."""
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        sys.exit("usage: rdmasock run -- COMMAND [ARGS...]")
    env = dict(os.environ)
    lib = preload_path()
    env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        sys.exit("rdmasock run: %s: %s" % (cmd[0], exc.strerror))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:             # everything after `bench` goes to the suite (options too)
        from .bench import cli as bench_cli
        return bench_cli.main(argv[1:])
    if argv[:1] == ["demo"]:              # what scripts/demo.sh runs, on what this machine has
        from .bench import pgbench_demo
        return pgbench_demo.main(["--reps", "3", "--duration", "8"] + argv[1:])
    ap = argparse.ArgumentParser(prog="rdmasock")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a command with rdmasock preloaded")
    r.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("preload-path", help="print the path of librdmasock.so")
    st = sub.add_parser("stat", help="connections of preloaded processes (like ss)")
    st.add_argument("--json", action="store_true")
    sub.add_parser("doctor", help="what this machine can use")
    sub.add_parser("demo", help="pgbench against PostgreSQL, TCP vs rdmasock (what scripts/demo.sh runs after "
                                "setting the machine up)")
    b = sub.add_parser("bench", help="benchmark suite (rdmasock.bench: pingpong, stream, redis, pgbench, ...)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.cmd == "doctor":
        return doctor(args)
    if args.cmd == "run":
        return run(args)
    if args.cmd == "stat":
        from . import stat
        return stat.main(args.json)
    if args.cmd == "preload-path":
        print(preload_path())
        return 0
    return 0                             # bench and demo were dispatched above


if __name__ == "__main__":
    sys.exit(main())
