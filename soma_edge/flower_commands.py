"""The entry point of Flower's stand-in commands, `python -m soma_edge.flower_commands NAME [arguments...]`
(soma_edge.processes.commands writes this module's path into them, so it stays here for good)."""

from soma_edge.processes.commands import main

if __name__ == "__main__":
    main()
