"""glmctl.quantize"""
