"""The processes soma-edge starts: Flower's binaries and their environment (`launch`), its stand-in commands
(`commands`, run as `python -m soma_edge.flower_commands`), whether a process is alive (`pids`), and the
loggers of code Flower runs in its own processes (`logs`).

Depends on the basics only.
"""
