"""modelyard: route, compose and place models across inference servers."""

__version__ = "0.1.0"
