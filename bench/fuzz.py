"""Fuzz the parsers that read untrusted bytes, with hypothesis: tar streams, OCI image layouts
and docker save archives, chunk objects, chunk maps, and the manifest package's documents
(manifests, signatures, trust policies, prefetch traces). Inputs and targets come from
`testkit.fuzzing` (random bytes and mutations of valid objects built through the public
encoders); the suite runs the same targets with a few hundred examples each
(tests/test_fuzz_parsers.py).

A finding is any exception that is not a `LayerstoreError`. Findings are recorded, not raised,
so a run always covers its inputs; per parser the run records the inputs, findings (type,
message, a sample input), the rate, and the slowest single input (a hang shows there). The
process's peak RSS is recorded once.

Writes bench/results/fuzz.json (full) or fuzz-quick.json. Usage: python bench/fuzz.py
[--size quick|full] [--inputs N] [--only tar,oci,...] [--seed S]; exits 1 when there was a finding.
`--size` defaults to $BENCH_SIZE (as `make bench` sets it), else full: 100,000 inputs per parser
(~25 minutes here, most of it the OCI layouts at ~8 ms an input); quick: 2,000 per parser (~30 s;
still several times the suite's few hundred, with the same seed so a finding repeats).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import resource
import shutil
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings
from testkit import fuzzing

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {"quick": 2_000, "full": 100_000}  # inputs per parser


def fuzz(target: fuzzing.Target, inputs: int, rng_seed: int) -> dict[str, object]:
    findings: collections.Counter[str] = collections.Counter()
    samples: dict[str, str] = {}
    count = 0
    slowest = 0.0

    @seed(rng_seed)
    @settings(max_examples=inputs, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(target.strategy)
    def run(value: object) -> None:
        nonlocal count, slowest
        count += 1
        t0 = time.perf_counter()
        error = fuzzing.run_one(target, value)
        slowest = max(slowest, time.perf_counter() - t0)
        if error is not None:
            key = f"{type(error).__name__}: {str(error)[:160]}"
            findings[key] += 1
            samples.setdefault(key, repr(value)[:400])

    start = time.perf_counter()
    run()
    elapsed = time.perf_counter() - start
    return {"inputs": count, "seconds": round(elapsed, 1), "inputs_per_second": round(count / elapsed, 1),
            "slowest_input_ms": round(slowest * 1000, 2), "findings": sum(findings.values()),
            "finding_kinds": [{"error": k, "count": n, "sample": samples[k]} for k, n in findings.most_common()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("BENCH_SIZE") or "full")
    ap.add_argument("--inputs", type=int, default=None, help="inputs per parser (default: the size's)")
    ap.add_argument("--only", default="", help="comma-separated parser names")
    ap.add_argument("--seed", type=int, default=12)
    args = ap.parse_args()
    args.inputs = SIZES[args.size] if args.inputs is None else args.inputs
    if args.inputs < 1:
        ap.error("--inputs must be at least 1")
    oci = fuzzing.OciTarget.create()
    known = [t.name for t in fuzzing.targets(oci)]
    if unknown := set(args.only.split(",")) - set(known) - {""}:
        shutil.rmtree(oci.root, ignore_errors=True)
        ap.error(f"--only: unknown parser(s) {', '.join(sorted(unknown))} (known: {', '.join(known)})")
    chosen = [t for t in fuzzing.targets(oci) if not args.only or t.name in args.only.split(",")]
    result: dict[str, object] = {"size": args.size, "inputs_per_parser": args.inputs, "seed": args.seed,
                                 "python": platform.python_version(), "parsers": {}}
    try:
        for target in chosen:
            res = fuzz(target, args.inputs, args.seed)
            result["parsers"][target.name] = res  # type: ignore[index]
            print(f"{target.name}: {res['inputs']} inputs, {res['inputs_per_second']}/s, "
                  f"slowest {res['slowest_input_ms']} ms, {res['findings']} findings", flush=True)
    finally:
        shutil.rmtree(oci.root, ignore_errors=True)
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out = RESULTS / ("fuzz.json" if args.size == "full" else f"fuzz-{args.size}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(1 if any(r["findings"] for r in result["parsers"].values()) else 0)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
