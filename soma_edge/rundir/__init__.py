"""A run directory: everything one federated training run owns.

- `layout`: its files and its lock (`RunDir`, `hold`);
- `state`: the typed records of state.msgpack and prepare.json (`RunState`, `ExpertRecord`, `PrepareSummary`);
- `metrics`: the lines of metrics.jsonl and status.json;
- `seed`: the seed run's shards and rules.

Depends on the basics, corpus/ and wire/.
"""
