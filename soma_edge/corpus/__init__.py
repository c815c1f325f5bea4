"""The corpus and how it is cut among experts.

- `documents`: Document, the train/val/test split by content hash (`split_of`, `by_split`), byte streams
  (`to_stream`), minibatches and held-out windows (`sample_batch`, `batch_rng`, `eval_windows`);
- `sources`: where documents come from (`load_documents`: default, debian, a file, a JSONL, a directory;
  `fetch` of the default corpus);
- `features`: the router's featurizer (hashed byte n-gram tf-idf, folded into a signed sketch);
- `kmeans`: balanced spherical k-means (`balanced_kmeans`);
- `router`: the predetermined router (`Router`, `fit`, `load`): clusters to experts, top-k routing;
- `mixture`: the routed mixture of experts' held-out loss over a byte stream;
- `holdout`: every cluster's quota of text (`Quota`), and held-out windows cut within documents (`cut`);
- `__main__`: `python -m soma_edge.corpus fetch`.

Depends on the basics only.
"""
