"""RDMA devices as pyverbs sees them: what `rdmasock doctor` reports, and the default choice.

    rdma_report()   -> dict: pyverbs status, memlock limit, every device / port / GID, the
                       probed max_inline_data, the port rdmasock would use, usable + reason
    usable()        -> (bool, reason): can this process carry a connection over RDMA?
    choose(...)     -> Choice: device, port and GID index to use (RDMASOCK_RDMA_DEVICE,
                       RDMASOCK_RDMA_PORT, RDMASOCK_RDMA_GID_INDEX, else the first ACTIVE
                       port with a RoCE v2 or IB GID)

    python -m rdmasock.devices [--json]     prints the report

pyverbs is imported lazily, so importing this module never fails: without pyverbs (Debian
package python3-pyverbs) the report says so.
"""
import ipaddress
import os
import resource
import sys
from collections import namedtuple

Choice = namedtuple("Choice", "device port gid_index gid gid_type link_layer active_mtu lid")

# ibv_gid_entry.gid_type (verbs.h enum ibv_gid_type)
GID_TYPE_NAMES = {0: "IB", 1: "RoCE v1", 2: "RoCE v2"}
# enum ibv_port_state
PORT_STATE_NAMES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
# enum ibv_mtu -> bytes
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
LINK_LAYER_NAMES = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
CAP_IPC_LOCK = 14
INLINE_PROBE_MAX = 4096      # largest max_inline_data asked for when probing
DEFAULT_RING_BYTES = 256 * 1024


class RdmaUnavailable(Exception):
    """No RDMA for this connection; .reason is a short machine-readable code."""

    def __init__(self, reason, detail=""):
        super().__init__("%s: %s" % (reason, detail) if detail else reason)
        self.reason = reason
        self.detail = detail


_pyverbs_error = None


def pyverbs_available():
    """(True, None) or (False, why) -- never raises."""
    global _pyverbs_error
    try:
        import pyverbs.device  # noqa: F401
        import pyverbs.enums  # noqa: F401
        return True, None
    except Exception as exc:  # ImportError, or a missing libibverbs.so.1
        _pyverbs_error = "%s: %s" % (type(exc).__name__, exc)
        return False, ("pyverbs cannot be imported (%s); install Debian's python3-pyverbs "
                       "(and rdma-core) and use an interpreter that sees it" % _pyverbs_error)


def gid_bytes(gid_str):
    """pyverbs prints GIDs as 8 groups of 4 hex digits: 16 raw bytes."""
    return ipaddress.IPv6Address(gid_str).packed


def gid_pretty(raw):
    """'::ffff:127.0.0.1' for IPv4-mapped GIDs, compressed IPv6 otherwise."""
    addr = ipaddress.IPv6Address(bytes(raw))
    if addr.ipv4_mapped is not None:
        return "::ffff:%s" % addr.ipv4_mapped
    return str(addr)


def _gid_rank(raw, gid_type):
    """Preference among the usable GIDs of one port (lower is better): an IPv4-mapped RoCE v2
    GID (what a routed RoCE network and our Soft-RoCE tests use), then a global IPv6 one, then
    link-local; on InfiniBand ports the IB GIDs in table order."""
    if gid_type == 0:
        return 0
    addr = ipaddress.IPv6Address(bytes(raw))
    if addr.ipv4_mapped is not None:
        return 0
    if not addr.is_link_local:
        return 1
    return 2


