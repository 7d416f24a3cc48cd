"""What one rank sent to other communication domains: the counters behind a step line's
``bridge`` part and the run's ``bridge_bytes`` (runtime/communication.py counts into them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BridgeTraffic:
    """What this rank sent to other domains since :meth:`reset`: its sends and bridge all-reduces
    (messages), the bytes it sent (a bridge all-reduce of M bytes among D ranks sends
    2(D-1)/D x M, as gloo's ring does, which torch's gloo group runs: it names no algorithm and gloo
    runs an unnamed one as its ring; what a plan's crossings count), the time spent copying between
    device and host, and the time inside bridge collectives (waits for slower peers included;
    pipeline transfers overlap the schedule and are not timed)."""

    messages: int = 0
    bytes: float = 0.0
    staging_s: float = 0.0
    collective_s: float = 0.0

    def sent(self, nbytes: float) -> None:
        """One send or bridge all-reduce of ``nbytes`` sent by this rank."""
        self.messages += 1
        self.bytes += nbytes

    def reset(self) -> None:
        self.messages, self.bytes, self.staging_s, self.collective_s = 0, 0.0, 0.0, 0.0
