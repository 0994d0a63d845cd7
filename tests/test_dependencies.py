"""The dependency lock (constraints.txt) and pyproject.toml's bounds agree, and this environment is the lock."""

import tomllib
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import ROOT


def locked() -> dict[str, Version]:
    pins = {}
    for number, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, pinned = line.partition("==")
            assert sep and pinned, f"constraints.txt:{number}: not NAME==VERSION: {line!r}"
            pins[canonicalize_name(name)] = Version(pinned)
    return pins


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [req for group in project["optional-dependencies"].values() for req in group]
    return [Requirement(req) for req in project["dependencies"] + extras]


def test_every_declared_dependency_is_bounded_and_locked_inside_its_bounds():
    pins = locked()
    for req in declared():
        operators = {spec.operator for spec in req.specifier}
        assert operators & {">=", "=="} and operators & {"<", "<=", "=="}, f"{req}: needs a lower and an upper bound"
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is declared in pyproject.toml but not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject.toml's {req.specifier}"


def test_this_environment_is_the_locked_one():
    """What the README's commands install (pip install -c constraints.txt …): a package at another version
    means the suite is not testing the lock (re-install with the README's command, or move the lock forward
    with `bash .ci/relock`)."""
    differ = []
    for name, pinned in locked().items():
        try:
            installed = Version(version(name))
        except PackageNotFoundError:
            differ.append(f"{name}: locked {pinned}, not installed")
            continue
        if Version(installed.base_version) != pinned and installed != pinned:  # torch 2.13.0+cpu is 2.13.0
            differ.append(f"{name}: locked {pinned}, installed {installed}")
    assert not differ, "\n".join(differ)
