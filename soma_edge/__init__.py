"""soma-edge: forward-only (SPSA) training of sharded byte-level LSTM experts.

The core the three roles (coordinator/, worker/, export/) share, in layers; every import points down:

- basics, at this level: `errors`, `devices` (device names), `config`, `records` (typed records), `codec`
  (bounded msgpack), `checkpoint` (atomic, checksummed files), `cli` (the CLIs' shared contract), and
  `flower_commands` (the entry point of Flower's stand-in commands);
- `corpus/`: documents and their split, where they come from, the router and its featurizer, the routed
  mixture's score (`python -m soma_edge.corpus fetch`);
- `spsa/`: the estimator: keyed noise, the step, the update and its schedule, update logs and their replay;
- `expert/`: an expert's parameter layout, its ONNX graphs (loss, train, population, update), the CUDA
  kernel table, and its steps as a run's config defines them;
- `engine/`: the expert on ONNX Runtime: sessions and devices, the evaluators, the expert resident on its
  device, CUDA graph capture;
- `wire/`: what crosses between coordinator and workers: the message schema and the TLS material;
- `rundir/`: a run directory: its layout and lock, its state records, its metrics, the seed run;
- `processes/`: starting Flower's processes and watching them, and their loggers.

docs/ARCHITECTURE.md draws the layers and their arrows.
"""

__version__ = "0.1.0"
