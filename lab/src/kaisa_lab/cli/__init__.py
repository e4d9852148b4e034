"""The ``kaisa`` command-line tool (entry point: :func:`kaisa.cli.main.main`)."""
