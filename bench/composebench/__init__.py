"""The warm composition benchmark (`bench/compose.py`), by concern: `spec` (sizes, goals, the
environment's tag and probes), `project` (the only module that imports the project's internals),
`inputs` (the three layers' trees and the environment), `probes` (memory, latency statistics, the
lock timer, node facts), `contenders` (plain overlay and the shim API), `workloads` (clients, phases,
scales, the durability A/B), `session` (the run inside its mount namespace), `isolation` (the
namespace, the cgroup and the leftovers check, from outside) and `report` (medians, verdicts, summary)."""