def memlock_limit():
    """{'soft': bytes or None (unlimited), 'hard': ..., 'cap_ipc_lock': bool}.  With
    CAP_IPC_LOCK (e.g. root) the kernel does not apply the limit to registered memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    inf = resource.RLIM_INFINITY
    cap = False
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    cap = bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return {"soft": None if soft == inf else soft, "hard": None if hard == inf else hard,
            "cap_ipc_lock": cap}


def memlock_needed(ring_bytes=None):
    """Bytes one connection pins on this side: its receive ring, its send staging ring and a
    page for the credit words."""
    if ring_bytes is None:
        try:
            from . import config
            ring_bytes = config.get().ring_size
        except Exception:
            ring_bytes = DEFAULT_RING_BYTES
    return 2 * ring_bytes + 4096


def _device_config(env):
    """The RDMA device settings in env (none known while the compiled module, which holds
    the configuration table, cannot be loaded: doctor says so elsewhere)."""
    try:
        names = [_config_name(k) for k in ("RDMA_DEVICE", "RDMA_PORT", "RDMA_GID_INDEX")]
    except ImportError:
        return {}
    return {name: env.get(name) for name in names}


def _config_name(key):
    from . import config
    return config.env_name(key)


def _env_int(env, name):
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value, 0)
    except ValueError:
        raise RdmaUnavailable("bad_config", "%s=%r is not a number" % (name, value))


def _port_gids(ctx, port, tbl_len):
    """[(index, raw16, type)] of the port's valid GIDs."""
    import pyverbs.device as d
    out = []
    for idx in range(tbl_len):
        try:
            entry = ctx.query_gid_ex(port, idx)
        except d.PyverbsError:
            continue                     # empty slot (EINVAL / ENODATA)
        raw = gid_bytes(entry.gid_str())
        if raw == bytes(16):
            continue
        out.append((idx, raw, entry.gid_type, entry.ndev_ifindex))
    return out


def _ifname(ifindex):
    if not ifindex:
        return None
    try:
        return __import__("socket").if_indextoname(ifindex)
    except OSError:
        return "ifindex %d (other namespace)" % ifindex


def probe_max_inline(ctx, want=INLINE_PROBE_MAX):
    """Largest max_inline_data an RC QP of this device accepts (binary search over QP
    creation, up to `want`), or raises the pyverbs error of the smallest attempt."""
    from pyverbs.pd import PD
    from pyverbs.cq import CQ
    from pyverbs.qp import QP, QPInitAttr, QPCap
    import pyverbs.enums as e
    pd = PD(ctx)
    cq = CQ(ctx, 4)
    try:
        def fits(n):
            cap = QPCap(max_send_wr=4, max_recv_wr=1, max_send_sge=1, max_recv_sge=1,
                        max_inline_data=n)
            try:
                qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
            except Exception:
                if n == 0:
                    raise
                return 0
            try:
                got = qp.query(e.IBV_QP_CAP)[1].cap.max_inline_data
            except Exception:
                got = n
            qp.close()
            return max(n, got)

        best = fits(0)
        lo, hi = 0, want
        if fits(hi):
            return max(best, fits(hi))
        while hi - lo > 1:               # invariant: lo fits, hi does not
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return max(best, lo)
    finally:
        cq.close()
        pd.close()


def _device_names():
    """Names of the RDMA devices; [] when libibverbs finds none (it then fails with ENOSYS
    or ENODEV rather than returning an empty list)."""
    import pyverbs.device as d
    try:
        devs = d.get_device_list()
    except d.PyverbsError:
        if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
            return []
        raise
    return [dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name) for dev in devs]


