"""The `modelyard` command: a thin shell over the services' entry points."""
