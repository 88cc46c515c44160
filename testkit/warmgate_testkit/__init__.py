"""warmgate's test kit: what the tests and benchmarks share, and no image installs.

- `process`: a real server process (ServerProcess) and the real MiniLM model's folder;
- `zoo`: tiny models of every family the server serves, made locally with their real config,
  model and tokenizer classes (sentence-transformers, a test dependency, writes them).

The server image holds the server's runtime code only: server/Dockerfile copies
server/warmgate_server, and its build fails if this package or a test module is importable.
"""
