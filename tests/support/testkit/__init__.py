"""layerstore's development kit: what the tests and the benchmarks share (a real single-node Ceph,
archive factories, EROFS, FUSE and runtime-shim helpers). A package of its own, installed into the
development environment beside layerstore (`make test`, `make bench`), never shipped with it."""
