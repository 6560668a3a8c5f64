"""The error every layer raises for input it cannot use; it imports nothing, so `lt-opd validate` stays light."""


class InputError(ValueError):
    """Input that cannot be used (a data file, a row, an image, a sample): the message names the file, the row and
    the field."""
