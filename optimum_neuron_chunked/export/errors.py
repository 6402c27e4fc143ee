class ExportError(ValueError):
    """The export cannot proceed; the message says what to change."""
