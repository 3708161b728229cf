"""glmctl.probe"""
