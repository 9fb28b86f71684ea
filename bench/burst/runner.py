"""One contender's burst, run as a child process inside the contender's memory cgroup.

    python -m bench.burst.runner PLAN.json

The protocol with the orchestrator (lines on stdin/stdout) lets it read the link, disk and memory
counters at exactly the right moments:
    runner: READY            (in its cgroup, node prepared, nothing fetched yet)
    orch:   GO               (counters read; the burst starts now)
    runner: DONE <path>      (every sandbox exited; results written)
                             (plan mode "pulls": PullImage alone, crinode.CriNode.time_pulls)
    orch:   TEARDOWN         (counters read again)
    runner: exits after unmounting and stopping what it started.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Protocol

from . import cgroups, spec
from .sandbox import SandboxResult
from .spec import CONTAINERD_CONTENDERS, CRI_CONTENDERS, LAYERSTORE_CONTENDERS


class Contender(Protocol):
    def run_sandbox(self, index: int, env: str, command: list[str], result: SandboxResult) -> None: ...

    def teardown(self) -> None: ...

    def facts(self) -> dict[str, object]: ...


def make_contender(plan: dict[str, Any]) -> Contender:
    kind = plan["contender"]
    node_dir = Path(plan["node_dir"])
    if kind == "conventional":
        from .conventional import ConventionalNode

        return ConventionalNode(node_dir, endpoint=plan["endpoint"], bucket=plan["bucket"],
                                runc_root=Path(plan["runc_root"]))
    if kind in LAYERSTORE_CONTENDERS:
        from .lazy import LayerstoreNode

        return LayerstoreNode(node_dir, store_url=plan["store_url"], env_refs=plan["env_refs"],
                              eager=kind == "eager", layerctl=plan["layerctl"],
                              launcher="cli" if kind == "lazy-cli" else "api",
                              daemon_args=list(spec.DAEMON_ARGS.get(kind, ())))
    node = {"image_refs": plan.get("image_refs"), "snapshotter": plan.get("snapshotter"),
            "registry": plan.get("registry"), "layerctl": plan["layerctl"], "store_url": plan["store_url"]}
    if kind in CONTAINERD_CONTENDERS:
        from .ctrnode import ContainerdNode

        return ContainerdNode(node_dir, **node)
    if kind in CRI_CONTENDERS:
        from .crinode import CriNode

        return CriNode(node_dir, pause=plan["pause"], **node)
    raise ValueError(f"unknown contender {kind!r}")


def burst(contender: Contender, sandboxes: list[str], t0: float) -> list[SandboxResult]:
    results = [SandboxResult(i, env, launched=t0) for i, env in enumerate(sandboxes)]

    def one(r: SandboxResult) -> None:
        try:
            r.launched = time.time()
            contender.run_sandbox(r.index, r.env, spec.task_command(spec.environment(r.env)), r)
        except BaseException as e:  # noqa: BLE001 - recorded per sandbox
            r.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            if r.finished is None:
                r.finished = time.time()

    threads = [threading.Thread(target=one, args=(r,), name=f"sandbox-{r.index}") for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through `finally`: the teardown runs


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)
    plan = json.loads(Path(argv[0]).read_text())
    cgroups.join(plan["cgroup"])
    contender = make_contender(plan)
    out = Path(plan["output"])
    try:
        print("READY", flush=True)
        if sys.stdin.readline().strip() != "GO":
            return 1
        t0 = time.time()
        if plan.get("mode") == "pulls":  # PullImage alone (crinode.CriNode.time_pulls)
            pulls = contender.time_pulls(int(plan["pull_rounds"]))  # type: ignore[attr-defined]
            out.write_text(json.dumps({"t0": t0, "t_end": time.time(), "pulls": pulls, "facts": contender.facts()}))
        else:
            results = burst(contender, plan["sandboxes"], t0)
            t_end = time.time()
            out.write_text(json.dumps({"t0": t0, "t_end": t_end, "sandboxes": [r.to_json() for r in results],
                                       "facts": contender.facts()}))
        print(f"DONE {out}", flush=True)
        sys.stdin.readline()  # TEARDOWN (or EOF: the orchestrator is gone; clean up all the same)
    finally:
        contender.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
