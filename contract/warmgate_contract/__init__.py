"""What warmgate's operator and server agree on, in one place both import: the shape and the
warmup plan, the server's flag table, the `/ready` report and the warmup profile, and the names
(API, labels, annotations, conditions, reasons, headers). Standard library only: no torch, no
kopf, no kubernetes client. docs/contract.md describes it for people."""
