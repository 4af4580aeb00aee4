"""One module per `specserve` subcommand; see cluster/cli.py."""
