"""A named tensorflow-datasets corpus that is not prepared fails in seconds without network,
where tfds would retry its downloads and GCS look-ups for minutes: `check_tfds_available`
looks for the prepared dataset (`<data_dir>/<name>/[<config>/]<version>/dataset_info.json`)
and, when it is missing and the download host does not answer within `NETWORK_TIMEOUT_S`,
raises DataError naming the folder and the command that prepares it.
"""
import os
import socket

from etils import epath

from simplified_flax.data.errors import DataError

LOCAL_DATASETS = ("python_code", "text_files")
DOWNLOAD_HOST = ("storage.googleapis.com", 443)
NETWORK_TIMEOUT_S = 3.0


def is_prepared(name: str, data_dir: str) -> bool:
  """Whether `<data_dir>/<name>` holds a prepared version (any config, any version)."""
  root = epath.Path(data_dir) / name.split(":")[0]     # "lm1b", "wiki40b/en", "c4/en:3.1.0"
  # One listing per level (no `**`, which lists a whole GCS bucket folder).
  return root.exists() and (any(root.glob("*/dataset_info.json"))
                            or any(root.glob("*/*/dataset_info.json")))


def network_reachable(address=DOWNLOAD_HOST, timeout_s: float = NETWORK_TIMEOUT_S) -> bool:
  try:
    with socket.create_connection(address, timeout=timeout_s):
      return True
  except OSError:
    return False


def check_tfds_available(data_config) -> None:
  """Raises DataError at once when `data_config.name` is a tfds dataset that is neither
  prepared under `data_config.tfds_data_dir` nor downloadable (no network)."""
  name = data_config.name
  data_dir = data_config.tfds_data_dir or os.environ.get(
      "TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))
  if name in LOCAL_DATASETS or name.startswith("hf:") or is_prepared(name, data_dir) or network_reachable():
    return
  raise DataError(f"data.name: the dataset '{name}' is not prepared in '{data_dir}' and there "
                  f"is no network to download it. Prepare it where there is network "
                  f"(`tfds build {name.split(':')[0]} --data_dir=DIR`) and point "
                  f"data.tfds_data_dir at DIR.")
