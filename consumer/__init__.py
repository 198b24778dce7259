"""dflash.consumer"""
