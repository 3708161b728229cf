"""glmctl.hub"""
