"""The tools above the processes: evaluation, export, status, plan, plots, the spool CLI and the demo."""
