"""pallas_loop's internals: private, may change. The map of these modules, and
how a call flows from `iterate` to the kernels and back: docs/architecture.md."""
