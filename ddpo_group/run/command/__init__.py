"""The command line: flags, the config's checks and former field names, messages and exit codes, quiet output."""
