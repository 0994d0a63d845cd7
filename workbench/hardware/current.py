"""Where this process runs: its device, the processes and machines of its launch, the CPU's model, the memory it holds."""

from __future__ import annotations

import os
import resource
import sys
import threading
from pathlib import Path

# launchers' names for the number of processes in the launch (torchrun, MPI, MVAPICH)
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def local_kind() -> str:
    """"cuda" or "cpu": the kind of device a process here computes on. Creates no CUDA context (the launcher
    asks before it starts any worker)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def current_device() -> str:
    """The device this process computes on: "cuda:N" (its current GPU) or "cpu"."""
    kind = local_kind()
    if kind == "cuda":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return kind


def gpu_count() -> int:
    """GPUs this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_names() -> list[str]:
    """The model name of each GPU this process sees."""
    import torch

    return [torch.cuda.get_device_name(i) for i in range(gpu_count())]


def peak_rss_bytes() -> int:
    """This process's peak resident memory.

    Linux keeps ru_maxrss across exec, so a child of a large process (a test runner, a launcher)
    would report its parent's peak; VmHWM belongs to the process's own address space.
    """
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB elsewhere


def rss_bytes() -> int:
    """This process's resident memory now (0 where /proc is not there to read it)."""
    return _status_bytes("VmRSS") or 0


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_memory_mb(device) -> tuple[float, str]:
    """(peak MB, what was measured): max allocated on a GPU, process peak RSS on a CPU."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return peak_rss_bytes() / 2**20, "cpu_peak_rss"


class StretchPeak:
    """The memory a stretch of code peaked at (`bytes`) and held as it began (`start`), as a budget holds a device
    to it, without resetting any of the
    process's own statistics (a run reports them). On a GPU: the allocator's reserved memory after it (it keeps
    what it reserved until asked to give it back). On a CPU: the process's peak RSS where the stretch set a new
    one, else the highest RSS sampled every millisecond while it ran (an earlier, higher peak of the process, a
    notebook's for one, is not the stretch's)."""

    SAMPLE_S = 0.001

    def __init__(self, device):
        self.device, self.bytes, self.start = device, 0, 0

    def __enter__(self) -> "StretchPeak":
        if self.device.type == "cuda":
            import torch

            self.start = torch.cuda.memory_allocated(self.device)
        else:
            self.before, self.highest = peak_rss_bytes(), rss_bytes()
            self.start = self.highest
            self.done = threading.Event()
            self.sampler = threading.Thread(target=self._sample, daemon=True)
            self.sampler.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(self.SAMPLE_S):
            self.highest = max(self.highest, rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            import torch

            self.bytes = torch.cuda.memory_reserved(self.device)
            return
        self.done.set()
        self.sampler.join()
        after = peak_rss_bytes()
        self.bytes = after if after > self.before else max(self.highest, rss_bytes())


def device_total_bytes(device) -> int:
    """The device's memory: a GPU's own, or this machine's RAM."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is an accelerator's allocation failure."""
    import torch

    return isinstance(err, torch.OutOfMemoryError)


def release_cached_memory(device) -> None:
    """Give the allocator's cached blocks back (after a step that ran out of memory)."""
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def world_size_from_env() -> int:
    """Processes in this launch, as the launcher set them (1 outside a launch)."""
    for name in WORLD_SIZE_VARIABLES:
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def processes_per_node() -> int:
    """Processes on this machine: LOCAL_WORLD_SIZE as torchrun sets it, else every process of the launch."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size_from_env()))


def node_count() -> int:
    """Machines in this launch: NUM_NODES (`workbench launch --nnodes` sets it), else the processes of the
    launch over those of this machine (torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE), else 1."""
    value = os.environ.get("NUM_NODES", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, world_size_from_env() // max(1, processes_per_node()))


def cpu_model_name() -> str:
    """The CPU's model and the flags that decide its matmul speed per dtype ("AMD EPYC" alone names CPUs
    with and without bf16 kernels): the key of every per-CPU measurement the project caches."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    speed_flags = sorted(f for f in flags if "bf16" in f or "amx" in f or f in ("avx512f", "avx2", "fp16", "sve"))
    return " ".join([model, *speed_flags]).strip()


def process_alive(pid: int) -> bool:
    """Whether a process of this machine still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not Path(f"/proc/{pid}/stat").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def available_cpus(cgroup_root: str = "/sys/fs/cgroup") -> tuple[int, str]:
    """The CPUs this process may really use, and why: its affinity, lowered to its cgroup's CPU quota where one is
    set (a container's `resources.limits.cpu`: os.cpu_count() sees the whole host, and threads beyond the quota
    are throttled, several times slower)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None and quota < cores:
        return max(1, int(quota)), f"cgroup CPU quota {quota:g}"
    return cores, f"{cores} cores"


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs allowed by the cgroup CPU quota (v2 cpu.max "QUOTA PERIOD", v1 cpu.cfs_quota_us / cfs_period_us), the
    smallest along this process's cgroup and its parents; None where no quota is set."""
    from pathlib import Path

    limits = []
    for folder in _cgroup_folders(Path(root)):
        try:
            if (folder / "cpu.max").exists():
                fields = (folder / "cpu.max").read_text().split()
                if len(fields) == 2 and fields[0] != "max":
                    limits.append(int(fields[0]) / int(fields[1]))
            elif (folder / "cpu.cfs_quota_us").exists():
                quota = int((folder / "cpu.cfs_quota_us").read_text())
                if quota > 0:
                    limits.append(quota / int((folder / "cpu.cfs_period_us").read_text()))
        except (OSError, ValueError, ZeroDivisionError):
            continue
    return min(limits) if limits else None


def _cgroup_folders(root):
    """This process's cgroup folders, innermost first, then the root (a container sees its own as the root)."""
    own = []
    try:
        for line in open("/proc/self/cgroup"):
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "" or "cpu" in controllers.split(","):
                base = root if controllers == "" else (root / "cpu" if (root / "cpu").is_dir() else root / controllers)
                own.append((base, path.strip("/")))
    except (OSError, ValueError):
        pass
    folders = []
    for base, path in own:
        parts = path.split("/") if path else []
        for depth in range(len(parts), -1, -1):
            folders.append(base.joinpath(*parts[:depth]))
    folders += [root, root / "cpu", root / "cpu,cpuacct"]
    seen, unique = set(), []
    for folder in folders:
        if folder not in seen and folder.is_dir():
            seen.add(folder)
            unique.append(folder)
    return unique
