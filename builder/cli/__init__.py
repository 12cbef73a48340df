"""The ``specbuild`` command line: one module per command group."""
