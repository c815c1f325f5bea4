"""What crosses between the coordinator and its workers.

- `protocol`: the federation's message schema, versioned, and the checks on replies (`task`, `check_result`,
  `check_log`, `weights_sha256`);
- `certs`: TLS material for a federation (`make_certs`).

Depends on the basics, spsa/ and expert/.
"""
