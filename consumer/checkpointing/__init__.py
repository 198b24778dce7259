"""The consumer's checkpoints, one concern in one folder: what a checkpoint holds (``state.py``), when and
how it is saved without stalling training (``checkpointer.py``, ``background.py``), what a save the store
refuses costs and where the state goes then (``outage.py``), and where a run starts again (``resume.py``)."""
