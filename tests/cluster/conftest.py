import sys

import pytest

from .helpers import COMMON, RECIPE, adapter, finish, start


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted one-process run that every stopped and continued one must reproduce bitwise."""
    run_dir = tmp_path_factory.mktemp("cluster") / "reference"
    code, out = finish(start([sys.executable, "-m", "workbench", "train", RECIPE, "--no-progress",
                              f"output.dir={run_dir}", *COMMON, "output.save_every=null"]))
    assert code == 0, out
    return adapter(run_dir)
