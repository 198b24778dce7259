"""dflash-spool: train DFlash drafters from a target model's hidden states via a crash-safe spool.

The code lives in subpackages mapped from the repository's top-level folders: ``dflash.common`` (common/,
the library), ``dflash.producer`` (producer/), ``dflash.consumer`` (consumer/) and ``dflash.tools``
(tools/, the commands above the processes); docs/architecture.md draws them.
"""
