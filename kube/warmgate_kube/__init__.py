"""warmgate's Kubernetes access, shared by the operator, the router and the devcluster: the
client (`client`), the resources by name and path (`kinds`), list-then-watch into an in-memory
Store with explicit relists (`watch`), and reading plain-dict objects (`objects`)."""
