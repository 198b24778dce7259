"""What every command line shares: the help formatter, flags from config dataclasses, exit codes."""
