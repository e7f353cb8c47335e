"""Clients of a running server, outside the server core: `helios bench` (bench.py with the
prefix-cache workloads of bench_cache.py and the editing workload of bench_edit.py, their data in
bench_data/), `python -m helios.clients.benchserve` (starts Helios and benches it) and `helios top`
(top.py). Nothing in the server imports this package (an import-linter contract)."""
