"""The one exception type of the data package.

Every message names the offending path, dataset or config field and says what to do, so a
user can fix the input without reading this code.
"""


class DataError(ValueError):
  """A corpus, dataset name, tokenizer file or data setting that cannot be used."""
