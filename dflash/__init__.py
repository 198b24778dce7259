"""dflash-spool: train DFlash drafters from a target model's hidden states via a crash-safe spool.

The code lives in three subpackages mapped from the repository's top-level folders:
``dflash.common`` (common/), ``dflash.producer`` (producer/), ``dflash.consumer`` (consumer/).
"""
