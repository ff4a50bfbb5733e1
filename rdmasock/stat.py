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
from ._native import ffi, lib

# The table's layout is shim/rs_contract.h's (struct rs_stat_hdr, rs_stat_slot), as the
# compiler laid it out: cffi reads it from there.
HDR_SIZE = ffi.sizeof("struct rs_stat_hdr")
SLOT_SIZE = ffi.sizeof("struct rs_stat_slot")
TRANSPORTS = reasons.TRANSPORTS
ROLES = {lib.RS_ROLE_CLIENT: "client", lib.RS_ROLE_SERVER: "server"}


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
            buf = ffi.from_buffer(data)
            hdr = ffi.cast("struct rs_stat_hdr *", buf)
            if hdr.magic != lib.RS_STAT_MAGIC or hdr.pid != proc.info["pid"] or hdr.slot_size != SLOT_SIZE:
                continue                         # a parent's table inherited across fork
            if hdr.version >= 2:
                entry["ring_memory"], entry["ring_memory_max"] = hdr.ring_bytes, hdr.ring_max
            for i in range(hdr.nslots):
                off = HDR_SIZE + i * SLOT_SIZE
                if off + SLOT_SIZE > len(data):
                    break
                slot = ffi.cast("struct rs_stat_slot *", buf + off)
                if not slot.used:
                    continue
                entry["connections"].append({
                    "fd": slot.fd, "role": ROLES.get(slot.role, "?"),
                    "local": _addr(bytes(ffi.buffer(slot.local))), "peer": _addr(bytes(ffi.buffer(slot.peer))),
                    "transport": TRANSPORTS.get(slot.transport, "?"), "bytes_sent": slot.tx_bytes,
                    "bytes_received": slot.rx_bytes, "bytes_spilled": slot.tx_spilled,
                    "fallback_reason": reasons.name(slot.reason) if slot.reason else None})
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
    fmt = "%-8s %-16s %-6s %-6s %-24s %-24s %-9s %12s %12s %12s  %s"
    print(fmt % ("PID", "PROGRAM", "FD", "ROLE", "LOCAL", "PEER", "TRANSPORT", "SENT", "RECEIVED", "SPILLED",
                 "REASON"))
    for p in procs:
        if not p["connections"]:
            print(fmt % (p["pid"], p["name"][:16], "-", "-", "-", "-", "-", "-", "-", "-", p.get("error", "")))
        for c in p["connections"]:
            print(fmt % (p["pid"], p["name"][:16], c["fd"], c["role"], c["local"], c["peer"], c["transport"],
                         c["bytes_sent"], c["bytes_received"], c["bytes_spilled"], c["fallback_reason"] or ""))
    for p in procs:
        if "ring_memory" in p:
            print("%d %s: ring memory %.1f MiB of %.1f MiB (RDMASOCK_RING_MEMORY_MAX)"
                  % (p["pid"], p["name"], p["ring_memory"] / 2**20, p["ring_memory_max"] / 2**20))
    return 0
