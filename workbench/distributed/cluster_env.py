"""The launch a process finds itself in, read from the variables engines set: refused when half-configured.

Kubernetes (Kubeflow's PyTorchJob and Trainer) sets torchrun's own variables, PET_NNODES, PET_NPROC_PER_NODE and
PET_NODE_RANK, with MASTER_ADDR and MASTER_PORT; an Indexed Job gives each pod JOB_COMPLETION_INDEX. They are
`workbench launch`'s defaults, so a pod's command needs no flags; flags on the command line win.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from workbench.base.errors import RecipeError
from workbench.hardware.current import gpu_count

# variables that only make sense together: one without the other is a launch set up by half
PAIRS = (("RANK", "WORLD_SIZE"), ("MASTER_ADDR", "MASTER_PORT"))
# what a launcher tells each process it starts: `workbench launch` starts its own, so these in its environment are
# stale (a shell that ran a rank, a pod's own) and are not passed on
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE")


def check_launch_env(env: Mapping[str, str] | None = None) -> None:
    """RecipeError naming both variables where a process finds one of a pair without the other."""
    env = os.environ if env is None else env
    for one, other in PAIRS:
        if bool(env.get(one, "").strip()) != bool(env.get(other, "").strip()):
            have, missing = (one, other) if env.get(one, "").strip() else (other, one)
            raise RecipeError(f"{have} is set ({env[have]!r}) but {missing} is not: a launcher sets both; set "
                              f"{missing} too, or unset {have}")
    if env.get("MASTER_ADDR", "").strip():
        check_host("MASTER_ADDR", env["MASTER_ADDR"])
    port = env.get("MASTER_PORT", "").strip()
    if port and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise RecipeError(f"MASTER_PORT: expected a port from 1 to 65535, got {port!r}")
    world = env.get("WORLD_SIZE", "").strip()
    if world.isascii() and world.isdigit() and int(world) > 1 and not env.get("MASTER_ADDR", "").strip():
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):  # an engine that formed the group itself
            raise RecipeError(f"WORLD_SIZE is {world} but MASTER_ADDR and MASTER_PORT are not set: the processes "
                              "cannot find each other; start them with `workbench launch` (or set both), or unset "
                              "RANK and WORLD_SIZE left over from another launch")


_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})")


def check_host(name: str, host: str) -> None:
    """RecipeError naming `name` unless `host` is an IP address or a host name: a value with a space, a port
    (`host:port`) or nothing at all would otherwise surface as a traceback of torchrun's rendezvous."""
    host = host.strip()
    try:
        ipaddress.ip_address(host)  # IPv6 holds colons of its own
        return
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(host):
        raise RecipeError(f"{name}: expected the IP address or host name of the rank-0 machine, got {host!r}"
                          + (" (the port goes in MASTER_PORT)" if ":" in host and name == "MASTER_ADDR" else ""))


@dataclass
class LaunchDefaults:
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master: str = "127.0.0.1:29500"
    source: str = ""  # the variables that gave them, for the printed command's reader


def launch_defaults(env: Mapping[str, str] | None = None) -> LaunchDefaults:
    """`workbench launch`'s defaults from the pod's environment (PET_*, MASTER_ADDR/PORT, JOB_COMPLETION_INDEX)."""
    env = os.environ if env is None else env
    found = LaunchDefaults()
    used = []
    if env.get("PET_NNODES", "").strip():
        found.nnodes = _nodes(env["PET_NNODES"])
        used.append("PET_NNODES")
    if env.get("PET_NPROC_PER_NODE", "").strip():
        found.nproc = _count("PET_NPROC_PER_NODE", env["PET_NPROC_PER_NODE"])
        used.append("PET_NPROC_PER_NODE")
    for name in ("PET_NODE_RANK", "JOB_COMPLETION_INDEX"):
        if env.get(name, "").strip():
            found.node_rank = _count(name, env[name], least=0)
            used.append(name)
            break
    else:
        if found.nnodes > 1:
            raise RecipeError(f"PET_NNODES is {found.nnodes} but neither PET_NODE_RANK nor JOB_COMPLETION_INDEX "
                              "is set: each pod needs its node rank (or pass --node-rank)")
    check_launch_env({k: env.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT")})
    if env.get("MASTER_ADDR", "").strip():
        found.master = f"{env['MASTER_ADDR'].strip()}:{env['MASTER_PORT'].strip()}"
        used += ["MASTER_ADDR", "MASTER_PORT"]
    elif found.nnodes > 1:
        raise RecipeError(f"PET_NNODES is {found.nnodes} but MASTER_ADDR and MASTER_PORT are not set: every pod "
                          "needs the address of node rank 0 (or pass --master)")
    found.source = ", ".join(used)
    return found


def _nodes(text: str) -> int:
    """PET_NNODES: N, or N:N (torchrun's elastic MIN:MAX, accepted where both are the same)."""
    low, _, high = text.strip().partition(":")
    if high and high != low:
        raise RecipeError(f"PET_NNODES: {text!r} asks for an elastic node count; the workbench runs a fixed one "
                          "(set it to N or N:N)")
    return _count("PET_NNODES", low)


def _count(name: str, text: str, least: int = 1) -> int:
    text = text.strip()
    if text == "auto" and name == "PET_NPROC_PER_NODE":  # torchrun's `auto`: one per GPU, else one
        return max(1, gpu_count())
    if not (text.isascii() and text.isdigit()) or int(text) < least:
        raise RecipeError(f"{name}: expected a whole number of at least {least}, got {text!r}")
    return int(text)
