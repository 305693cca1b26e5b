"""The whole-run memory and CPU of a benchmark's processes, read from the system (benchmarks/vs_trl.py): every
process under a run's root (its driver, Ray's workers and system processes) and the Prefect server, sampled from
/proc through psutil, by kind. The sampler shares the cores with what it measures, so each tick reads only the
cheap counters (RSS, CPU times); listing the tree (a scan of /proc) and PSS (a walk of each process's page
tables) are read every ``slow_every`` ticks."""

from __future__ import annotations

import threading

KINDS = ("driver", "ray workers", "ray system", "prefect server", "other")


class ProcessTree:
    """Samples every ``interval_s`` the process trees under ``roots`` (pid -> the kind its root counts as): keeps
    the peak of their summed RSS (that sample by kind, with the RSS and niceness of the largest Ray worker, the
    model's) and of their summed PSS (every ``slow_every`` samples), and each process's CPU seconds while
    sampled, summed by kind (``cpu_s``): a process that was running before (the Prefect server, one for all runs)
    counts from the first sample on."""

    def __init__(self, roots: dict[int, str], interval_s: float = 0.2, slow_every: int = 5):
        self.roots, self.interval_s, self.slow_every = roots, interval_s, slow_every
        self.peak = {"rss": 0, "pss": 0, "by_kind": {}, "model_worker": None}
        self._cpu: dict[int, tuple[str, float]] = {}
        self._cpu_before: dict[int, float] = {}
        """The CPU seconds of each root that was running before (not started by the run), at the first sample."""
        self._processes: dict[int, tuple[object, str]] = {}
        """pid -> (psutil process, kind), listed every ``slow_every`` samples."""
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

    def _list(self) -> None:
        """The processes now under the roots, each kind worked out once (a Ray worker renames itself to
        ``ray::<class>`` as it starts, so a process is looked at again until it is known as a worker)."""
        import psutil

        listed = {}
        for root, root_kind in self.roots.items():
            try:
                top = psutil.Process(root)
                tree = [(top, root_kind), *((child, None) for child in top.children(recursive=True))]
            except psutil.Error:  # the root ended
                continue
            for process, kind in tree:
                known = self._processes.get(process.pid)
                try:
                    listed[process.pid] = (
                        known
                        if known and known[1] == "ray workers"
                        else (process, kind or self._kind(process, root_kind))
                    )
                except psutil.Error:  # ended meanwhile
                    continue
        self._processes = listed

    def _sample_until_stopped(self) -> None:
        import psutil

        tick = 0
        while not self._stop.is_set():
            slow = tick % self.slow_every == 0
            if slow:
                self._list()
            rss = pss = 0
            by_kind, largest_worker = dict.fromkeys(KINDS, 0), (0, None)
            for pid, (process, kind) in self._processes.items():
                try:
                    resident, cpu = process.memory_info().rss, process.cpu_times()
                    pss += process.memory_full_info().pss if slow else 0
                    if kind == "ray workers" and resident > largest_worker[0]:
                        largest_worker = (resident, process)
                except psutil.Error:  # ended meanwhile
                    continue
                if pid not in self._cpu and kind != "driver" and pid in self.roots:
                    self._cpu_before[pid] = cpu.user + cpu.system
                self._cpu[pid] = (kind, cpu.user + cpu.system)
                rss, by_kind[kind] = rss + resident, by_kind[kind] + resident
            self.peak["pss"] = max(self.peak["pss"], pss)
            if rss > self.peak["rss"]:
                worker = None
                if largest_worker[1] is not None:
                    try:
                        worker = (largest_worker[0], largest_worker[1].nice())
                    except psutil.Error:
                        pass
                self.peak.update(rss=rss, by_kind=by_kind, model_worker=worker)
            tick += 1
            self._stop.wait(self.interval_s)
