"""dflash.producer"""
