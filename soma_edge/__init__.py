"""soma-edge: forward-only (SPSA) training of sharded byte-level LSTM experts."""

__version__ = "0.1.0"
