"""rdmasock benchmark suite (issue 5): sub-benchmarks that measure their baseline in the same run.

    rdmasock bench [pingpong|stream|sockperf|redis|pgbench|replay|scale|idle|all ...] [--reps 5] [--quick]
                   [--duration S] [--placements same,cross] [--no-rdma] [--no-plots]
    python -m rdmasock.bench [same arguments]

The package is rdmasock.bench once installed (pyproject.toml maps this directory there):
cli.py the command line, common.py the shared measurement machinery, report.py tables,
markdown and plots, one module per sub-benchmark (pingpong, stream, sockperf, redis_get,
pgbench, replay, scale, idle), rdma_vm.py the Soft-RoCE VM rows of pingpong, servers.py the real
servers, worker.py one end of the Python API ping-pong, pgbench_demo.py the demo.

Sub-benchmarks
  pingpong  64-byte round trips/s (rtt_us: 1e6 / median).  bench/c/sockbench.c over TCP and a Unix
            socket, the same program with both sides under `rdmasock run` (LD_PRELOAD, shm),
            the Python API (bench/worker.py: socket vs rdmasock.socket), and bench/c/shmspin.c,
            a raw shared-memory spin ping-pong (two processes, one page, cross-CPU) as the
            physical limit of the machine.  Ratios vs TCP at its best placement and vs the limit.
            Then, since the host kernel has no RDMA, one Soft-RoCE QEMU VM run (rdma_vm.py,
            scripts/softroce/run.sh; 3 s per repetition, --quick 1 s; the VM part takes ~25 s
            with --quick, ~2 min for 5 repetitions, boot included) adds the rows "TCP (Soft-RoCE
            VM)", "rdmasock rdma, inline on / off (Soft-RoCE VM)" (sockbench under LD_PRELOAD
            with RDMASOCK_TRANSPORTS=rdma) and "ib_write_lat (Soft-RoCE VM, raw verbs)", all on
            the same rxe device; their ratios compare within the VM only (vs the VM's TCP and
            ib_write_lat; target: rdma round trip <= 2x ib_write_lat's).  If the VM cannot run
            (tests/test_rdma_vm.py's prerequisites check, plus perftest), or with --no-rdma, one
            placeholder row says why.
  stream    throughput of writes of 64 B .. 1 MiB: sockbench over TCP vs under rdmasock, and
            memcpy bandwidth into a 4 MiB ring (bench/c/memcpybw.c) as the limit, and a raw
            two-process stream through a shared ring (bench/c/shmstream.c, two copies per byte,
            cross-CPU); at 64 KiB also the Python API (bench/worker.py: socket vs rdmasock.socket).
  redis     redis-benchmark PING_INLINE, GET, SET with -c 1 and -c 50, no pipelining, plain vs
            server and client both preloaded (servers: servers.py).
  pgbench   TPC-B, scales 1 and 10 (--pg-scales), 1 and 4 clients, synchronous_commit=off,
            fsync=off, plain vs server and client both preloaded (bench/pgbench_demo.py, which
            scripts/demo.sh runs, is this sub-benchmark with its own report).
  replay    the seed's method: pgbench's SQL (TPC-B, scale 1, 1 client, --replay-tx transactions)
            is captured with log_statement=all from the server log into a script, which
            `psql -f` replays, one new connection per run (process start and connection set-up
            included), plain vs psql and server both preloaded; transactions / wall seconds.
  scale     N = 1,4,16,64,256 concurrent connections: pgbench -S (-c N -j min(N,2)) and
            redis-benchmark GET (-c N), plain vs preloaded; throughput, and the PSS of server and
            client processes sampled during the run: total and per extra connection.  Then
            (--scale-oversub, default pgbench:8) the same unpinned: more runnable processes
            than CPUs.
  idle      CPU (% of one CPU) of a preloaded client holding --idle-conns (100) connections to
            redis-server, each after one PING, and of the server, over --idle-seconds (10) of
            no traffic, plain vs preloaded.

Method: every process is pinned with taskset; the server side on CPU 0, the client on CPU 0
("same") or CPU 1 ("cross").  Each program warms up before it measures.  Repetitions are
interleaved (rep 1 of every variant, then rep 2, ...) so that the baseline and rdmasock see
the same machine state; reported are median, min and max of --reps repetitions (default 5;
--quick: 1 short repetition, a smoke run, not a measurement).  Every rdmasock row is checked
in RDMASOCK_LOG_FILE: unless every connection of the run logged transport=shm (rdma for the
VM's rdma rows), the row is marked (fallback/unverified) and no ratio is claimed from it.
Progress goes to stderr.

Outputs: bench/results/<names>-<time>.json and .md (or --out-dir), and PNG plots next to
them when matplotlib can be imported (else skipped with a message: install python3-matplotlib)."""
