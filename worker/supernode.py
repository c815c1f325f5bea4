"""`flower-supernode`, with a heartbeat interval of our choosing instead of Flower's fixed 30 s.

The SuperLink declares a node gone after two missed intervals, and only then answers its pending
messages with NODE_UNAVAILABLE: with 30 s, a killed worker holds its round for a minute. The interval is
the node's to choose (the SuperLink accepts 10 s to 30 min, and takes the one each heartbeat reports),
but flwr 1.42's SuperNode has no option for it, only a module constant, which this launcher sets before
running Flower's own entry point, and, with `auto`, keeps setting to what the coordinator advises: 10 s
where the node's link is fast, 30 s on a slow one (its queue can hold heartbeats off for longer than
2 x 10 s during a large transfer). The advice arrives with the capability query, each train request,
and on its own when a measured link changes it; the ClientApp leaves it in the cache, where a thread
here reads it.

It also polls for messages every 0.5 s for a while after it starts and after each reply it sends
(`eager_polls`): the capability query, and the next round's request (pipelined rounds), are then seconds
away, and Flower's 3 s idle poll is the largest wait left between a worker's rounds.

    python -m worker.supernode SECONDS|auto CACHE [flower-supernode arguments...]
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from soma_edge.wire.protocol import HEARTBEAT_MAX, HEARTBEAT_MIN, HEARTBEAT_SLOW
from worker.cache import HEARTBEAT_ADVICE, Cache

AUTO_START = HEARTBEAT_SLOW  # until the coordinator has measured the link: Flower's own default
POLL_SECONDS = 0.5  # how often the advice in the cache is read: it counts from the next heartbeat (~4 s)
FLOWER_IDLE_POLL = 3  # flwr 1.42's SuperNode: time.sleep(3) after a pull that found no message
EAGER_SECONDS = 20.0  # after start and each reply, poll every EAGER_POLL s this long (then Flower's 3 s again)
EAGER_POLL = 0.5


def set_heartbeat(seconds: float) -> None:
    """Make this process's SuperNode report (and be judged on) a `seconds` heartbeat interval. It sends
    one every ~4 s whatever it reports (Flower's sender waits 0.8 x (interval - 5 s) between them), so a
    new interval counts within seconds, and a slow link gets many tries."""
    # flwr (~1 s to load) only in the SuperNode process itself, not in whoever imports this module's constants
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection

    for module in (fleet_http_connection, heartbeat):
        if not hasattr(module, "HEARTBEAT_DEFAULT_INTERVAL"):  # a flwr whose SuperNode no longer reads it there
            raise SystemExit(
                f"error: {module.__name__} has no HEARTBEAT_DEFAULT_INTERVAL; this flwr is not the "
                "1.42 that soma-edge pins: reinstall soma-edge"
            )
    fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL = seconds  # what each heartbeat reports
    heartbeat.HEARTBEAT_DEFAULT_INTERVAL = HEARTBEAT_MIN  # what the sender's period is computed from


def eager_polls(window: float = EAGER_SECONDS, poll: float = EAGER_POLL) -> None:
    """Make this process's SuperNode poll every `poll` seconds for `window` seconds from now (its capability
    query comes seconds after it connects) and after each reply it pushes, instead of Flower's bare 3 s:
    idle traffic stays Flower's, the query and a round's next request are picked up ~1.25 s sooner on
    average. flwr 1.42 has no option for it: its loop's module globals are wrapped."""
    from flwr.supernode import start_client_internal as sci  # flwr: heavy, see set_heartbeat

    if not all(hasattr(sci, name) for name in ("time", "_push_messages")):
        raise SystemExit(
            "error: flwr.supernode.start_client_internal has changed; this flwr is not the 1.42 that "
            "soma-edge pins: reinstall soma-edge"
        )
    real_push, real_time = sci._push_messages, sci.time
    last = [real_time.monotonic()]

    def push(*args, **kwargs):
        try:
            return real_push(*args, **kwargs)
        finally:
            last[0] = real_time.monotonic()

    class Clock:  # `time` as the module sees it, with the idle poll shortened after a reply
        def __getattr__(self, name):
            return getattr(real_time, name)

        def sleep(self, seconds: float) -> None:
            eager = seconds == FLOWER_IDLE_POLL and real_time.monotonic() - last[0] < window
            real_time.sleep(poll if eager else seconds)

    sci._push_messages, sci.time = push, Clock()


def follow_advice(cache: Path, stop: threading.Event, poll: float = POLL_SECONDS) -> None:
    """Apply the coordinator's advised interval whenever it changes, until `stop` is set."""
    store, current = Cache(cache), None
    while not stop.wait(poll):
        advice = store.get_json(HEARTBEAT_ADVICE)
        if isinstance(advice, (int, float)) and HEARTBEAT_MIN <= advice <= HEARTBEAT_MAX and advice != current:
            set_heartbeat(float(advice))
            current = advice


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m worker.supernode SECONDS|auto CACHE [flower-supernode arguments...]")
    mode, cache = sys.argv[1], Path(sys.argv[2])
    if mode == "auto":
        Cache(cache).put_json(HEARTBEAT_ADVICE, AUTO_START)  # not a previous session's advice: links change
        set_heartbeat(AUTO_START)
        threading.Thread(target=follow_advice, args=(cache, threading.Event()), daemon=True).start()
    else:
        seconds = float(mode)
        if not HEARTBEAT_MIN <= seconds <= HEARTBEAT_MAX:
            raise SystemExit(f"error: heartbeat {seconds:g} s: Flower accepts {HEARTBEAT_MIN:g} to {HEARTBEAT_MAX:g} s")
        set_heartbeat(seconds)
    eager_polls()
    from flwr.supernode.cli import flower_supernode  # flwr: heavy, see set_heartbeat

    sys.argv = ["flower-supernode", *sys.argv[3:]]
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()
