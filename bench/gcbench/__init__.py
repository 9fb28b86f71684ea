"""The garbage-collection benchmark (`bench/gc.py`), by concern: `fill` (the store: a
deterministic plan written fast through the store's own encoders, and the garbage written back),
`measure` (the bare list and delete, one timed collection, the check of what it left) and
`session` (per backend rounds, the Ceph cluster, the figures and the JSON)."""
