"""dflash.common"""
