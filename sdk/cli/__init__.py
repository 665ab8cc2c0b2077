"""The ``dtrain`` command line."""
