"""glmctl.kernels"""
