"""glmctl.profiles"""
