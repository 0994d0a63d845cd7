"""One short question to the Hugging Face Hub before a model or data set is loaded from it.

transformers and datasets ask the hub with their own waits and retries: a hub (or a proxy, or a firewall) that
accepts a connection and never answers held `train`, `estimate` and `data` for minutes without a word. A request
with a deadline first turns that into one line naming what was being loaded and where from. Only a wait that ran
out stops the load; any other failure (no DNS, a refused connection, a certificate) is left to the library, which
says so itself or falls back on its cache.
"""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from urllib.parse import quote

from workbench.base.errors import WorkbenchError, escaped

_TRUE = {"1", "ON", "YES", "TRUE"}


def _offline(*variables: str) -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or any((os.environ.get(v) or "").strip().upper() in _TRUE for v in variables)


def check_hub_answers(name: str, kind: str, label: str, error: type[WorkbenchError] = WorkbenchError) -> None:
    """Raise `error` (its message starts with `label`) unless the hub answers a request about the `kind` ("model" or
    "dataset") `name` within HF_HUB_ETAG_TIMEOUT seconds, the hub library's wait for its own metadata requests.
    Any HTTP answer counts, a 404 included: the library then says what it found. Offline, nothing is asked."""
    from huggingface_hub import constants

    offline_variables = ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"]
    if kind == "dataset":
        offline_variables.append("HF_DATASETS_OFFLINE")
    if _offline(*offline_variables):
        return
    endpoint = constants.ENDPOINT.rstrip("/")
    seconds = constants.HF_HUB_ETAG_TIMEOUT
    url = f"{endpoint}/api/{kind}s/{quote(name, safe='/')}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=seconds):
            pass
    except urllib.error.HTTPError:
        pass  # an answer
    except (TimeoutError, socket.timeout) as err:
        raise error(_late(label, name, kind, endpoint, seconds)) from err
    except urllib.error.URLError as err:
        if isinstance(err.reason, (TimeoutError, socket.timeout)):
            raise error(_late(label, name, kind, endpoint, seconds)) from err
        return  # no answer of another kind: the library reports it (or loads from its cache)
    except (OSError, ValueError):  # a malformed endpoint, a dropped connection: the library's to report
        return


def _late(label: str, name: str, kind: str, endpoint: str, seconds: float) -> str:
    what = "model" if kind == "model" else "data set"
    return (f"{label}: the Hugging Face Hub at {escaped(endpoint)} did not answer within {seconds:g} s (loading the "
            f"{what} '{escaped(name)}'; HF_HUB_ETAG_TIMEOUT sets the wait, HF_HUB_OFFLINE=1 uses the local cache)")
