"""Hub ids of ``hf-accel sft`` (``--model``, ``--tokenizer``, ``--dataset``), looked up once before anything loads.

Without a network, transformers' loaders retry each file for tens of seconds before their error (measured: 27 s for
a config.json on a machine whose DNS fails at once). One metadata request with a short timeout answers first: the
id exists, does not (or is gated), or the hub cannot be reached, in which case the hub cache's copy is used
(``local_files_only``) or the run is refused in one line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UsageError

PROBE_TIMEOUT_S = 10.0
# a file every saved model / tokenizer folder holds, to ask the hub cache whether it has the id
_CACHE_PROBE = {"model": "config.json", "tokenizer": "tokenizer_config.json"}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]


def _cached(name: str, kind: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, _CACHE_PROBE[kind]), str)
    except Exception:  # noqa: BLE001 (an id the cache cannot even parse is not cached)
        return False


def model_source(name: str, flag: str = "--model", kind: str = "model") -> dict[str, Any]:
    """from_pretrained's keywords for ``name``: {} for a local folder or an id the hub serves, ``local_files_only``
    when the hub cannot be reached but its cache holds the id; a ``UsageError`` within seconds otherwise."""
    if Path(name).expanduser().exists():
        return {}
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    cached = _cached(name, kind)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return {"local_files_only": True}
        raise UsageError(f"{flag} {name}: not a local folder, and not in the hub cache while HF_HUB_OFFLINE=1; pass "
                         "a local folder, or download it where there is a network (huggingface-cli download "
                         f"{name})")
    try:
        HfApi().model_info(name, timeout=PROBE_TIMEOUT_S)
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise UsageError(f"{flag} {name}: the hub has no {kind} {name} this machine may read "
                         f"({_first_line(e)}); check the id, or log in (huggingface-cli login) for a gated one") from None
    except Exception as e:  # noqa: BLE001 (no network, DNS, a proxy, a timeout: the hub cannot answer)
        if cached:
            print(f"note: the hub cannot be reached ({_first_line(e)}); {flag} {name} loads from the hub cache",
                  flush=True)
            return {"local_files_only": True}
        raise UsageError(f"{flag} {name}: not a local folder, the hub cannot be reached ({_first_line(e)}), and the "
                         "hub cache has no copy; connect to the network, or pass a local folder") from None
    return {}


def check_dataset_id(name: str) -> None:
    """Refuse a --dataset hub id the hub cannot serve, in seconds (datasets' own loader retries for longer)."""
    import os

    if Path(name).expanduser().exists() or os.environ.get("HF_DATASETS_OFFLINE", "").lower() in ("1", "true", "yes"):
        return
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return  # datasets reads the same setting and answers from its cache at once
    try:
        HfApi().dataset_info(name, timeout=PROBE_TIMEOUT_S)
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise UsageError(f"--dataset {name}: not a local file or folder, and the hub has no dataset {name} this "
                         f"machine may read ({_first_line(e)})") from None
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"--dataset {name}: not a local file or folder, and the hub cannot be reached "
                         f"({_first_line(e)}); connect to the network, pass a local file, or set "
                         "HF_DATASETS_OFFLINE=1 to use a copy datasets cached before") from None
