"""Bytes this rank really wrote to the network, as the kernel counts them.

Linux counts, per process, every byte passed to a write-type system call (`wchar` in
/proc/<pid>/io: write, writev, sendmsg, send...). gloo's TCP transport sends through those
calls, from its worker threads and sometimes from the calling thread, so the counter's growth
over a stretch of code is the bytes this rank put on the wire in it, headers included, plus
whatever else the process wrote to files meanwhile. Our own file writes in a rank (the event
log, mainly) go through `note_own_write`, and `sent()` subtracts them.

What the counter cannot see, and how the figures say so:

* NCCL moves bytes GPU to GPU (NVLink, InfiniBand verbs) without write calls: `WIRE_UNSEEN`.
* Other systems have no /proc/<pid>/io: `available()` is False and only the booked bytes
  (distlab.comm) are shown, labelled as such.

Measured on this stack (gloo, 10 MB float tensors, torch 2.13, tests/test_wire.py): all-reduce
writes 2(N-1)/N·S per rank and all-gather (N-1)/N·|out|, as the ring formulas say; gloo's
reduce-scatter writes 2(N-1)/N·S, twice the ring's (N-1)/N·S, and its broadcast is a binomial
tree (at 4 ranks the root writes 2S, one rank S, two ranks nothing).
"""

from __future__ import annotations

import sys

_PROC_IO = "/proc/self/io"
WIRE_UNSEEN = ("NCCL moves bytes GPU to GPU without system calls: the kernel's counter cannot "
               "see them, so only the booked bytes are shown")
NO_COUNTER = "this system has no /proc/self/io: only the booked bytes are shown"

_own = 0  # bytes this process wrote to its own files through note_own_write


def available() -> bool:
    """Whether the kernel's per-process write counter can be read here (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return _wchar() >= 0
    except OSError:
        return False


def _wchar() -> int:
    with open(_PROC_IO, "rb") as f:
        for line in f:
            if line.startswith(b"wchar:"):
                return int(line.split()[1])
    raise OSError(f"{_PROC_IO} has no wchar field")


def note_own_write(nbytes: int) -> None:
    """A rank's own file write of `nbytes` (the event log): not network traffic."""
    global _own
    _own += int(nbytes)


def sent() -> int:
    """Bytes this process has written, less its own noted file writes (monotonic)."""
    return _wchar() - _own


def visible(backend: str) -> str | None:
    """None when the counter sees this backend's traffic, else the reason it does not."""
    if not available():
        return NO_COUNTER
    if backend == "nccl":
        return WIRE_UNSEEN
    return None


class Ledger:
    """This process's wire bytes over one step, split by collective where the split is exact.

    A blocking collective issued while nothing else is in flight is measured alone: the
    counter's growth across the call is its bytes (`exact`). Asynchronous collectives overlap
    each other and the computation, so they are measured together, over the step: the step's
    total less the exact part is shared among the kinds that could not be measured alone
    (`unmeasured`), and given to a kind only when it is the only one.
    """

    def __init__(self):
        self.blind: str | None = NO_COUNTER
        self.mark = 0
        self.exact: dict[str, int] = {}
        self.unmeasured: set[str] = set()
        self.books_all = True  # False: torch's own collectives run too (Strategy)

    def open(self, backend: str) -> None:
        """Start counting for a process group on `backend` (sets `blind` when it cannot)."""
        self.blind = visible(backend)
        self.begin()

    def begin(self) -> None:
        """A new step: what came before it is not its traffic."""
        self.exact, self.unmeasured = {}, set()
        self.mark = sent() if self.blind is None else 0

    def now(self) -> int | None:
        return sent() if self.blind is None else None

    def add_exact(self, kind: str, nbytes: int) -> None:
        self.exact[kind] = self.exact.get(kind, 0) + int(nbytes)

    def add_unmeasured(self, kind: str) -> None:
        self.unmeasured.add(kind)

    def end(self) -> dict:
        """The step's wire figures: {"sent", "by_kind"}, or {"sent": None, "why"}."""
        if self.blind is not None:
            return {"sent": None, "why": self.blind}
        total = sent() - self.mark
        by_kind = dict(self.exact)
        rest = total - sum(by_kind.values())
        if rest:
            # one unmeasured kind takes all of the rest, several share it jointly; "not booked":
            # torch's own collectives (books_all False) or, alone, a stray write
            shared = sorted(self.unmeasured) + ([] if self.books_all else ["not booked"])
            key = "+".join(shared) or "not booked"
            by_kind[key] = by_kind.get(key, 0) + rest
        out = {"sent": total, "by_kind": by_kind}
        self.begin()
        return out


LEDGER = Ledger()  # one per process: a rank's Comm objects (one per mesh group) share it


# What each packet on a link carries besides its payload: Ethernet 14 + IPv4 20 + TCP 20 + the
# timestamp option Linux adds to every segment (net.ipv4.tcp_timestamps=1), padded to 12. (A SYN
# carries a few more option bytes, an ARP packet is smaller: a few packets per run.)
FRAME_HEADER_BYTES = 66


def link_counters(dev: str | None) -> dict | None:
    """What the network interface `dev` has sent: {"dev", "sent": bytes, "packets": frames}, from its
    own counters (/sys/class/net/<dev>/statistics). In a simulated node (distlab.caller.cluster)
    GLOO_SOCKET_IFNAME names the node's link, so two readings bracket what every rank of the
    node sent across it. None without a device or where it cannot be read."""
    if not dev:
        return None
    try:
        with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as b, \
                open(f"/sys/class/net/{dev}/statistics/tx_packets") as p:
            return {"dev": dev, "sent": int(b.read()), "packets": int(p.read())}
    except OSError:
        return None