def rdma_report(probe_inline=True, ring_bytes=None, env=None):
    """Everything `rdmasock doctor` shows about RDMA, as a JSON-friendly dict."""
    env = os.environ if env is None else env
    rep = {
        "pyverbs": {"available": False, "error": None},
        "memlock": memlock_limit(),
        "memlock_needed_per_connection": memlock_needed(ring_bytes),
        "config": _device_config(env),
        "devices": [],
        "selected": None,
        "usable": False,
        "reason": None,
    }
    ok, why = pyverbs_available()
    rep["pyverbs"] = {"available": ok, "error": why}
    if not ok:
        rep["reason"] = why
        return rep
    import pyverbs.device as d
    try:
        names = _device_names()
    except Exception as exc:
        rep["reason"] = "cannot list RDMA devices: %s" % exc
        return rep
    for name in names:
        dev = {"name": name, "ports": [], "error": None}
        rep["devices"].append(dev)
        try:
            ctx = d.Context(name=name)
        except Exception as exc:
            dev["error"] = "cannot open: %s" % exc
            continue
        try:
            attr = ctx.query_device()
            dev.update(node_guid=d.guid_format(attr.node_guid) if hasattr(d, "guid_format") else None,
                       fw_version=attr.fw_version, max_qp_wr=attr.max_qp_wr, max_sge=attr.max_sge,
                       max_mr_size=attr.max_mr_size, phys_port_cnt=attr.phys_port_cnt)
            for port in range(1, attr.phys_port_cnt + 1):
                pa = ctx.query_port(port)
                gids = _port_gids(ctx, port, pa.gid_tbl_len)
                dev["ports"].append({
                    "port": port,
                    "state": PORT_STATE_NAMES.get(pa.state, str(pa.state)),
                    "link_layer": LINK_LAYER_NAMES.get(pa.link_layer, str(pa.link_layer)),
                    "active_mtu": MTU_BYTES.get(pa.active_mtu),
                    "max_mtu": MTU_BYTES.get(pa.max_mtu),
                    "lid": pa.lid,
                    "gids": [{"index": i, "gid": gid_pretty(raw),
                              "type": GID_TYPE_NAMES.get(t, str(t)), "netdev": _ifname(ifi)}
                             for i, raw, t, ifi in gids],
                })
            if probe_inline:
                try:
                    dev["max_inline_data"] = probe_max_inline(ctx)
                except Exception as exc:
                    dev["max_inline_data"] = None
                    dev["error"] = "cannot create an RC QP: %s" % exc
        except Exception as exc:
            dev["error"] = "query failed: %s" % exc
        finally:
            ctx.close()
    try:
        ch = choose(env=env)
        rep["selected"] = {"device": ch.device, "port": ch.port, "gid_index": ch.gid_index,
                           "gid": gid_pretty(ch.gid), "gid_type": GID_TYPE_NAMES.get(ch.gid_type),
                           "active_mtu": MTU_BYTES.get(ch.active_mtu)}
    except RdmaUnavailable as exc:
        rep["reason"] = str(exc)
        return rep
    except ImportError as exc:           # the configuration table is in the compiled module
        rep["reason"] = "the compiled data path cannot be loaded: %s" % exc
        return rep
    sel = next(x for x in rep["devices"] if x["name"] == rep["selected"]["device"])
    if probe_inline and sel.get("max_inline_data") is None:
        rep["reason"] = "device %s: %s" % (sel["name"], sel.get("error"))
        return rep
    ml = rep["memlock"]
    need = rep["memlock_needed_per_connection"]
    if not ml["cap_ipc_lock"] and ml["soft"] is not None and ml["soft"] < need:
        rep["reason"] = ("memlock limit %d bytes is below the %d one connection registers "
                         "(raise `ulimit -l` / LimitMEMLOCK, or run with CAP_IPC_LOCK)" % (ml["soft"], need))
        return rep
    rep["usable"] = True
    s = rep["selected"]
    rep["reason"] = "%s port %d GID index %d (%s %s), max_inline_data %s" % (
        s["device"], s["port"], s["gid_index"], s["gid_type"], s["gid"], sel.get("max_inline_data"))
    return rep


def usable(env=None, ring_bytes=None):
    """(True, description) if this process can set up an RDMA connection, else (False, why)."""
    rep = rdma_report(probe_inline=True, ring_bytes=ring_bytes, env=env)
    return rep["usable"], rep["reason"]


