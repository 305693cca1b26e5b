"""The whole-run memory and CPU of a benchmark's processes, read from the system (benchmarks/vs_trl.py): every
process under a run's root (its driver, Ray's workers and system processes) and the Prefect server, sampled from
/proc through psutil, by kind."""

from __future__ import annotations

import threading

KINDS = ("driver", "ray workers", "ray system", "prefect server", "other")


class ProcessTree:
    """Samples every ``interval_s`` the process trees under ``roots`` (pid -> the kind its root counts as): keeps
    the peak of their summed RSS (that sample by kind, with the RSS and niceness of the largest Ray worker, the
    model's) and of their summed PSS, and each process's CPU seconds while sampled, summed by kind (``cpu_s``): a
    process that was running before (the Prefect server, one for all runs) counts from the first sample on."""

    def __init__(self, roots: dict[int, str], interval_s: float = 0.2):
        self.roots, self.interval_s = roots, interval_s
        self.peak = {"rss": 0, "pss": 0, "by_kind": {}, "model_worker": None}
        self._cpu: dict[int, tuple[str, float]] = {}
        self._cpu_before: dict[int, float] = {}
        """The CPU seconds of each root that was running before (not started by the run), at the first sample."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def __enter__(self) -> ProcessTree:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def cpu_s(self) -> dict[str, float]:
        spent = {pid: (kind, s - self._cpu_before.get(pid, 0.0)) for pid, (kind, s) in self._cpu.items()}
        return {kind: sum(s for k, s in spent.values() if k == kind) for kind in KINDS}

    @staticmethod
    def _kind(process, root_kind: str) -> str:
        """What a process under a root counts as: under the driver, Ray's workers (``ray::<what>``), Ray's own
        processes (raylet, GCS, agents) or other (anything else the driver started)."""
        if root_kind != "driver":
            return root_kind
        command = " ".join(process.cmdline())
        return "ray workers" if command.startswith("ray::") else "ray system" if "ray" in command else "other"

    def _sample_until_stopped(self) -> None:
        import psutil

        while not self._stop.is_set():
            rss = pss = 0
            by_kind, largest_worker = dict.fromkeys(KINDS, 0), (0, None)
            for root, root_kind in self.roots.items():
                try:
                    top = psutil.Process(root)
                    tree = [(top, root_kind), *((child, None) for child in top.children(recursive=True))]
                except psutil.Error:  # the root ended
                    continue
                for process, kind in tree:
                    try:
                        memory, cpu = process.memory_full_info(), process.cpu_times()
                        kind = kind or self._kind(process, root_kind)
                        if kind == "ray workers" and memory.rss > largest_worker[0]:
                            largest_worker = (memory.rss, process.nice())
                    except psutil.Error:  # ended meanwhile
                        continue
                    if process.pid not in self._cpu and kind != "driver" and process.pid in self.roots:
                        self._cpu_before[process.pid] = cpu.user + cpu.system
                    self._cpu[process.pid] = (kind, cpu.user + cpu.system)
                    rss, pss, by_kind[kind] = rss + memory.rss, pss + memory.pss, by_kind[kind] + memory.rss
            self.peak["pss"] = max(self.peak["pss"], pss)
            if rss > self.peak["rss"]:
                self.peak.update(rss=rss, by_kind=by_kind, model_worker=largest_worker if largest_worker[0] else None)
            self._stop.wait(self.interval_s)
