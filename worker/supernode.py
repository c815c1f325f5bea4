"""`flower-supernode`, asking the SuperLink for a shorter heartbeat interval than Flower's 30 s.

The SuperLink declares a node gone after two missed intervals, and only then answers its pending
messages with NODE_UNAVAILABLE: with 30 s, a killed worker holds its round for a minute. The interval is
the node's to choose (the SuperLink accepts 10 s to 30 min), but flwr 1.42's SuperNode has no option for
it, only a module constant, which this launcher sets before running Flower's own entry point.

    python -m worker.supernode HEARTBEAT_SECONDS [flower-supernode arguments...]
"""

from __future__ import annotations

import sys

MIN_SECONDS, MAX_SECONDS = 10.0, 1800.0  # what flwr's fleet API accepts (HEARTBEAT_MIN/MAX_INTERVAL)


def set_heartbeat(seconds: float) -> None:
    """Make this process's SuperNode report (and be judged on) a `seconds` heartbeat interval."""
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection

    for module in (fleet_http_connection, heartbeat):
        if not hasattr(module, "HEARTBEAT_DEFAULT_INTERVAL"):  # a flwr whose SuperNode no longer reads it there
            raise SystemExit(f"error: {module.__name__} has no HEARTBEAT_DEFAULT_INTERVAL; this flwr is not the "
                             "1.42 that soma-edge pins: reinstall soma-edge")  # fmt: skip
        module.HEARTBEAT_DEFAULT_INTERVAL = seconds


def main() -> None:
    seconds = float(sys.argv[1])
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise SystemExit(f"error: heartbeat {seconds:g} s: Flower accepts {MIN_SECONDS:g} to {MAX_SECONDS:g} s")
    set_heartbeat(seconds)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *sys.argv[2:]]
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()
