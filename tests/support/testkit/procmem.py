"""A process's memory from /proc/PID/status (issue 27's hostile tests measure RSS growth)."""

from __future__ import annotations

MiB = 1 << 20


def status_kib(pid: int, field: str) -> int:
    """A `kB` field of /proc/PID/status (VmRSS: resident now; VmHWM: the most resident so far)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss(pid: int) -> int:
    return status_kib(pid, "VmRSS") * 1024


def peak_rss(pid: int) -> int:
    return status_kib(pid, "VmHWM") * 1024


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/PID/clear_refs); False if
    not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
