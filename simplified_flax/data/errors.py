"""The data package's one exception type."""


class DataError(ValueError):
  """A corpus, dataset, tokenizer file or data setting that cannot be used; the message names
  the path, dataset or config field and says what to do."""
