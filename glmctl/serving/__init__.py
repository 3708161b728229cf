"""glmctl.serving"""
