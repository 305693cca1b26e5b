"""The memory a run on this stack costs before any model, each process's RSS and PSS read from the system: a bare
driver (Python with Prefect and Ray, running a one-task flow against a Prefect server and starting a local Ray
without its dashboard, as ppoflow's local Ray runs), Ray's processes beside it and the Prefect server. What it
is for: the floor under vs_trl.py's whole-run memory, which no driver of ppoflow's can go below
(docs/benchmarks.md, tenth run). Ray's prestarted idle workers are left out (in a run one of them becomes the
model's worker).

    python benchmarks/fixed_cost.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from workloads import local_prefect_server  # benchmarks/ is its folder

BARE_DRIVER = """
import json, time
import prefect, psutil, ray

@prefect.flow
def bare():
    ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=True)
    ray.get(ray.remote(lambda: 1).remote())
    time.sleep(3)  # Ray's processes settle
    me = psutil.Process()
    found = [(me, "driver")] + [(child, " ".join(child.cmdline())) for child in me.children(recursive=True)]
    rows = []
    for process, command in found:
        try:
            memory = process.memory_full_info()
        except psutil.Error:
            continue
        if not command.startswith("ray::IDLE"):
            rows.append((command, memory.rss, memory.pss))
    ray.shutdown()
    return rows

print(json.dumps(bare()))
"""


def name_of(command: str) -> str:
    """A short name for a process's command line: the Ray worker's ``ray::<what>``, a Python program's script or
    the program's file name."""
    words = command.split()
    if command.startswith("ray::") or command == "driver":
        return words[0]
    if os.path.basename(words[0]).startswith("python"):
        return os.path.basename(next((word for word in words[1:] if word.endswith(".py")), words[0]))
    return os.path.basename(words[0])


def main() -> None:
    import psutil
    from prefect.settings import PREFECT_API_URL

    with tempfile.TemporaryDirectory() as scratch, local_prefect_server(scratch) as server_pid:
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}  # the flow runs on that server
        done = subprocess.run([sys.executable, "-c", BARE_DRIVER], env=env, capture_output=True, text=True, check=True)
        rows = [(name_of(command), rss, pss) for command, rss, pss in json.loads(done.stdout.strip().splitlines()[-1])]
        server = psutil.Process(server_pid).memory_full_info()
        rows.append(("prefect server", server.rss, server.pss))
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    print("| process | RSS GB | PSS GB |\n|---|---|---|")
    for name, rss, pss in sorted(rows, key=lambda row: -row[1]):
        print(f"| {name} | {rss / 1e9:.3f} | {pss / 1e9:.3f} |")
    print(f"| all | {sum(row[1] for row in rows) / 1e9:.2f} | {sum(row[2] for row in rows) / 1e9:.2f} |")


if __name__ == "__main__":
    main()
