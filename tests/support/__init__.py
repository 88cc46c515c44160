"""What the tests share: kubectl and JSON helpers, the operator as a process, manifests, fakes,
and the tiny test server pods run. Importable as `support` (pytest's `pythonpath`)."""
