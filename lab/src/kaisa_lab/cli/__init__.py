"""The ``kaisa`` command-line tool (entry point: :func:`kaisa_lab.cli.main.main`)."""
