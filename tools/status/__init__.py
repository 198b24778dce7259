"""``dflash-status``: one screen on a live or finished run. ``cli.py`` the command and the snapshot it
collects, ``sources.py`` where it reads a run from, ``processes.py`` the process table and each process's
state, ``render.py`` the snapshot as text."""
