"""Every interposed libc call on an upgraded socket, checked byte-exactly (issue 3, item 2).

tests/c/preload_calls.c is compiled here with gcc (once plain, once with -O2
-D_FORTIFY_SOURCE=2) and run as a server/client pair over TCP loopback.  Each of its tests
opens its own connection and exercises one group of calls: blocking and nonblocking
connect (POLLOUT + SO_ERROR), accept/accept4 flags, socket(SOCK_NONBLOCK), read/write,
readv/writev, send/recv with MSG_PEEK/WAITALL/DONTWAIT/NOSIGNAL, SIGPIPE, sendto/recvfrom,
sendmsg/recvmsg, sendfile, FIONREAD, fcntl (F_GETFL/F_SETFL, F_DUPFD[_CLOEXEC]), dup/dup2/
dup3, shutdown(SHUT_WR) both ways, close (also by syscall(SYS_close) and close_range, with
the number then reused), poll/ppoll/select/pselect, epoll (LT, EPOLLET, EPOLLONESHOT,
EPOLLRDHUP, EPOLLOUT on a full ring), fork, exec and the fortified __*_chk entry points.  The program prints "ok NAME" / "FAIL NAME detail" per check.

Scenarios (one program run each, both sides under `python -m rdmasock run` or not):
  both         server and client preloaded: every check on upgraded (shm) connections, and
               RDMASOCK_LOG_FILE must show transport=shm for both roles of every connection;
  fortify      the same with the fortified build (nm must show __read_chk, __recv_chk,
               __poll_chk... referenced);
  client_only  preloaded client, plain server: plain TCP, log transport=tcp (client);
  server_only  plain client, preloaded server: plain TCP, log transport=tcp (server);
  none         nothing preloaded: the baseline (and no log at all).

Items: test_scenario[S] asserts every check that is not a known bug, test_transport[S]
the log, test_known_bug[S-CHECK] is a strict xfail per known rdmasock bug (on the upgraded
scenarios; on plain TCP the same checks are part of test_scenario and must pass).  When a
bug is fixed its item XPASSes and fails: remove it from KNOWN_BUGS.  Each scenario runs
its program pair once (cached); processes are killed by PID on timeout.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

from rdmasock.reasons import MID_STREAM

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(HERE, "c", "preload_calls.c")
RING_SIZE = 65536              # RDMASOCK_RING_SIZE for both sides: the ring-full tests fill it
RUN_TIMEOUT = 60               # a whole program pair; the program's own watchdog is 5 s per test

SCENARIOS = {                  # id -> (build, server preloaded, client preloaded)
    "both": ("plain", True, True),
    "fortify": ("fortify", True, True),
    "client_only": ("plain", False, True),
    "server_only": ("plain", True, False),
    "none": ("plain", False, False),
}
UPGRADED = ("both", "fortify")

BUILDS = {
    "plain": ["-O0", "-g"],
    "fortify": ["-O2", "-D_FORTIFY_SOURCE=2"],
}
FORTIFIED_REFS = ("__read_chk", "__recv_chk", "__recvfrom_chk", "__poll_chk", "__ppoll_chk", "__fdelt_chk")

# Every check the program prints, per role (keeps this file and the C program in step).
CHECKS = {
    "server": """
        accept read_c2s write_s2c read_eof_s close_s
        accept4 accept4_nonblock_cloexec read_nonblock_eagain recv_nonblock_eagain read_nonblock_data write_nonblock
        fcntl_setfl_clear_s fcntl_setfl_set_s write_blocking_s read_blocking_eof_s
        readv_small_iovecs readv_mixed_iovecs readv_large writev_tiny_iovecs
        recv_dontwait_eagain ioctl_fionread_empty ioctl_fionread recv_peek recv_after_peek recv_waitall recvfrom
        recvmsg_waitall send_dontwait sendto_s sendmsg_s recv_eof_s
        poll_idle_fresh_s epoll_idle_fresh_s ioctl_fionread_fresh read_first_data epoll_idle_after_first_read_s
        write_first_data
        preamble_first_exchange_s poll_idle_switch_pending poll_readable_switch_pending
        close_unused close_peer_for_epipe
        sendfile_data sendfile_eof
        dup_data_original dup fcntl_dupfd fcntl_dupfd_cloexec dup2 dup3 close_original_keeps_conn
        close_dups_keeps_conn dup2_same_fd close_last_dup
        read_via_dup_after_fd_reuse write_via_dup_after_fd_reuse closed_fd_number_untouched
        rawclose_syscall_close_write rawclose_syscall_close_read rawclose_syscall_close rawclose_syscall_close_next_read rawclose_syscall_close_next_write rawclose_syscall_close_next_eof rawclose_close_range_write rawclose_close_range_read rawclose_close_range rawclose_close_range_next_read rawclose_close_range_next_write rawclose_close_range_next_eof rawclose_syscall_close_range_write rawclose_syscall_close_range_read rawclose_syscall_close_range rawclose_syscall_close_range_next_read rawclose_syscall_close_range_next_write rawclose_syscall_close_range_next_eof
        half_close_eof_s poll_rdhup_half_close_s eof_sticky_s write_after_peer_shut_wr_s
        shutdown_wr_s send_after_shut_wr_epipe_s half_close_other_dir_s eof_after_peer_close_s
        poll_idle poll_readable_after_delay poll_idle_after_read poll_writable
        ppoll_idle ppoll_readable_after_delay ppoll_idle_after_read ppoll_writable
        select_idle select_readable_after_delay select_idle_after_read select_writable
        pselect_idle pselect_readable_after_delay pselect_idle_after_read pselect_writable
        epoll_ctl_add epoll_idle epoll_readable_after_delay epoll_lt_still_readable epoll_other_ready_not_starved epoll_idle_after_read epoll_zero_timeout_sees_others
        epoll_pwait_readable epoll_pwait2_readable epoll_out epoll_ctl_del
        epoll_create_ctl_et epollet_idle epollet_edge epollet_no_repeat epollet_new_edge epollet_data
        oneshot_first oneshot_disarmed oneshot_disarmed_new_data oneshot_rearm oneshot_data
        rdhup_idle epoll_rdhup eof_after_rdhup poll_rdhup_peer_closed
        ring_full_eagain epollout_not_when_full pollout_not_when_full epollout_after_drain ring_full_data_1
        pollout_not_when_full_2 pollout_after_drain ring_full_data_2
        pollwriter_no_lost_wakeup pollwriter_data
        chk_poll_idle chk_poll chk_read chk_ppoll_idle chk_select_idle chk_recv chk_recvfrom chk_ppoll chk_select
        chk_ppoll_pollout_when_full chk_poll_pollout_when_full chk_ppoll_pollout_after_drain chk_full_data
        fork_parent_close fork_child_io fork_child_close fork_child_exit
        exec_before exec_no_internal_fds_s exec_conn_still_works_s
        sendsig_stream_intact_1 sendsig_stream_intact_2
        oob_none_pending poll_pri_urgent inband_before_mark oob_byte inband_after_mark reply_after_oob eof_after_oob
        getpeername getsockname fionread_all_arrived tcp_info_state tcp_info_bytes_received tcp_info_segs_in segs_data recv_peek_trunc
        recv_trunc_discards data_after_trunc rx_timestamping_set rx_timestamping data_after_tx_timestamps cork_data o_async_set sigio_each_message sigio_each_arrival_unread
        recvmmsg preadv2_offset_espipe preadv2_socket sendmsg_ancillary_data recvmsg_timestamp_inq
        recvmsg_after_ancillary splice_from_socket splice_into_socket_data write_after_splice
        eof_after_splice banner_written_closed
    """.split(),
    "client": """
        connect_blocking write_c2s read_s2c close_c
        socket_nonblock_cloexec connect_nonblock write_nonblock_c read_nonblock_c read_nonblock_eagain_c
        fcntl_setfl_clear_c read_blocking_after_setfl_c
        writev_small_iovecs writev_mixed_iovecs writev_large_blocking readv_tiny_c
        send send_pieces sendto sendmsg recv_waitall_c recvfrom_c recvmsg_c
        poll_idle_fresh_c send_first_data poll_idle_after_handshake_c poll_readable_first_data_c
        preamble_first_exchange_c preamble_then_ring_send
        eof_when_peer_closes_unused_conn
        read_eof_after_peer_close send_epipe_prompt send_nosignal_epipe write_epipe_sigpipe send_epipe_sigpipe
        sendfile_offset sendfile_null_offset
        dup_data_c eof_after_last_dup_closed read_after_peer_fd_reuse
        rawclose_syscall_close_peer_read rawclose_syscall_close_peer_eof rawclose_syscall_close_next_peer_read rawclose_close_range_peer_read rawclose_close_range_peer_eof rawclose_close_range_next_peer_read rawclose_syscall_close_range_peer_read rawclose_syscall_close_range_peer_eof rawclose_syscall_close_range_next_peer_read
        shutdown_wr_c send_after_shut_wr_epipe_c half_close_other_dir_c eof_after_peer_close_c
        half_close_eof_c poll_rdhup_half_close_c eof_sticky_c write_after_peer_shut_wr_c
        fork_conn_after_parent_close fork_no_eof_while_child_open fork_eof_after_child_close
        exec_before_c exec_no_internal_fds_c exec_conn_still_works_c exec_eof_after_peer_close
        epoll_before_connect
        sa_restart_recv_restarted no_restart_recv_eintr recv_after_eintr sa_restart_rcvtimeo_eintr
        recv_after_timeo_eintr rcvtimeo_eagain rcvtimeo_fresh_eagain sndtimeo_partial sndtimeo_again
        sa_restart_send_restarted no_restart_send_eintr
        linger0_econnreset linger0_then_eof unread_close_econnreset unread_close_then_eof
        send_oob read_after_oob
        tcpstate_send siocoutq_drained tcp_info_bytes_acked tcp_cork_set tcp_cork_clear tcp_info_segs_out tx_timestamping_set tx_timestamp_on_error_queue tx_timestamps_send
        so_error_refused so_error_cleared
        sendmmsg pwritev2_socket sendmsg_ancillary send_for_timestamp send_for_splice splice_into_socket read_after_splice banner_then_eof
        poll_signal_eintr select_signal_eintr epoll_signal_eintr
    """.split(),
}
ROLE_OF = {name: role for role, names in CHECKS.items() for name in names}

# Known rdmasock bugs on upgraded connections: check -> description.  They apply to the
# UPGRADED scenarios; on plain TCP (one side or none preloaded) these checks must pass.
# Bugs these checks found that are fixed now (78e502b, 11b55ba), kept as regression checks:
# recvmsg_waitall, writev_large_blocking, ioctl_fionread_fresh, poll_readable_switch_pending,
# epollet_no_repeat, oneshot_disarmed*, eof_when_peer_closes_unused_conn, send_epipe_prompt,
# fork_eof_after_child_close, exec_eof_after_peer_close, chk_ppoll_pollout_when_full (__ppoll_chk),
# poll/epoll_idle_fresh_s, poll_idle_after_handshake_c, poll_readable_first_data_c,
# poll_idle_switch_pending (handshake bytes seen as readiness).
_ORIG_FD = ("an upgraded connection keeps using the descriptor number it was created on (rs_conn->fd) for its "
            "doorbells and waits after the application closed that number and goes on through a dup: a read via "
            "the dup that has to wait polls the closed number (POLLNVAL), takes it for peer death and returns 0 "
            "(EOF) although the peer sends 100 ms later; once the number is reused, doorbell bytes 0xD7 are "
            "written into the unrelated socket now holding it and the peer's wake-ups are lost (it finds the data "
            "only at its 500 ms re-check)")
KNOWN_BUGS = {}
# Only in the fortified build (the plain build calls the interposed ppoll).
FORTIFY_BUGS = {}
MISSING_CHK_EXPORTS = {}        # fortified entry point -> bug, if librdmasock.so lacks one


def bugs_of(scenario):
    if scenario not in UPGRADED:
        return {}
    b = dict(KNOWN_BUGS)
    if scenario == "fortify":
        b.update(FORTIFY_BUGS)
    return b


# ---------------------------------------------------------------------------------------------
# build and run

@pytest.fixture(scope="module")
def workdir():
    d = tempfile.mkdtemp(prefix="rs-pcalls-")      # short: it holds the AF_UNIX control socket
    yield d
    shutil.rmtree(d, ignore_errors=True)


_binaries = {}


def _binary(workdir, build):
    if build not in _binaries:
        if not shutil.which("gcc"):
            pytest.fail("gcc is needed to build tests/c/preload_calls.c", pytrace=False)
        out = os.path.join(workdir, "preload_calls_" + build)
        cmd = ["gcc", "-std=gnu11", "-Wall", *BUILDS[build], SRC, "-o", out, "-lpthread"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            pytest.fail("compiling preload_calls.c (%s) failed:\n%s" % (build, p.stderr[-4000:]), pytrace=False)
        _binaries[build] = out
    return _binaries[build]


_preload_ok = None


def _need_preload():
    global _preload_ok
    if _preload_ok is None:
        p = subprocess.run([sys.executable, "-m", "rdmasock", "preload-path"], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
        path = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        _preload_ok = (p.returncode == 0 and os.path.exists(path), p.stderr.strip() or path)
    if not _preload_ok[0]:
        pytest.fail("the LD_PRELOAD library is not usable: %s" % _preload_ok[1], pytrace=False)


def _kill(proc):
    if proc.poll() is None:
        proc.kill()                     # by PID: `rdmasock run` execs, so this is the program
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


class Run:
    """One program pair: outputs, exit codes, and the log."""

    def __init__(self, scenario, server_out, client_out, server_rc, client_rc, log, note=""):
        self.scenario = scenario
        self.out = {"server": server_out, "client": client_out}
        self.rc = {"server": server_rc, "client": client_rc}
        self.log = log
        self.note = note
        self.results = {"server": {}, "client": {}}      # name -> list of (ok, detail)
        self.other_fails = []                           # FAIL lines of names not in CHECKS
        self.conns = []                                 # (test, client port)
        for role, text in self.out.items():
            for line in text.splitlines():
                if line.startswith("ok ") or line.startswith("FAIL "):
                    parts = line.split(None, 2)
                    name = parts[1] if len(parts) > 1 else "?"
                    ok = parts[0] == "ok"
                    self.results[role].setdefault(name, []).append((ok, parts[2] if len(parts) > 2 else ""))
                elif line.startswith("conn ") and role == "client":
                    _, test, port = line.split()
                    self.conns.append((test, int(port)))

    def status(self, name):
        """(passed, description) of a check: all its lines ok, and at least one."""
        role = ROLE_OF[name]
        res = self.results[role].get(name)
        if not res:
            return False, "%s check %r not reported (%s)" % (role, name, self.note or "see the output")
        fails = [d for ok, d in res if not ok]
        if fails:
            return False, "FAIL %s (%s): %s" % (name, role, fails[0])
        return True, ""

    def dump(self):
        return "\n".join("---- %s (exit %s) ----\n%s" % (r, self.rc[r], self.out[r][-6000:]) for r in ("server", "client"))


_runs = {}


def _run(scenario, workdir, only=(), **env_extra):
    """Runs the program pair (all its tests, or `only` these) once per argument set."""
    key = (scenario, tuple(only), tuple(sorted(env_extra.items())))
    if key in _runs:
        return _runs[key]
    build, spre, cpre = SCENARIOS[scenario]
    if spre or cpre:
        _need_preload()
    binary = _binary(workdir, build)
    d = tempfile.mkdtemp(prefix=scenario[:4] + "-", dir=workdir)
    log = os.path.join(d, "rdmasock.log")
    ctl = os.path.join(d, "ctl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDMASOCK_") and k != "LD_PRELOAD"}
    env.update(RDMASOCK_LOG_FILE=log, RDMASOCK_RING_SIZE=str(RING_SIZE), **env_extra)
    pre = [sys.executable, "-m", "rdmasock", "run", "--"]

    def start(argv, preload):
        return subprocess.Popen((pre if preload else []) + argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    server = start([binary, "server", ctl] + list(only), spre)
    client = None
    first = []
    t = threading.Thread(target=lambda: first.append(server.stdout.readline()), daemon=True)
    t.start()
    t.join(30)
    note = ""
    try:
        line = first[0].decode() if first else ""
        if not line.startswith("port "):
            _kill(server)
            rest = server.stdout.read().decode(errors="replace")
            pytest.fail("server did not start: %r %s" % (line, rest[-3000:]), pytrace=False)
        port = line.split()[1]
        client = start([binary, "client", port, ctl, d] + list(only), cpre)
        outs = {}

        def collect(name, proc):
            outs[name] = proc.communicate()[0].decode(errors="replace")

        threads = [threading.Thread(target=collect, args=("server", server), daemon=True),
                   threading.Thread(target=collect, args=("client", client), daemon=True)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(RUN_TIMEOUT)
        if any(th.is_alive() for th in threads):
            note = "killed after %d s" % RUN_TIMEOUT
            _kill(client)
            _kill(server)
            for th in threads:
                th.join(10)
    finally:
        if client is not None:
            _kill(client)
        _kill(server)
    try:
        with open(log) as f:
            log_text = f.read()
    except FileNotFoundError:
        log_text = ""
    r = Run(scenario, outs.get("server", ""), outs.get("client", ""), server.returncode, client.returncode,
            log_text, note)
    _runs[key] = r
    return r


# ---------------------------------------------------------------------------------------------
# the items

@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario(scenario, workdir):
    """Every check passes except the known bugs of this scenario; nothing unexpected."""
    r = _run(scenario, workdir)
    bugs = bugs_of(scenario)
    problems = []
    for name in ROLE_OF:
        if name in bugs:
            continue
        ok, why = r.status(name)
        if not ok:
            problems.append(why)
    for role in ("server", "client"):
        for name, res in r.results[role].items():
            if name not in ROLE_OF:
                bad = [d for ok, d in res if not ok]
                problems.append("%s printed a check this file does not know: %s %s" %
                                (role, name, ("FAIL " + bad[0]) if bad else "(ok)"))
    for role in ("server", "client"):
        failed_bugs = any(not r.status(n)[0] for n in bugs if ROLE_OF[n] == role)
        # exit 1 = some check failed; fine only if those were known bugs (listed above otherwise)
        if r.rc[role] != 0 and not (r.rc[role] == 1 and (failed_bugs or problems)):
            problems.append("%s exited with %s" % (role, r.rc[role]))
    assert not problems, "\n".join(problems) + "\n" + r.dump()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_transport(scenario, workdir):
    """The log proves where the calls ran: shm for both roles of every connection when both
    sides are preloaded; tcp for the preloaded side otherwise; no log without preload."""
    r = _run(scenario, workdir)
    _, spre, cpre = SCENARIOS[scenario]
    recs = []
    for line in r.log.splitlines():
        m = re.search(r"role=(\w+) local=(\S+) peer=(\S+) transport=(\w+)", line)
        if m:
            recs.append(dict(role=m.group(1), local=m.group(2), peer=m.group(3), transport=m.group(4), line=line))
    # "unused" and "timeo_fresh": the server never calls into the accepted socket, so the
    # lazy handshake never completes and no side logs a transport for that connection
    conns = [(t, p) for t, p in r.conns if t not in ("unused", "timeo_fresh")]
    assert len(conns) >= 20, "too few connections reported by the client:\n" + r.dump()

    def port_of(addr):
        m = re.search(r":(\d+)$", addr)
        return int(m.group(1)) if m else None

    problems = []
    if not spre and not cpre:
        assert not recs, "a log without preloading:\n" + r.log
        return
    for test, port in conns:
        for role, pre, field in (("server", spre, "peer"), ("client", cpre, "local")):
            mine = [x for x in recs if x["role"] == role and port_of(x[field]) == port]
            if not pre:
                continue
            want = "shm" if (spre and cpre) else "tcp"
            if want == "shm" and mine and mine[0]["transport"] == "shm":
                # an upgraded connection that went on over TCP later (urgent data) logs it
                mine = [x for x in mine if not re.search(r"reason=(%s)\b" % "|".join(MID_STREAM), x["line"])]
            if role == "client" and not spre:
                # a client that stays on TCP before connecting logs no local address: count instead
                continue
            if not mine:
                problems.append("%s: no %s log line for the connection from port %d" % (test, role, port))
            elif any(x["transport"] != want for x in mine):
                problems.append("%s: %s logged %s, want transport=%s" % (test, role, mine[0]["line"], want))
    if cpre and not spre:
        client_recs = [x for x in recs if x["role"] == "client"]
        if len(client_recs) < len(r.conns) or any(x["transport"] != "tcp" for x in client_recs):
            problems.append("client: %d log lines for %d connections, want all transport=tcp" %
                            (len(client_recs), len(r.conns)))
    for x in recs:
        if (x["role"] == "server" and not spre) or (x["role"] == "client" and not cpre):
            problems.append("a log line from a side that is not preloaded: " + x["line"])
    if spre and cpre:
        # transmit timestamps moved the client's connection to TCP, with its reason
        for test, port in conns:
            if test == "tstamp" and not any(x["role"] == "client" and port_of(x["local"]) == port and
                                            "reason=tx_timestamps" in x["line"] for x in recs):
                problems.append("tstamp: the client logged no move to TCP with reason=tx_timestamps")
        # the ring-full test filled the 64 KiB ring and, once its writes had waited, the
        # socket buffers a full ring lends (SPILL, PROTOCOL 6.9): more than a ring, as over
        # TCP, and the connection stayed upgraded
        fills = [int(n) for n in re.findall(r"^info ringfull: round \d filled (\d+) bytes", r.out["server"], re.M)]
        if len(fills) != 2 or not all(n > RING_SIZE for n in fills):
            problems.append("ring-full rounds filled %s bytes, want 2 rounds of more than RDMASOCK_RING_SIZE=%d"
                            % (fills, RING_SIZE))
        for test, port in conns:
            moved = [x["line"] for x in recs if test == "ringfull" and "reason=" in x["line"] and
                     port in (port_of(x["local"]), port_of(x["peer"]))]
            if moved:
                problems.append("ringfull: the connection left its ring: " + moved[0])
    assert not problems, "\n".join(problems) + "\n---- log ----\n" + r.log


def test_pollwriter_without_spin(workdir):
    """A libpq-style writer (nonblocking write, nonblocking read, poll for POLLIN|POLLOUT)
    with the busy-poll budget at 0, so every full ring arms at once while the reader is
    returning credit: each wait must end when room appears, never at poll's timeout.
    (Credit published between the writer's look at the ring and its sleep once made poll
    sleep with no doorbell coming; psql's \\copy hung on it.)"""
    r = _run("both", workdir, only=["pollwriter"], RDMASOCK_SPIN_US="0")
    problems = [why for name in ("pollwriter_no_lost_wakeup", "pollwriter_data") for ok, why in [r.status(name)] if not ok]
    waits = re.search(r"^info pollwriter: (\d+) bytes, (\d+) waits", r.out["server"], re.M)
    if "transport=shm" not in r.log:
        problems.append("the connection did not run on shm")
    if not waits or int(waits.group(2)) < 100:
        problems.append("the writer waited on a full ring %s times, want at least 100" % (waits and waits.group(2)))
    assert not problems, "\n".join(problems) + "\n" + r.dump()


def test_signals_arriving_while_calls_spin(workdir):
    """A signal that arrives while a call busy-polls the ring ends it as it would end the
    kernel's wait: EINTR from recv/send without SA_RESTART or with a socket timeout, a
    restart with SA_RESTART, EINTR from poll/select/epoll_wait whatever the handler
    (signal(7)).  A 3 s busy-poll budget puts each signal (100 ms into the call) inside
    the spin, with the two programs on different CPUs so that the spin happens at all."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs: a peer on the same CPU is never spun for")
    names = ["signals", "sendsig", "pollsig"]
    r = _run("both", workdir, only=names, RDMASOCK_SPIN_US="3000000")
    wanted = [n for n in ROLE_OF if re.match(r"(sa_restart|no_restart|recv_after_(timeo_)?eintr|rcvtimeo_eagain|sendsig|"
                                            r"poll_signal|select_signal|epoll_signal)", n)]
    problems = [why for n in wanted for ok, why in [r.status(n)] if not ok]
    if "transport=shm" not in r.log:
        problems.append("the connections did not run on shm")
    assert len(wanted) >= 12 and not problems, "\n".join(problems) + "\n" + r.dump()


def _bug_params():
    for scenario in UPGRADED:
        for name, why in bugs_of(scenario).items():
            yield pytest.param(scenario, name, id="%s-%s" % (scenario, name),
                               marks=pytest.mark.xfail(strict=True, reason=why))


if list(_bug_params()):           # only while bugs are known: no empty "skipped" item
    @pytest.mark.parametrize("scenario,check", list(_bug_params()))
    def test_known_bug(scenario, check, workdir):
        r = _run(scenario, workdir)
        ok, why = r.status(check)
        assert ok, why


def _nm_undefined(path):
    if not shutil.which("nm"):
        pytest.fail("nm (binutils) is needed", pytrace=False)
    p = subprocess.run(["nm", "-D", path], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    undef, defined = set(), set()
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[-2] == "U":
            undef.add(parts[-1].split("@")[0])
        elif len(parts) >= 3 and parts[-2] in ("T", "W", "i"):
            defined.add(parts[-1].split("@")[0])
    return undef, defined


def test_fortified_build_calls_chk_variants(workdir):
    """The fortified build really calls the __*_chk entry points (so the fortify scenario
    exercises them); the plain build does not."""
    undef, _ = _nm_undefined(_binary(workdir, "fortify"))
    missing = [s for s in FORTIFIED_REFS if s not in undef]
    assert not missing, "fortified binary does not reference %s" % missing
    plain_undef, _ = _nm_undefined(_binary(workdir, "plain"))
    assert not [s for s in FORTIFIED_REFS if s in plain_undef]


def _export_params():
    for sym in FORTIFIED_REFS:
        marks = [pytest.mark.xfail(strict=True, reason=MISSING_CHK_EXPORTS[sym])] if sym in MISSING_CHK_EXPORTS else []
        yield pytest.param(sym, id=sym, marks=marks)


@pytest.mark.parametrize("sym", list(_export_params()))
def test_library_interposes_chk_variant(sym):
    """librdmasock.so defines each fortified entry point the fortified program calls."""
    _need_preload()
    p = subprocess.run([sys.executable, "-m", "rdmasock", "preload-path"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    _, defined = _nm_undefined(p.stdout.strip().splitlines()[-1])
    assert sym in defined, "%s is not exported by librdmasock.so" % sym
