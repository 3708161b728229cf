"""glmctl.testing"""
