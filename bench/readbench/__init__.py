"""The read benchmark (`bench/read.py`), by concern: `spec` (sizes, contenders, goals), `project` (the
only module that imports the project's internals), `inputs` (the trees the images are built from),
`probes` (timers, CPU, page cache), `mounts` (EROFS mounts and the node daemon), `workloads` (what is
read), `contenders` (one timed run per contender), `hitpath` (the cost per FUSE request), `s3` (cold
reads from Ceph RGW), `report` (figures, ratios, goals, the JSON) and `session` (the whole run)."""