def choose(device=None, port=None, gid_index=None, env=None):
    """Pick device/port/GID: explicit arguments, then RDMASOCK_RDMA_{DEVICE,PORT,GID_INDEX},
    then the first ACTIVE port (devices in pyverbs order, ports ascending) that has a RoCE v2
    GID (Ethernet) or an IB GID (InfiniBand), and on it the best GID (_gid_rank).
    Raises RdmaUnavailable with a reason code."""
    env = os.environ if env is None else env
    ok, why = pyverbs_available()
    if not ok:
        raise RdmaUnavailable("no_pyverbs", why)
    import pyverbs.device as d
    device = device or env.get(_config_name("RDMA_DEVICE"), "").strip() or None
    port = port if port is not None else _env_int(env, _config_name("RDMA_PORT"))
    gid_index = gid_index if gid_index is not None else _env_int(env, _config_name("RDMA_GID_INDEX"))
    try:
        names = _device_names()
    except Exception as exc:
        raise RdmaUnavailable("no_device", "cannot list RDMA devices: %s" % exc)
    if not names:
        raise RdmaUnavailable("no_device", "no RDMA device (no RDMA NIC, and no Soft-RoCE link: "
                              "`modprobe rdma_rxe; rdma link add rxe0 type rxe netdev ETH`)")
    if device is not None:
        if device not in names:
            raise RdmaUnavailable("no_device", "RDMASOCK_RDMA_DEVICE=%s not among %s" % (device, ", ".join(names)))
        names = [device]
    problems = []
    for name in names:
        try:
            ctx = d.Context(name=name)
        except Exception as exc:
            problems.append("%s: cannot open (%s)" % (name, exc))
            continue
        try:
            nports = ctx.query_device().phys_port_cnt
            ports = [port] if port is not None else list(range(1, nports + 1))
            for p in ports:
                if not 1 <= p <= nports:
                    problems.append("%s has no port %d" % (name, p))
                    continue
                pa = ctx.query_port(p)
                if pa.state != 4:
                    problems.append("%s port %d is %s" % (name, p, PORT_STATE_NAMES.get(pa.state, pa.state)))
                    continue
                wanted = 0 if pa.link_layer == 1 else 2       # IB GIDs on IB, RoCE v2 on Ethernet
                gids = [g for g in _port_gids(ctx, p, pa.gid_tbl_len) if g[2] == wanted]
                if gid_index is not None:
                    gids = [g for g in gids if g[0] == gid_index]
                    if not gids:
                        problems.append("%s port %d GID index %d is empty or not %s"
                                        % (name, p, gid_index, GID_TYPE_NAMES[wanted]))
                        continue
                if not gids:
                    problems.append("%s port %d has no %s GID" % (name, p, GID_TYPE_NAMES[wanted]))
                    continue
                idx, raw, gtype, _ = min(gids, key=lambda g: (_gid_rank(g[1], g[2]), g[0]))
                return Choice(name, p, idx, raw, gtype, pa.link_layer, pa.active_mtu, pa.lid)
        finally:
            ctx.close()
    raise RdmaUnavailable("no_active_port", "; ".join(problems) or "no usable port")


def format_report(rep, summary=True):
    """The human-readable text of a report (summary: end with the "RDMA usable" line)."""
    out = []
    pv = rep["pyverbs"]
    out.append("pyverbs: %s" % ("available" if pv["available"] else pv["error"]))
    ml = rep["memlock"]
    fmt = lambda v: "unlimited" if v is None else "%d KiB" % (v // 1024)
    out.append("memlock: soft %s, hard %s%s; one connection registers %d KiB"
               % (fmt(ml["soft"]), fmt(ml["hard"]),
                  " (CAP_IPC_LOCK: limit not applied)" if ml["cap_ipc_lock"] else "",
                  rep["memlock_needed_per_connection"] // 1024))
    cfg = {k: v for k, v in rep["config"].items() if v}
    if cfg:
        out.append("config: " + " ".join("%s=%s" % kv for kv in cfg.items()))
    if pv["available"] and not rep["devices"]:
        out.append("devices: none")
    for dev in rep["devices"]:
        head = "device %s" % dev["name"]
        if "max_inline_data" in dev:
            head += ": max_inline_data %s" % dev["max_inline_data"]
        if "max_qp_wr" in dev:
            head += ", max_qp_wr %s, max_sge %s, fw %s" % (dev["max_qp_wr"], dev["max_sge"], dev["fw_version"] or "-")
        out.append(head)
        if dev.get("error"):
            out.append("  error: %s" % dev["error"])
        for p in dev["ports"]:
            out.append("  port %d: %s, %s, active MTU %s (max %s)%s"
                       % (p["port"], p["state"], p["link_layer"], p["active_mtu"], p["max_mtu"],
                          ", LID %d" % p["lid"] if p["link_layer"] == "InfiniBand" else ""))
            for g in p["gids"]:
                out.append("    GID %3d  %-8s %-40s %s" % (g["index"], g["type"], g["gid"], g["netdev"] or ""))
    if rep["selected"]:
        s = rep["selected"]
        out.append("selected: %s port %d GID index %d (%s %s)"
                   % (s["device"], s["port"], s["gid_index"], s["gid_type"], s["gid"]))
    if summary:
        out.append("RDMA usable: %s -- %s" % ("yes" if rep["usable"] else "no", rep["reason"]))
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rep = rdma_report()
    if "--json" in argv:
        import json
        print(json.dumps(rep, indent=2, default=str))
    else:
        print(format_report(rep))
    return 0 if rep["usable"] else 1


if __name__ == "__main__":
    sys.exit(main())
