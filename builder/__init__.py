"""specbuild builder: the ``specbuild`` command line and the build-side library."""
