"""The Hugging Face hub without network: cached datasets and tokenizers load at once, missing
ones fail at once (instead of ~25 s of retries printed line by line).

`offline_unless_reachable()` sets HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 for this process
when the hub does not answer within `TIMEOUT_S` (already-imported `huggingface_hub` and
`datasets` are told too); a set HF_HUB_OFFLINE is left as it is.
"""
import os
import socket
import sys

from absl import logging

HUB = ("huggingface.co", 443)
TIMEOUT_S = 3.0


def reachable(address=HUB, timeout_s: float = TIMEOUT_S) -> bool:
  try:
    with socket.create_connection(address, timeout=timeout_s):
      return True
  except OSError:
    return False


def offline_unless_reachable() -> None:
  if os.environ.get("HF_HUB_OFFLINE") or reachable():
    return
  logging.info("The Hugging Face hub is unreachable: reading its datasets and tokenizers from "
               "the cache only (HF_HUB_OFFLINE=1).")
  os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
  for module, names in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                        ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))):
    if module in sys.modules:   # imported before: they read the environment at import
      for name in names:
        if hasattr(sys.modules[module], name):
          setattr(sys.modules[module], name, True)
