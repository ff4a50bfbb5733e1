"""The report: console tables, markdown and PNG plots of a run."""
import subprocess

from . import servers as S
from .common import log



def fmt_cell(v):
    if v is None:
        return ""
    if isinstance(v, float):
        if abs(v) >= 100:
            return "{:,.0f}".format(v)
        return "%.3g" % v
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)


def size_label(n):
    return "%d MiB" % (n >> 20) if n >= 1 << 20 and n % (1 << 20) == 0 else (
        "%d KiB" % (n >> 10) if n >= 1024 and n % 1024 == 0 else "%d B" % n)


def markdown(result):
    out = ["# rdmasock bench: %s" % ", ".join(result["benchmarks"]), "",
           "%s, host %s, %d CPUs, %s. Repetitions: %d%s. Command: `%s`%s" % (
               result["time"], result["host"], result["cpus"], result["kernel"], result["reps"],
               " (--quick: smoke run, not a measurement)" if result["quick"] else "", result["command"],
               ". Checkout " + checkout_text(result["git"]) if result.get("git") else ""), ""]
    for name, b in result["results"].items():
        out += ["## %s" % name, ""] + markdown_section(b)
    out.append("median / min / max over the repetitions; status `ok` on a rdmasock row means every connection "
               "of every repetition logged transport=shm (the Soft-RoCE VM's rdma rows: transport=rdma) in "
               "RDMASOCK_LOG_FILE.")
    return "\n".join(out) + "\n"


def markdown_section(b):
    """Markdown lines of one sub-benchmark's result: title, table, summary and targets."""
    out = [b.get("title", ""), ""]
    if "error" in b:
        return out + ["**failed:** `%s`" % b["error"][-500:], ""]
    cols = b["columns"]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "---|" * len(cols))
    for r in b["rows"]:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(size_label(v) if c == "size" else fmt_cell(v))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for s in b.get("summary", []):
        out.append("- " + s)
    for t in b.get("targets", []):
        out.append("- target " + t["text"])
    out.append("")
    return out


def plots(result, stem):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plots skipped: matplotlib is not importable (apt-get install python3-matplotlib, "
            "or pip install matplotlib into the venv)")
        return []
    made = []
    for name, b in result["results"].items():
        rows = [r for r in b.get("rows", []) if r.get("median")]
        if not rows:
            continue
        if name == "scale":
            made.append(plot_scale(plt, rows, b.get("title", ""), "%s-%s.png" % (stem, name)))
            continue
        fig, ax = plt.subplots(figsize=(9, 4.8))
        if name == "stream":
            series = {}
            for r in rows:
                series.setdefault("%s [%s]" % (r["name"], r["placement"]), []).append(r)
            for label, rs in series.items():
                rs.sort(key=lambda r: r["size"])
                ax.errorbar([r["size"] for r in rs], [r["median"] for r in rs],
                            yerr=[[r["median"] - r["min"] for r in rs], [r["max"] - r["median"] for r in rs]],
                            marker="o", capsize=3, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("write size (bytes)")
            ax.legend(fontsize=7)
        else:
            labels = []
            for r in rows:
                parts = [r["name"]]
                for k in ("conns", "scale", "clients", "impl"):
                    if k in r:
                        parts.append("%s=%s" % (k, r[k]))
                parts.append(r["placement"])
                labels.append(" ".join(parts) + ("" if r["status"] == "ok" else " (!)"))
            ys = [r["median"] for r in rows]
            colors = ["tab:green" if r.get("rdmasock") else ("tab:gray" if r.get("kind") == "limit" else "tab:blue")
                      for r in rows]
            ax.barh(range(len(rows)), ys, color=colors,
                    xerr=[[r["median"] - r["min"] for r in rows], [r["max"] - r["median"] for r in rows]], capsize=2)
            ax.set_yticks(range(len(rows)))
            ax.set_yticklabels(labels, fontsize=7)
            ax.invert_yaxis()
            if name == "pingpong":
                ax.set_xscale("log")
            ax.set_xlabel(rows[0]["unit"] + " (median, min-max)")
        title = b.get("title", "")
        ax.set_title(title if title.startswith(name) else "%s: %s" % (name, title), fontsize=9)
        fig.tight_layout()
        path = "%s-%s.png" % (stem, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def plot_scale(plt, rows, title, path):
    """scale: per tool, throughput vs N (top) and PSS per extra connection vs N (bottom)."""
    tools = sorted({r["tool"] for r in rows})
    fig, axes = plt.subplots(2, len(tools), figsize=(6 * len(tools), 7.5), squeeze=False)
    for col, tool in enumerate(tools):
        top, bottom = axes[0][col], axes[1][col]
        lines = [(kind, pl, color) for kind, color in (("tcp", "tab:blue"), ("rdmasock", "tab:green"))
                 for pl in sorted({r["placement"] for r in rows})]
        for kind, pl, color in lines:
            rs = sorted((r for r in rows if r["tool"] == tool and r["kind"] == kind and r["placement"] == pl),
                        key=lambda r: r["conns"])
            if not rs:
                continue
            label = "%s [%s]" % (rs[0]["name"], pl) + ("" if all(r["status"] == "ok" for r in rs) else " (!)")
            top.errorbar([r["conns"] for r in rs], [r["median"] for r in rs],
                         yerr=[[r["median"] - r["min"] for r in rs], [r["max"] - r["median"] for r in rs]],
                         marker="o" if pl != "unpinned" else "s", capsize=3, color=color, label=label)
            mem = [r for r in rs if r.get("kib_per_conn") is not None]
            bottom.plot([r["conns"] for r in mem], [r["kib_per_conn"] for r in mem], marker="o", color=color,
                        label=label)
        top.set_title("%s: throughput" % tool, fontsize=9)
        top.set_ylabel("tps" if tool == "pgbench" else "GET requests/s")
        bottom.set_title("%s: memory per extra connection, (PSS(N) - PSS(1)) / (N - 1)" % tool, fontsize=9)
        bottom.set_ylabel("KiB per connection")
        ns = sorted({r["conns"] for r in rows if r["tool"] == tool})
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns)
            ax.set_xticklabels([str(n) for n in ns])
            ax.set_xlabel("concurrent connections N")
            ax.legend(fontsize=7)
            ax.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_table(name, b):
    print("\n== %s: %s" % (name, b.get("title", "")))
    if "error" in b:
        print("FAILED: %s" % b["error"][-1000:])
        return
    cols = b["columns"]
    table = [cols] + [[size_label(r.get(c)) if c == "size" else fmt_cell(r.get(c)) for c in cols] for r in b["rows"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        print("  ".join(cell.ljust(w) if i in (0, 1) or not cell[:1].isdigit() else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))))
    for s in b.get("summary", []):
        print("  " + s)
    for t in b.get("targets", []):
        print("  target " + t["text"])


def checkout_text(git):
    """'<head>' or '<head> (shim/ or rdmasock/ modified)' from git_state()."""
    return git["head"] + (" (shim/ or rdmasock/ modified)" if git["shim_or_rdmasock_modified"] else "")


def git_state():
    """Commit of the checkout and whether shim/ or rdmasock/ had uncommitted changes (the
    numbers belong to the library as built, which may differ from the commit)."""
    try:
        head = subprocess.run(["git", "-C", S.REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", S.REPO, "status", "--porcelain", "--", "shim", "rdmasock"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return {"head": head, "shim_or_rdmasock_modified": bool(dirty)}
    except (OSError, subprocess.TimeoutExpired):
        return None
