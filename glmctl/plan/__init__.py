"""glmctl.plan"""
