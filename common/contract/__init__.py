"""The contract between producers and consumers: the spool protocol, the shard format and its codecs, sample sets, epochs."""
