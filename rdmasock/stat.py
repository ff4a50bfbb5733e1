"""`rdmasock stat`: the role `ss` plays for TCP.  Lists the processes that have
librdmasock.so loaded and, per connection, addresses, transport, bytes and the fallback
reason, read from each process's table (shim/preload/rs_stats.c) through /proc/PID/fd:
the same access rules as /proc itself (the process's user, or root)."""
import json
import os
import socket
import struct

import psutil

from . import reasons

HDR = struct.Struct("<IIIIIIQQ")                # struct rs_stat_hdr (its first 40 of 64 bytes)
HDR_SIZE = 64
SLOT = struct.Struct("<IiBBH28s28s4xQQ8x")     # struct rs_stat_slot, 96 bytes
MAGIC = 0x5453534B
TRANSPORTS = {0: "tcp", 1: "shm", 2: "rdma"}
ROLES = {1: "client", 2: "server"}


def _addr(raw):
    family = struct.unpack_from("<H", raw)[0]
    if family == socket.AF_INET:
        return "%s:%d" % (socket.inet_ntop(socket.AF_INET, raw[4:8]), struct.unpack_from(">H", raw, 2)[0])
    if family == socket.AF_INET6:
        return "[%s]:%d" % (socket.inet_ntop(socket.AF_INET6, raw[8:24]), struct.unpack_from(">H", raw, 2)[0])
    return "-"


def _tables(pid):
    """Contents of the stats tables a process holds open (its own first)."""
    fd_dir = "/proc/%d/fd" % pid
    for name in os.listdir(fd_dir):
        try:
            if not os.readlink(os.path.join(fd_dir, name)).startswith("/memfd:rdmasock-stats"):
                continue
            with open(os.path.join(fd_dir, name), "rb") as f:
                data = f.read()
        except OSError:
            continue
        if len(data) >= HDR_SIZE:
            yield data


def _preloaded(proc):
    try:
        return any(m.path.endswith("librdmasock.so") for m in proc.memory_maps(grouped=True))
    except (psutil.Error, OSError):
        return False


def collect():
    out = []
    for proc in psutil.process_iter(["pid", "name", "username"]):
        if not _preloaded(proc):
            continue
        entry = {"pid": proc.info["pid"], "name": proc.info["name"], "user": proc.info["username"], "connections": []}
        try:
            tables = list(_tables(proc.info["pid"]))
        except OSError as exc:
            entry["error"] = exc.strerror
            tables = []
        for data in tables:
            magic, version, nslots, slot_size, owner, _, ring_bytes, ring_max = HDR.unpack_from(data)
            if magic != MAGIC or owner != proc.info["pid"] or slot_size != SLOT.size:
                continue                         # a parent's table inherited across fork
            if version >= 2:
                entry["ring_memory"], entry["ring_memory_max"] = ring_bytes, ring_max
            for i in range(nslots):
                off = HDR_SIZE + i * slot_size
                if off + slot_size > len(data):
                    break
                used, fd, transport, role, reason, local, peer, tx, rx = SLOT.unpack_from(data, off)
                if not used:
                    continue
                entry["connections"].append({
                    "fd": fd, "role": ROLES.get(role, "?"), "local": _addr(local), "peer": _addr(peer),
                    "transport": TRANSPORTS.get(transport, "?"), "bytes_sent": tx, "bytes_received": rx,
                    "fallback_reason": reasons.name(reason) if reason else None})
        out.append(entry)
    return out


def main(as_json=False):
    procs = collect()
    if as_json:
        print(json.dumps(procs, indent=2))
        return 0
    if not procs:
        print("no process has librdmasock.so loaded")
        return 0
    fmt = "%-8s %-16s %-6s %-6s %-24s %-24s %-9s %12s %12s  %s"
    print(fmt % ("PID", "PROGRAM", "FD", "ROLE", "LOCAL", "PEER", "TRANSPORT", "SENT", "RECEIVED", "REASON"))
    for p in procs:
        if not p["connections"]:
            print(fmt % (p["pid"], p["name"][:16], "-", "-", "-", "-", "-", "-", "-", p.get("error", "")))
        for c in p["connections"]:
            print(fmt % (p["pid"], p["name"][:16], c["fd"], c["role"], c["local"], c["peer"], c["transport"],
                         c["bytes_sent"], c["bytes_received"], c["fallback_reason"] or ""))
    for p in procs:
        if "ring_memory" in p:
            print("%d %s: ring memory %.1f MiB of %.1f MiB (RDMASOCK_RING_MEMORY_MAX)"
                  % (p["pid"], p["name"], p["ring_memory"] / 2**20, p["ring_memory_max"] / 2**20))
    return 0
